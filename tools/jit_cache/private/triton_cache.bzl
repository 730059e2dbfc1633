"""triton_cache: Triton kernels of SGLang's serving calls built ahead of time in Triton's cache
layout (see //tools/jit_cache:defs.bzl)."""

load("//image:constants.bzl", "SOURCE_DATE_EPOCH", "TRITON_LIBCUDA_PATH")
load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_tool_args", "run_on_image")

def _triton_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args, image_files = image_tool_args(ctx, "build-triton")
    if ctx.file.calls:
        args.add("--calls", ctx.file.calls)
    else:
        args.add("--driver-only")
    args.add("--source-date-epoch", str(SOURCE_DATE_EPOCH))
    args.add("--cuda-home", ctx.file._cuda_identity.dirname)
    args.add("--userland", ctx.file._userland_identity.dirname)
    args.add("--libcuda-path", TRITON_LIBCUDA_PATH)
    extra = []
    if ctx.file.runtime:
        args.add("--runtime", ctx.file.runtime)
        args.add("--host-triton", ctx.file.host_triton)
        args.add("--host-python-headers", ctx.file.host_python_headers)
        extra = [ctx.file.runtime, ctx.file.host_triton, ctx.file.host_python_headers]
    args.add("--out", out.path)

    # Sandboxed and remote-cacheable: the image's base tar and installed trees, the call list,
    # the pinned compiler userland and CUDA root (Triton's driver module and its libcuda link
    # stub) and the tool's sources are every input (Triton and its ptxas are the image's own).
    return run_on_image(
        ctx,
        "tools.jit_cache.triton_aot",
        args,
        image_files,
        ([ctx.file.calls] if ctx.file.calls else []) + extra + [ctx.file._cuda_identity, ctx.file._userland_identity],
        [ctx.attr._cuda[DefaultInfo].files, ctx.attr._userland[DefaultInfo].files],
        out,
        "TritonCache",
        "Compiling Triton kernels of SGLang's serving calls for %s (stack %s)" % (ctx.attr.arch, ctx.attr.stack),
    )

triton_cache = rule(
    implementation = _triton_cache_impl,
    doc = "Triton cache entries of `calls` (its `stack` entries) for `arch` and Triton's driver module (cuda_utils), + kimi-k3-triton.json. Output group image_inputs: the base tar and installed trees it ran on (for check-triton).",
    attrs = {
        "arch": attr.string(mandatory = True, values = ["12.0", "9.0"]),
        "runtime": attr.label(allow_single_file = [".json"], doc = "key the cache for another host's Triton: a JSON file with a triton_runtime object (tools/jit_cache/triton_aot.py --runtime); needs host_triton and host_python_headers"),
        "host_triton": attr.label(allow_single_file = [".whl"], doc = "with runtime: that host's Triton wheel (the image's release, another CPython)"),
        "host_python_headers": attr.label(allow_single_file = [".deb"], doc = "with runtime: that host's Python headers (libpython3.X-dev)"),
        "stack": attr.string(mandatory = True),
        "calls": attr.label(allow_single_file = [".json"], doc = "jit_cache/triton_calls.json; without it only Triton's driver module is built"),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers up to SGLang's own: base first"),
        "_tool": attr.label(default = "//tools/jit_cache:triton_aot"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
