"""Constants shared by the kernel-cache rules and //kernel_cache:BUILD.bazel (through defs.bzl)."""

ARCHS = {"12.0f": "120f", "9.0a": "90a"}

VARIANTS = ["full", "lean"]

# tools/kernel_cache/actions.py SPEC_SCHEMA: the spec files' format version
# (//tests/cpu/kernel_cache:spec_check checks that these files equal the tool's
# object_spec/link_spec).
SPEC_SCHEMA = 1

# What --//kernel_cache:selection=default (the default) means per arch: selections.json
# default_for_arch (//tests/cpu/kernel_cache:test_selection checks the two agree).
DEFAULT_SELECTION = {"12.0f": "kimi-k3", "9.0a": "gpu-test-sm90"}
