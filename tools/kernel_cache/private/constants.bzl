"""Constants shared by the kernel-cache rules and //kernel_cache:BUILD.bazel (through defs.bzl)."""

ARCHS = {"12.0f": "120f", "9.0a": "90a"}

VARIANTS = ["full", "lean"]

# tools/kernel_cache/actions.py SPEC_SCHEMA: the spec files' format version
# (//tests/cpu/kernel_cache:spec_check checks that these files equal the tool's
# object_spec/link_spec).
SPEC_SCHEMA = 1

# Checked-in plans: (arch, variant) -> plan file. 9.0a lean is not planned (no Hopper use).
PLAN_FILES = {
    ("12.0f", "full"): "plan_120f_full.bzl",
    ("12.0f", "lean"): "plan_120f_lean.bzl",
    ("9.0a", "full"): "plan_90a_full.bzl",
}
