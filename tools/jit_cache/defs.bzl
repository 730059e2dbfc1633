"""Thin Bazel rules over tools/jit_cache (all logic is in the Python tool; internals in private/).

    jit_cache_inventories()

in the data folder (//jit_cache): per stack of the lock, `:built_<stack>` (that stack's inventory
recomputed by one action from the patch gate's SGLang tree of the stack, whatever
--//third_party:stack says), `:built` (all of them) and `:update_inventory` (`bazel run`: writes
them over the checked-in inventory.<stack>.json of the package).

    sglang_jit_cache(name, arch, stack, modules, layers)

SGLang's JIT modules (load_jit) of `modules` built ahead of time for `arch` (12.0f | 9.0a) in
SGLang's own cache layout, by SGLang's own load_jit running under the image's python3.11 over the
`layers`' installed trees (tools/jit_cache/sglang_aot.py); one sandboxed action, remote-cacheable.

    triton_cache(name, arch, stack, calls, layers)

The Triton kernels of `calls` (SGLang's own serving calls, tools/jit_cache/triton_worker.py) for
`arch` (12.0) in Triton's cache layout, compiled through Triton's launch path against a stand-in
device under the image's python3.11 over the `layers`' trees (tools/jit_cache/triton_aot.py), and
Triton's own driver module (cuda_utils, which Triton builds with a C compiler at its first
launch), keyed as the image keys it. Without `calls`: the driver module alone.

    triton_recorded_cache(name, arch, stack, recording, layers, kernel_plan, sglang_jit)

The first-use caches a recording (jit_cache/recordings/<stack>.<arch>.json) lists, rebuilt: each
Triton specialization replayed with Triton's own preload against a stand-in device of the
recorded target (every key must be the recorded one, else the build fails naming the kernel and
the part that differs), each cacheable autotune result as Triton's autotune file; the recorded
SGLang JIT and FlashInfer modules checked against `sglang_jit` and `kernel_plan`
(tools/jit_cache/triton_recorded.py).

    image_bytecode(name, stack, modules, layers)

The image's Python bytecode for the builds and tests that run its python3 (not in the image):
what the image's python3.11 imports for `modules` over the `layers`' trees, its standard library
included, compiled by it as checked-hash .pyc laid out for PYTHONPYCACHEPREFIX
(tools/jit_cache/bytecode.py). A LayerInfo: put it last in the `layers` of sglang_jit_cache,
triton_cache or oci_rootfs; their tools point the image's python3 at it.

INVENTORY_CHECK_ARGS, INVENTORY_CHECK_DATA: what `python3 -m tools.jit_cache check` gets for
every stack (//tests/cpu/jit_cache:inventory_current).
"""

load("//tools/jit_cache/private:bytecode.bzl", _image_bytecode = "image_bytecode")
load("//tools/jit_cache/private:inventory.bzl", _CHECK_ARGS = "CHECK_ARGS", _CHECK_DATA = "CHECK_DATA", _jit_cache_inventories = "jit_cache_inventories")

load("//tools/jit_cache/private:sglang_jit.bzl", _sglang_jit_cache = "sglang_jit_cache")
load("//tools/jit_cache/private:triton_cache.bzl", _triton_cache = "triton_cache")
load("//tools/jit_cache/private:triton_recorded.bzl", _triton_recorded_cache = "triton_recorded_cache")

image_bytecode = _image_bytecode
INVENTORY_CHECK_ARGS = _CHECK_ARGS
INVENTORY_CHECK_DATA = _CHECK_DATA
jit_cache_inventories = _jit_cache_inventories
sglang_jit_cache = _sglang_jit_cache
triton_cache = _triton_cache
triton_recorded_cache = _triton_recorded_cache
