"""The image's fixed values: image/BUILD.bazel builds with them, tests/cpu/image checks the built
layers against them (one definition, so a change cannot leave a test comparing stale values)."""

# Fixed, never the wall clock: every mtime in every layer and the config's `created`.
# 2026-01-01T00:00:00Z. Changing it changes every digest.
SOURCE_DATE_EPOCH = "1767225600"

SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"

GATE_MANIFEST_DIR = "/usr/share/kimi-k3/patch-gate"

ENTRYPOINT = "/usr/local/bin/kimi-k3-entrypoint"

# The launch profiles (image/profiles/NAME.json) as the image ships them: the entrypoint's
# --profile / --print-profile read them from here.
PROFILES_DIR = "/usr/share/kimi-k3/profiles"

SBOM_PATH = "/usr/share/kimi-k3/sbom.spdx.json"

# SGLang's JIT modules built ahead of time (//jit_cache:sglang_jit_<IMAGE_CUDA_ARCH>), read-only,
# in SGLang's cache layout with their manifest kimi-k3-sglang-jit.json; the entrypoint links them
# into the writable $SGLANG_JIT_CACHE_DIR.
SGLANG_JIT_DIR = "/usr/share/kimi-k3/sglang-jit"

# Triton kernels of SGLang's serving calls built ahead of time (//jit_cache:triton_12_0), read-only,
# Triton's cache entries without their group files, with the manifest kimi-k3-triton.json; the
# entrypoint writes their group files into the writable $TRITON_CACHE_DIR.
TRITON_DIR = "/usr/share/kimi-k3/triton"

# Where Triton is told libcuda.so.1 lies (the image's ENV). Triton's driver module, which Triton
# would build with a C compiler the image lacks at the first kernel launch, is keyed on it, so
# it must be one fixed value: the directory the NVIDIA container toolkit mounts the driver into
# on Debian images. It is only a link-time -L for Triton; libcuda.so.1 loads through the
# dynamic loader wherever the runtime put it.
TRITON_LIBCUDA_PATH = "/usr/lib/x86_64-linux-gnu"

# The GPU arch of the image: its FLASHINFER_CUDA_ARCH_LIST and the arch its kernel cache must be
# built for (the kernel-cache layer action refuses any other).
IMAGE_CUDA_ARCH = "12.0f"

# The first-use compile recorder (tools/jit_cache/first_use_hooks.py and its site directory's
# sitecustomize.py, layer first_use): `--record-first-use DIR` / `--verify-first-use` put this
# directory first on PYTHONPATH (image/entrypoint.py).
FIRST_USE_SITE = "/usr/share/kimi-k3/first-use/site"
