"""Module extensions of the kernel cache (MODULE.bazel):

  kernel_toolchain  the pinned compiler toolchain's repositories @kimi_cuda (a CUDA root from the
                    lock's NVIDIA wheels) and @kimi_cxx_userland (g++-12 and its C library from
                    pinned Debian .debs); see private/toolchain_repos.bzl
  kernel_plans      @kernel_cache_plans: every checked-in kernel_cache/plan_*.bzl, loaded for
                    //kernel_cache's BUILD file; see private/plan_index.bzl
"""

load("//tools/kernel_cache/private:plan_index.bzl", _kernel_plans = "kernel_plans")
load("//tools/kernel_cache/private:toolchain_repos.bzl", _kernel_toolchain = "kernel_toolchain")

kernel_plans = _kernel_plans
kernel_toolchain = _kernel_toolchain
