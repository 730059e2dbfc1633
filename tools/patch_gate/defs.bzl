"""Thin Bazel rules over tools/patch_gate (all logic is in the Python tool).

patched_tree: the gate's `apply` as one action: every patch of the series is checked (applies /
    already upstream / excluded / conflicts) before any is applied; outputs the patched tree, the
    manifest of changed files, the table and the wheel-layout patches for review. It fails on a
    conflict or bad input, not on drift: `update_manifest` needs its manifest when it drifted.
checked_tree: the same outputs, plus the drift check (built manifest == the committed one) as a
    validation action (`_validation` output group). Everything that consumes a patched tree (the
    image layers, the kernel cache, the patched wheel) depends on this target, so drift fails
    every such build, reported by that one action, naming the file and the fix command.
patched_wheel: the patched tree repacked as a wheel whose version carries a local suffix
    (`+kimik3.<digest>`), so nobody mistakes it for the official one.
"""

load("@pins//:stacks.bzl", "PATCH_PINS", "STACKS")

def _tool_inputs(ctx):
    return ctx.attr._tool[DefaultInfo].default_runfiles.files

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
            transitive = [_tool_inputs(ctx)],
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
        "_tool": attr.label(default = "//tools"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)

_GROUPS = ["tree", "manifest", "table", "remapped", "upstream"]

def _checked_tree_impl(ctx):
    groups = ctx.attr.gate[OutputGroupInfo]
    built = groups.manifest.to_list()[0]
    stamp = ctx.actions.declare_file(ctx.label.name + ".no_drift")
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run_shell(
        command = 'set -e; export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1; "$1" -m tools.patch_gate check-manifest --built "$2" --expected-manifest "$3" --stamp "$4"',
        arguments = [py.interpreter_path, built.path, ctx.file.expected_manifest.path, stamp.path],
        inputs = depset([built, ctx.file.expected_manifest], transitive = [_tool_inputs(ctx)]),
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
        "_tool": attr.label(default = "//tools"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)

def _patched_wheel_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    tree = ctx.attr.tree[OutputGroupInfo].tree.to_list()[0]
    upstream = ctx.attr.tree[OutputGroupInfo].upstream.to_list()[0]
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    ctx.actions.run_shell(
        command = 'set -e; export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH="$4"; "$1" -m tools.patch_gate repack-wheel --tree "$2" --out-dir "$3" --local-label kimik3 --modes-from "$5"',
        arguments = [py.interpreter_path, tree.path, out.path, str(ctx.attr.source_date_epoch), upstream.path],
        inputs = depset([tree, upstream], transitive = [_tool_inputs(ctx)]),
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
        "_tool": attr.label(default = "//tools"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)

def _by_stack(pattern):
    """`pattern % <stack>` for the selected stack."""
    return select({"//third_party:stack_is_%s" % s: pattern % s for s in STACKS})

def stack_patch_gate(name, target_role, series_data = [], uses_patch_pins = False):
    """The patch gate targets of one folder (flashinfer_patches/, sglang_patches/):

    :<name>_gate             the stack's series (<stack>.series) applied to the stack's <target_role>
                             pin, unchecked against the committed manifest (for :update_manifest)
    :<name>_tree             the same, drift-checked against <stack>.manifest.json (what consumers use)
    :<name>_manifest, :<name>_table   its manifest and table
    :update_manifest         `bazel run`: write the gate's built manifest over <stack>.manifest.json
    :check                   test (tag cpu): the checked tree is the one its manifest describes
    """
    stacks = STACKS
    patched_tree(
        name = name + "_gate",
        layout = "wheel_layout.json",
        # The lock's patch_pins of the selected stack: a GitHub-only pin (#4460) is fetched only
        # for a stack whose series needs it.
        pin_files = select({
            "//third_party:stack_is_%s" % s: {"@pins//:" + p: p for p in (PATCH_PINS[s] if uses_patch_pins else [])}
            for s in stacks
        }),
        series = _by_stack("%s.series"),
        series_data = series_data,
        target = "@pins//stack:" + target_role,
        target_pin = "@pins//stack:%s_pin" % target_role,
    )
    native.alias(name = name + "_expected_manifest", actual = _by_stack("%s.manifest.json"))
    checked_tree(
        name = name + "_tree",
        gate = ":%s_gate" % name,
        expected_manifest = ":%s_expected_manifest" % name,
    )
    for group in ["manifest", "table"]:
        native.filegroup(name = "%s_%s" % (name, group), srcs = [":%s_tree" % name], output_group = group)
    native.filegroup(name = name + "_gate_manifest", srcs = [":%s_gate" % name], output_group = "manifest")
    native.py_binary(
        name = "update_manifest",
        srcs = ["//tools/patch_gate:__init__.py"],
        main = "//tools/patch_gate:__init__.py",
        args = [
            "install-manifest",
            "--built=$(rootpath :%s_gate_manifest)" % name,
            # A source file's rootpath is its workspace path, which install-manifest resolves
            # against BUILD_WORKSPACE_DIRECTORY.
            "--expected-manifest=$(rootpath :%s_expected_manifest)" % name,
        ],
        data = [":%s_gate_manifest" % name, ":%s_expected_manifest" % name],
        deps = ["//tools"],
    )
    native.filegroup(name = name + "_tree_dir", srcs = [":%s_tree" % name], output_group = "tree")
    native.py_test(
        name = "check",
        srcs = ["//tests/cpu/patch_gate:check_tree.py"],
        main = "//tests/cpu/patch_gate:check_tree.py",
        data = [":%s_manifest" % name, ":%s_table" % name, ":%s_tree_dir" % name],
        env = {
            "KIMI_BUILT_MANIFEST": "$(rootpath :%s_manifest)" % name,
            "KIMI_GATE_TABLE": "$(rootpath :%s_table)" % name,
            "KIMI_GATE_TREE": "$(rootpath :%s_tree_dir)" % name,
        },
        tags = ["cpu"],
    )
