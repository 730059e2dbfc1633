"""checked_tree: a patched_tree's outputs plus the drift check as a validation action.

The built manifest must equal the committed one; the check runs in the `_validation` output
group, so every build that consumes the tree (the image layers, the kernel cache, the patched
wheel) fails on drift, reported by that one action, naming the file and the fix command.
"""

load(":tool.bzl", "TOOL", "tool_inputs")

_GROUPS = ["tree", "manifest", "table", "remapped", "upstream"]

def _checked_tree_impl(ctx):
    groups = ctx.attr.gate[OutputGroupInfo]
    built = groups.manifest.to_list()[0]
    stamp = ctx.actions.declare_file(ctx.label.name + ".no_drift")
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run_shell(
        command = 'set -e; export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1; "$1" -m tools.patch_gate check-manifest --built "$2" --expected-manifest "$3" --stamp "$4"',
        arguments = [py.interpreter_path, built.path, ctx.file.expected_manifest.path, stamp.path],
        inputs = depset([built, ctx.file.expected_manifest], transitive = [tool_inputs(ctx)]),
        outputs = [stamp],
        mnemonic = "PatchGateDrift",
        progress_message = "Patch gate: manifest of %s against %s" % (ctx.attr.gate.label.name, ctx.file.expected_manifest.short_path),
    )
    return [
        DefaultInfo(files = ctx.attr.gate[DefaultInfo].files),
        OutputGroupInfo(_validation = depset([stamp]), **{g: getattr(groups, g) for g in _GROUPS}),
    ]

checked_tree = rule(
    implementation = _checked_tree_impl,
    attrs = {
        "gate": attr.label(mandatory = True, providers = [OutputGroupInfo], doc = "the patched_tree target"),
        "expected_manifest": attr.label(allow_single_file = True, mandatory = True, doc = "the committed <stack>.manifest.json"),
        "_tool": attr.label(default = TOOL),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
