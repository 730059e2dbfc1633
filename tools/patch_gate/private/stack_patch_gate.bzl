"""stack_patch_gate: the patch gate targets of one folder (flashinfer_patches/, sglang_patches/)
for the stack selected by --//third_party:stack."""

load("//tools/pins:defs.bzl", "PATCH_PINS", "STACKS", "stack_select")
load(":checked_tree.bzl", "checked_tree")
load(":patched_tree.bzl", "patched_tree")
load(":tool.bzl", "TOOL")

def _by_stack(pattern):
    """`pattern % <stack>` for the selected stack."""
    return stack_select({s: pattern % s for s in STACKS})

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
        pin_files = stack_select({
            s: {"@pins//:" + p: p for p in (PATCH_PINS[s] if uses_patch_pins else [])}
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
        srcs = ["//tools/patch_gate:__main__.py"],
        main = "//tools/patch_gate:__main__.py",
        args = [
            "install-manifest",
            "--built=$(rootpath :%s_gate_manifest)" % name,
            # A source file's rootpath is its workspace path, which install-manifest resolves
            # against BUILD_WORKSPACE_DIRECTORY.
            "--expected-manifest=$(rootpath :%s_expected_manifest)" % name,
        ],
        data = [":%s_gate_manifest" % name, ":%s_expected_manifest" % name],
        deps = [TOOL],
    )
    native.filegroup(name = name + "_tree_dir", srcs = [":%s_tree" % name], output_group = "tree")
    native.py_test(
        name = "check",
        srcs = ["//tests/cpu/patch_gate:check_tree.py"],
        main = "//tests/cpu/patch_gate:check_tree.py",
        data = [":%s_manifest" % name, ":%s_table" % name, ":%s_tree_dir" % name],
        deps = ["//tests/cpu:conftest", "//tools/common"],
        env = {
            "KIMI_BUILT_MANIFEST": "$(rootpath :%s_manifest)" % name,
            "KIMI_GATE_TABLE": "$(rootpath :%s_table)" % name,
            "KIMI_GATE_TREE": "$(rootpath :%s_tree_dir)" % name,
        },
        tags = ["cpu"],
    )
