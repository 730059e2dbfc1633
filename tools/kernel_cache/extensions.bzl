"""Module extensions of the kernel cache (MODULE.bazel): kernel_toolchain, the pinned compiler
toolchain's repositories @kimi_cuda (a CUDA root from the lock's NVIDIA wheels) and
@kimi_cxx_userland (g++-12 and its C library from pinned Debian .debs); see
private/toolchain_repos.bzl."""

load("//tools/kernel_cache/private:toolchain_repos.bzl", _kernel_toolchain = "kernel_toolchain")

kernel_toolchain = _kernel_toolchain
