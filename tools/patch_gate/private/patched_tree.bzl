"""patched_tree: the gate's `apply` as one action.

Every patch of the series is checked (applies / already upstream / excluded / conflicts) before
any is applied; outputs the patched tree, the manifest of changed files, the table and the
wheel-layout patches for review. It fails on a conflict or bad input, not on drift:
`update_manifest` needs its manifest when it drifted.
"""

load(":tool.bzl", "TOOL", "tool_inputs")

def _patched_tree_impl(ctx):
    tree = ctx.actions.declare_directory(ctx.label.name + "/tree")
    remapped = ctx.actions.declare_directory(ctx.label.name + "/remapped")
    manifest = ctx.actions.declare_file(ctx.label.name + "/manifest.json")
    table = ctx.actions.declare_file(ctx.label.name + "/table.txt")
    target = ctx.file.target
    pin_args = []
    pin_inputs = []
    for label, name in ctx.attr.pin_files.items():
        f = label.files.to_list()[0]
        pin_args.append("--pin-file=%s=%s" % (name, f.path))
        pin_inputs.append(f)
    cmd = """set -e
export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 PATH=/usr/bin:/bin:/usr/local/bin
"$1" -m tools.patch_gate apply --series "$2" --target "$3" --target-pin "$(cat "$4")" --layout "$5" \\
  --lock "$6" --out-dir "$7" --remapped-dir "$8" --manifest "$9" --table "${10}" "${@:11}"
cat "${10}"
"""
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run_shell(
        command = cmd,
        arguments = [
            py.interpreter_path,
            ctx.file.series.path,
            target.path,
            ctx.file.target_pin.path,
            ctx.file.layout.path,
            ctx.file._lock.path,
            tree.path,
            remapped.path,
            manifest.path,
            table.path,
        ] + pin_args,
        inputs = depset(
            [ctx.file.series, target, ctx.file.target_pin, ctx.file.layout, ctx.file._lock] +
            ctx.files.series_data + pin_inputs,
            transitive = [tool_inputs(ctx)],
        ),
        outputs = [tree, remapped, manifest, table],
        mnemonic = "PatchGate",
        progress_message = "Patch gate: %s onto %s" % (ctx.file.series.short_path, target.basename),
        use_default_shell_env = False,
        execution_requirements = {"no-sandbox": "1"} if ctx.attr.no_sandbox else {},
    )
    return [
        DefaultInfo(files = depset([tree, manifest, table])),
        OutputGroupInfo(remapped = depset([remapped]), manifest = depset([manifest]), table = depset([table]), tree = depset([tree]), upstream = depset([target])),
    ]

patched_tree = rule(
    implementation = _patched_tree_impl,
    attrs = {
        "target": attr.label(allow_single_file = True, mandatory = True, doc = "the pinned wheel"),
        "target_pin": attr.label(allow_single_file = True, mandatory = True, doc = "text file holding the target's pin name"),
        "series": attr.label(allow_single_file = True, mandatory = True),
        "series_data": attr.label_list(allow_files = True, doc = "patch files the series names"),
        "layout": attr.label(allow_single_file = True, mandatory = True),
        "pin_files": attr.label_keyed_string_dict(allow_files = True, doc = "fetched patch pins -> their pin names"),
        "no_sandbox": attr.bool(default = False),
        "_lock": attr.label(default = "//third_party:pins.lock.json", allow_single_file = True),
        "_tool": attr.label(default = TOOL),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
