"""sglang_jit_cache: SGLang's JIT modules built ahead of time in SGLang's cache layout (see
//tools/jit_cache:defs.bzl)."""

load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_tool_args", "run_on_image")

def _sglang_jit_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args, image_files = image_tool_args(ctx, "build-sglang")
    args.add("--modules", ctx.file.modules)
    args.add("--cuda-home", ctx.file._cuda_identity.dirname)
    args.add("--userland", ctx.file._userland_identity.dirname)
    extra = []
    if ctx.file.runtime:
        args.add("--runtime", ctx.file.runtime)
        extra.append(ctx.file.runtime)
    reuse = []
    if ctx.attr.reuse:
        # The same modules keyed for another runtime compile the same bytes: reuse them
        # (each build file proven equal) instead of running nvcc again.
        reused = ctx.attr.reuse[DefaultInfo].files.to_list()
        args.add("--reuse", reused[0].path)
        reuse = [ctx.attr.reuse[DefaultInfo].files]
    args.add("--out", out.path)

    # Sandboxed and remote-cacheable: every input is declared (the image's base tar and
    # installed trees, the pinned CUDA root and compiler userland, the module list, the tool's
    # sources), the output is a few MB.
    return run_on_image(
        ctx,
        "tools.jit_cache.sglang_aot",
        args,
        image_files,
        extra + [ctx.file.modules, ctx.file._cuda_identity, ctx.file._userland_identity],
        [ctx.attr._cuda[DefaultInfo].files, ctx.attr._userland[DefaultInfo].files] + reuse,
        out,
        "SglangJitCache",
        "Building SGLang JIT modules for %s (stack %s) through SGLang's load_jit" % (ctx.attr.arch, ctx.attr.stack),
    )

sglang_jit_cache = rule(
    implementation = _sglang_jit_cache_impl,
    doc = "SGLang JIT modules of `modules` (its `stack` entries) for `arch`, in SGLang's cache layout + kimi-k3-sglang-jit.json. Output group image_inputs: the base tar and installed trees it ran on (for check-sglang).",
    attrs = {
        "arch": attr.string(mandatory = True, values = ["12.0f", "9.0a"]),
        "stack": attr.string(mandatory = True),
        "modules": attr.label(allow_single_file = [".json"], mandatory = True),
        "runtime": attr.label(allow_single_file = [".json"], doc = "key the modules for another runtime than the image: a JSON file with a sglang_jit_runtime object (tools/jit_cache/sglang_aot.py --runtime)"),
        "reuse": attr.label(doc = "a sglang_jit_cache of the same arch and modules keyed for the image, whose compiles this one reuses (with `runtime`)"),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers below SGLang's own, and SGLang's: base first"),
        "_tool": attr.label(default = "//tools/jit_cache:sglang_aot"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
