"""Constants shared by the kernel-cache rules and //kernel_cache:BUILD.bazel (through defs.bzl)."""

ARCHS = {"12.0f": "120f", "9.0a": "90a"}

VARIANTS = ["full", "lean"]

# tools/kernel_cache/actions.py SPEC_SCHEMA: the spec files' format version
# (//tests/cpu/kernel_cache:spec_check checks that these files equal the tool's
# object_spec/link_spec).
SPEC_SCHEMA = 1

# Kernel selections (kernel_cache/selections.json) with a checked-in plan: name -> arch. The
# selection `full` (everything FlashInfer compiles) is planned per variant instead.
SELECTIONS = {"kimi-k3": "12.0f", "gpu-test-sm90": "9.0a"}

# What --//kernel_cache:selection=default (the default) means per arch: selections.json
# default_for_arch (//tests/cpu/kernel_cache:test_selection checks the two agree).
DEFAULT_SELECTION = {"12.0f": "kimi-k3", "9.0a": "gpu-test-sm90"}

# Checked-in plans: (arch, plan) -> plan file, where plan is a variant of the `full` selection
# or a selection's name, for the default stack's FlashInfer; "<plan>.pypi" for the pypi stack's
# (--//third_party:stack=pypi). 9.0a lean is not planned (no Hopper use); the pypi stack has
# only its image's plan.
PLAN_FILES = {
    ("12.0f", "full"): "plan_120f_full.bzl",
    ("12.0f", "lean"): "plan_120f_lean.bzl",
    ("9.0a", "full"): "plan_90a_full.bzl",
    ("12.0f", "kimi-k3"): "plan_120f_kimi-k3.bzl",
    ("9.0a", "gpu-test-sm90"): "plan_90a_gpu-test-sm90.bzl",
    ("12.0f", "kimi-k3.pypi"): "plan_120f_kimi-k3.pypi.bzl",
}
