"""Rules the kernel cache's tests use (not part of building a cache; internals in private/).

    kernel_cache_config_files(name, src, stack, output_groups, selection = "default", only = [],
                              objects = [])

the files of output groups of `src`, built for `stack`, kernel selection `selection` and the
modules `only`, with the pinned toolchain and variant full whatever the command line says
(also forwarded as the same output groups). `src` is a flashinfer_kernel_cache target: its
groups aot (the AOT layout and kernel_cache.json), modules (.so files), objects (restricted to
`objects` when given: Bazel then runs only those objects' actions), gen (generated-source dirs),
tvm_ffi (the unpacked headers the objects are compiled against), plan (the plan file); or the
patch gate's tree (group tree), which then gets one configuration per stack. So a test takes
the stage's own products (one sandboxed, cached action per object) as data instead of
compiling inside its process.

    offline_plan_stack(selections)

a stack with a checked-in plan of each selection that needs no GitHub-only pin.
"""

load("//tools/kernel_cache/private:config_files.bzl", _kernel_cache_config_files = "kernel_cache_config_files", _offline_plan_stack = "offline_plan_stack")

kernel_cache_config_files = _kernel_cache_config_files
offline_plan_stack = _offline_plan_stack
