# FlashKDA's wheel (the optional KDA prefill backend, flash_kda + its extension flash_kda_C):
# what the build takes from the pins and from FlashKDA's own setup.py. Read by Starlark
# (//kernel_cache:flashkda_wheel_*) and by tools/kernel_cache/flashkda.py (ast.literal_eval),
# so it stays a plain literal. The compile flags are not here: they are read from the pinned
# setup.py at build time (tools/kernel_cache/flashkda.py), so a bumped pin brings its own.
FLASHKDA = {
    # The git_tree pins (third_party/pins.lock.json): FlashKDA, and the CUTLASS commit its
    # `cutlass` submodule names at that commit (git ls-tree COMMIT cutlass; a tar holds no gitlink,
    # so re-check it when bumping either pin).
    "pin": "flashkda",
    "cutlass_pin": "flashkda-cutlass",
    "cutlass_submodule": {"path": "cutlass", "commit": "5c149f52a436782210263fb2f19b354443a61c6a"},
    # The CUTLASS directories setup.py's include_dirs name: only these are unpacked, and the pin
    # flashkda-cutlass archives only these (its `paths`; a test checks they cover this list).
    "cutlass_dirs": ["include", "tools/util/include", "examples/common"],
    # setup.py's CUDAExtension sources (checked against the pinned setup.py): one compile action
    # each, so Bazel must know them before it reads the pin.
    "sources": ["csrc/flash_kda.cpp", "csrc/smxx/fwd_launch.cu"],
    # setup.py's `version='0.0.1' + rev`: the base is checked against the pinned setup.py; the
    # local label replaces its `git rev-parse --short HEAD` with the pin's commit (and the arch,
    # so the two wheels never share a name).
    "base_version": "0.0.1",
    "distribution": "flash_kda",
    # Our arch names (as --//kernel_cache:arch spells them) -> FLASH_KDA_CUDA_ARCHS values. The
    # targets build 9.0a (Hopper, the H200 GPU host) and 12.0a (SM120, the image's GPUs).
    "archs": {"9.0a": "90a", "12.0a": "120a"},
    # The stack's Python: the image's interpreter (Debian bookworm's 3.11), whose headers the
    # compiler userland brings.
    "python_tag": "cp311",
    # Shared libraries of the stack's torch and CUDA runtime the extension links, as torch's
    # CUDAExtension names them (-l<name>); linked against sonamed stubs, so their DT_NEEDED
    # entries match torch's without unpacking gigabytes of torch's libraries.
    "torch_libraries": ["c10", "torch", "torch_cpu", "torch_python", "c10_cuda", "torch_cuda"],
}
