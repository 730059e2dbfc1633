"""Thin Bazel rules over tools/kernel_cache (all logic is in the Python tool; internals in private/):
one action per FlashInfer object.

    flashinfer_kernel_cache(name, arch = None)

builds the AOT layout `<name>_aot/flashinfer/data/aot/<module>/<module>.so` + kernel_cache.json
from the patch gate's tree (`//flashinfer_patches:flashinfer_tree`, output group `tree`). The
checked-in plan (kernel_cache/plan_<arch>_<variant>.bzl) is picked by the build settings
`//kernel_cache:arch` (12.0f | 9.0a; fixed when `arch` is given), `//kernel_cache:selection`
(default | full | kimi-k3 | gpu-test-sm90) and `//kernel_cache:variant` (full | lean, for the
`full` selection), so every object is known at analysis time. Action graph:

    gen-sources (per module with generated sources)
      -> compile-object (per object; resource_set from the plan's peak-memory hint, so Bazel runs
         no more of the big SM120 grouped-GEMM compiles at once than its RAM budget holds)
      -> link-module (per module) -> assemble (AOT layout + kernel_cache.json)

Each object is its own cached action, so an interrupted build resumes with every finished
object, and `--//kernel_cache:only=silu_and_mul,norm` builds a subset (the plan's other modules
are simply not wired).

Toolchain (tools/kernel_cache/toolchain.py): every compile and link action declares the pinned
CUDA root (@kimi_cuda: the lock's NVIDIA wheels), the compiler userland (@kimi_cxx_userland:
bookworm's g++-12 from pinned .debs, used through --sysroot) and tvm-ffi's headers from the
stack's own wheel as inputs, and runs sandboxed (remote caches and executors can take it).
`--//kernel_cache:cuda_home=DIR` is the escape hatch to a local CUDA (its actions are
`no-remote`). The nvcc release must equal the plan's; the tool checks it and writes the
toolchain's identity (pins by sha256) into kernel_cache.json.

Every action's tool inputs are the sources of the py_library //tools/kernel_cache:actions (and its
deps), so only an edit to what the actions run invalidates compiled objects.

    kernel_cache_plan_settings(selection, variant, stack, plans)

the config settings that pick a plan by arch, selection, variant and stack
(private/plan_settings.bzl).

    flashkda_wheel(name, arch, config_json)

FlashKDA's wheel (flash_kda + flash_kda_C) for one arch, from the pins `flashkda` and
`flashkda-cutlass` and the stack's torch, with the same pinned toolchain and prefix maps
(private/flashkda.bzl; the logic and why it does not run setup.py: flashkda.py). config_json is
kernel_cache/flashkda.bzl's FLASHKDA; the wheel's name and version come from the pin's commit.

    flashinfer_tree_stand_in(name)

an empty tree for a cache target that is only analysed (//kernel_cache:spec_cache).

ARCHS, VARIANTS, DEFAULT_SELECTION, SPEC_SCHEMA: constants (private/constants.bzl). PLANS
((arch, plan) -> struct(file, plan, stack, base)) and SELECTIONS (selection -> arch): every
checked-in kernel_cache/plan_*.bzl, indexed by its file name (private/plans.bzl), what
//kernel_cache's BUILD file declares its settings and plans from (a plan is picked by arch and
"plan": a variant of the `full` selection or a kernel selection's name, ".<stack>" for a stack
other than the default; see //kernel_cache:BUILD.bazel). PLANS_TOOL_ARGS, PLANS_TOOL_DATA: what
`python3 -m tools.kernel_cache.plans` gets for them (//kernel_cache:update_plans and the CPU
check //tests/cpu/kernel_cache:plans_current).
"""

load("//tools/kernel_cache/private:constants.bzl", _ARCHS = "ARCHS", _DEFAULT_SELECTION = "DEFAULT_SELECTION", _SPEC_SCHEMA = "SPEC_SCHEMA", _VARIANTS = "VARIANTS")
load("//tools/kernel_cache/private:flashkda.bzl", _flashkda_wheel = "flashkda_wheel", _flashkda_wheel_name = "flashkda_wheel_name")
load("//tools/kernel_cache/private:kernel_cache.bzl", _flashinfer_kernel_cache = "flashinfer_kernel_cache", _flashinfer_tree_stand_in = "flashinfer_tree_stand_in")
load("//tools/kernel_cache/private:plan_settings.bzl", _kernel_cache_plan_settings = "kernel_cache_plan_settings")
load("//tools/kernel_cache/private:plans.bzl", _PLANS = "PLANS", _PLANS_TOOL_ARGS = "PLANS_TOOL_ARGS", _PLANS_TOOL_DATA = "PLANS_TOOL_DATA", _SELECTIONS = "SELECTIONS")

ARCHS = _ARCHS
DEFAULT_SELECTION = _DEFAULT_SELECTION
PLANS = _PLANS
PLANS_TOOL_ARGS = _PLANS_TOOL_ARGS
PLANS_TOOL_DATA = _PLANS_TOOL_DATA
SELECTIONS = _SELECTIONS
SPEC_SCHEMA = _SPEC_SCHEMA
VARIANTS = _VARIANTS
flashinfer_kernel_cache = _flashinfer_kernel_cache
flashkda_wheel = _flashkda_wheel
flashkda_wheel_name = _flashkda_wheel_name
flashinfer_tree_stand_in = _flashinfer_tree_stand_in
kernel_cache_plan_settings = _kernel_cache_plan_settings
