"""image_bytecode: the image's Python bytecode for builds and tests (see //tools/jit_cache:defs.bzl)."""

load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_tool_args", "run_on_image")

def _image_bytecode_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args, image_files = image_tool_args(ctx, "build-bytecode")
    args.add_all(ctx.attr.modules, before_each = "--module")
    args.add("--out", out.path)
    providers = run_on_image(
        ctx,
        "tools.jit_cache.bytecode",
        args,
        image_files,
        [],
        [],
        out,
        "ImageBytecode",
        "Compiling the image's Python bytecode for %s (stack %s)" % (", ".join(ctx.attr.modules), ctx.attr.stack),
    )

    # As a layer of its own, never written into an image (no blob): the rules that run the image's
    # python3 over `layers` (sglang_jit_cache, triton_cache, oci_rootfs) take it in their layer list,
    # and their tools tell it from an installed tree by its marker (tools/jit_cache/bytecode_tree.py).
    return providers + [LayerInfo(
        name = "bytecode",
        blob = None,
        descriptor = None,
        tars = [],
        installed = out,
        trees = [],
        site_trees = [],
        files = [],
        cuda_home = False,
    )]

image_bytecode = rule(
    implementation = _image_bytecode_impl,
    doc = "Checked-hash bytecode of what the image's python3 imports for `modules` (its standard library's and site-packages'), compiled by that python3 over `layers`, laid out for PYTHONPYCACHEPREFIX. A LayerInfo for the rules that run the image's python3; never in an image.",
    attrs = {
        "arch": attr.string(default = "12.0f", doc = "FLASHINFER_CUDA_ARCH_LIST while importing (the image's)"),
        "stack": attr.string(mandatory = True),
        "modules": attr.string_list(mandatory = True, doc = "the modules the builds and tests import (their imports are compiled too)"),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers, base first"),
        "_tool": attr.label(default = "//tools/jit_cache:bytecode"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
