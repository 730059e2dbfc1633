"""sglang_jit_cache: SGLang's JIT modules built ahead of time in SGLang's cache layout (see
//tools/jit_cache:defs.bzl)."""

load("//image:constants.bzl", "SITE_PACKAGES")
load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_inputs")

def _sglang_jit_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    base_tar, trees = image_inputs(ctx)
    tars = [base_tar]
    args = ctx.actions.args()
    args.add("build-sglang")
    args.add("--stack", ctx.attr.stack)
    args.add("--arch", ctx.attr.arch)
    args.add("--modules", ctx.file.modules)
    args.add("--base-tar", base_tar)
    for tree in trees:
        args.add("--site-tree", tree.path)
    args.add("--site-packages", SITE_PACKAGES)
    args.add("--cuda-home", ctx.file._cuda_identity.dirname)
    args.add("--userland", ctx.file._userland_identity.dirname)
    extra = []
    if ctx.file.runtime:
        args.add("--runtime", ctx.file.runtime)
        extra.append(ctx.file.runtime)
    args.add("--out", out.path)

    # Sandboxed and remote-cacheable: every input is declared (the image's base tar and
    # installed trees, the pinned CUDA root and compiler userland, the module list, the tool's
    # sources), the output is a few MB.
    ctx.actions.run(
        executable = py.interpreter_path,
        arguments = ["-m", "tools.jit_cache.sglang_aot", args],
        inputs = depset(
            tars + trees + extra + [ctx.file.modules, ctx.file._cuda_identity, ctx.file._userland_identity],
            transitive = [
                ctx.attr._tool[DefaultInfo].default_runfiles.files,
                ctx.attr._cuda[DefaultInfo].files,
                ctx.attr._userland[DefaultInfo].files,
            ],
        ),
        outputs = [out],
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ".",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
        },
        mnemonic = "SglangJitCache",
        progress_message = "Building SGLang JIT modules for %s (stack %s) through SGLang's load_jit" % (ctx.attr.arch, ctx.attr.stack),
    )
    return [
        DefaultInfo(files = depset([out])),
        OutputGroupInfo(image_inputs = depset(tars + trees)),
    ]

sglang_jit_cache = rule(
    implementation = _sglang_jit_cache_impl,
    doc = "SGLang JIT modules of `modules` (its `stack` entries) for `arch`, in SGLang's cache layout + kimi-k3-sglang-jit.json. Output group image_inputs: the base tar and installed trees it ran on (for check-sglang).",
    attrs = {
        "arch": attr.string(mandatory = True, values = ["12.0f", "9.0a"]),
        "stack": attr.string(mandatory = True),
        "modules": attr.label(allow_single_file = [".json"], mandatory = True),
        "runtime": attr.label(allow_single_file = [".json"], doc = "key the modules for another runtime than the image: a JSON file with a sglang_jit_runtime object (tools/jit_cache/sglang_aot.py --runtime)"),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers below SGLang's own, and SGLang's: base first"),
        "_tool": attr.label(default = "//tools/jit_cache:sglang_aot"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
