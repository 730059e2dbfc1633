"""triton_cache: Triton kernels of SGLang's serving calls built ahead of time in Triton's cache
layout (see //tools/jit_cache:defs.bzl)."""

load("//image:constants.bzl", "SOURCE_DATE_EPOCH")
load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_tool_args", "run_on_image")

def _triton_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args, image_files = image_tool_args(ctx, "build-triton")
    args.add("--calls", ctx.file.calls)
    args.add("--source-date-epoch", str(SOURCE_DATE_EPOCH))
    args.add("--out", out.path)

    # Sandboxed and remote-cacheable: the image's base tar and installed trees, the call list and
    # the tool's sources are every input (Triton and its ptxas are the image's own).
    return run_on_image(
        ctx,
        "tools.jit_cache.triton_aot",
        args,
        image_files,
        [ctx.file.calls],
        [],
        out,
        "TritonCache",
        "Compiling Triton kernels of SGLang's serving calls for %s (stack %s)" % (ctx.attr.arch, ctx.attr.stack),
    )

triton_cache = rule(
    implementation = _triton_cache_impl,
    doc = "Triton cache entries of `calls` (its `stack` entries) for `arch`, + kimi-k3-triton.json. Output group image_inputs: the base tar and installed trees it ran on (for check-triton).",
    attrs = {
        "arch": attr.string(mandatory = True, values = ["12.0"]),
        "stack": attr.string(mandatory = True),
        "calls": attr.label(allow_single_file = [".json"], mandatory = True),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers up to SGLang's own: base first"),
        "_tool": attr.label(default = "//tools/jit_cache:triton_aot"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
