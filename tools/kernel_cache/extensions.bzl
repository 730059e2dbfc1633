"""Module extensions of the kernel cache (MODULE.bazel): cuda_toolchain, the local CUDA
toolchain's fingerprint repository @kimi_cuda_toolchain (see private/toolchain_fingerprint.bzl)."""

load("//tools/kernel_cache/private:toolchain_fingerprint.bzl", _cuda_toolchain = "cuda_toolchain")

cuda_toolchain = _cuda_toolchain
