"""patched_wheel: a checked tree repacked as a wheel whose version carries a local suffix
(`+kimik3.<digest>`), so nobody mistakes it for the official one."""

load(":tool.bzl", "TOOL", "tool_inputs")

def _patched_wheel_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    tree = ctx.attr.tree[OutputGroupInfo].tree.to_list()[0]
    upstream = ctx.attr.tree[OutputGroupInfo].upstream.to_list()[0]
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run_shell(
        command = 'set -e; export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH="$4"; "$1" -m tools.patch_gate repack-wheel --tree "$2" --out-dir "$3" --local-label kimik3 --modes-from "$5"',
        arguments = [py.interpreter_path, tree.path, out.path, str(ctx.attr.source_date_epoch), upstream.path],
        inputs = depset([tree, upstream], transitive = [tool_inputs(ctx)]),
        outputs = [out],
        mnemonic = "RepackWheel",
        progress_message = "Repacking the patched tree of %s as a +kimik3 wheel" % ctx.attr.tree.label,
        # The sandbox stages tree-artifact inputs as symlinks; the repack refuses symlinks (a
        # wheel carries none), so it reads the real files.
        execution_requirements = {"no-sandbox": "1"},
    )
    return [DefaultInfo(files = depset([out]))]

patched_wheel = rule(
    implementation = _patched_wheel_impl,
    attrs = {
        "tree": attr.label(mandatory = True, providers = [OutputGroupInfo]),
        "source_date_epoch": attr.int(default = 315532800, doc = "zip timestamps (1980-01-01, the zip epoch)"),
        "_tool": attr.label(default = TOOL),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
