"""The image's layers a first-use build runs on (sglang_jit_cache, triton_cache): their base
rootfs tar (the image's python3.11) and installed trees, and the one way both rules run their
tool over them."""

load("//image:constants.bzl", "SITE_PACKAGES")
load("//tools/image/private:providers.bzl", "LayerInfo")

def image_inputs(ctx):
    """(base tar, installed trees) of ctx.attr.layers, bottom layer first."""
    tars = []
    trees = []
    for layer in ctx.attr.layers:
        info = layer[LayerInfo]
        tars += info.tars
        if info.installed:
            trees.append(info.installed)
    if len(tars) != 1:
        fail("%s: layers must hold exactly one base rootfs tar (//image:layer_base), got %d" % (ctx.label, len(tars)))
    return tars[0], trees

def image_tool_args(ctx, command):
    """(args, image files) of `python -m tools.jit_cache.<tool> COMMAND` over ctx.attr.layers:
    the stack, the arch, the base tar, every installed tree and where they sit in the image."""
    base_tar, trees = image_inputs(ctx)
    args = ctx.actions.args()
    args.add(command)
    args.add("--stack", ctx.attr.stack)
    args.add("--arch", ctx.attr.arch)
    args.add("--base-tar", base_tar)
    for tree in trees:
        args.add("--site-tree", tree.path)
    args.add("--site-packages", SITE_PACKAGES)
    return args, [base_tar] + trees

def run_on_image(ctx, module, args, image_files, inputs, transitive, out, mnemonic, progress):
    """Run the tool as a sandboxed, remote-cacheable action with nothing of the host's environment;
    return the rule's providers (output group image_inputs: the image files, for its check)."""
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run(
        executable = py.interpreter_path,
        arguments = ["-m", module, args],
        inputs = depset(image_files + inputs, transitive = [ctx.attr._tool[DefaultInfo].default_runfiles.files] + transitive),
        outputs = [out],
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ".",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1",
        },
        mnemonic = mnemonic,
        progress_message = progress,
    )
    return [
        DefaultInfo(files = depset([out])),
        OutputGroupInfo(image_inputs = depset(image_files)),
    ]
