"""jit_cache_inventories: one inventory action per stack of the lock (see //tools/jit_cache:defs.bzl)."""

load("//tools/kernel_cache:defs.bzl", "DEFAULT_SELECTION", "PLANS")
load("//tools/pins:defs.bzl", "STACKS")

_STACK = str(Label("//third_party:stack"))

# The image's kernel cache: its arch's default selection (the plan the image ships).
_IMAGE_ARCH = "12.0f"

# The tool's inputs besides the tree, by flag.
_INPUTS = {
    "--backend-needs": "//image:backend_needs.json",
    "--facts": "//jit_cache:checkpoint_facts.json",
    # The stacks --stack may name (the tool refuses another).
    "--lock": "//third_party:pins.lock.json",
    "--reach": "//jit_cache:reach.json",
    "--sglang-modules": "//jit_cache:sglang_modules.json",
    "--triton-calls": "//jit_cache:triton_calls.json",
}

def _stack_config_impl(_settings, attr):
    return {_STACK: attr.stack}

# The patch gate's tree of `stack`, whatever the command line's stack: every stack's inventory is
# built (and checked) in one command.
_stack_config = transition(
    implementation = _stack_config_impl,
    inputs = [],
    outputs = [_STACK],
)

def _inventory_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".json")
    trees = ctx.files.tree
    if len(trees) != 1:
        fail("tree: expected the patch gate's tree directory, got %d files" % len(trees))
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    args = [
        py.interpreter_path,
        "--stack=" + ctx.attr.stack,
        "--tree=" + trees[0].path,
        "--profiles=" + ctx.files.profiles[0].dirname,
        "--kernel-plan=" + ctx.file.kernel_plan.path,
        "--backend-needs=" + ctx.file.backend_needs.path,
        "--facts=" + ctx.file.facts.path,
        "--lock=" + ctx.file.lock.path,
        "--reach=" + ctx.file.reach.path,
        "--sglang-modules=" + ctx.file.sglang_modules.path,
        "--triton-calls=" + ctx.file.triton_calls.path,
        "--out=" + out.path,
    ]
    ctx.actions.run_shell(
        command = """set -e
export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 PATH=/usr/bin:/bin:/usr/local/bin
"$1" -m tools.jit_cache inventory "${@:2}"
""",
        arguments = args,
        inputs = depset(
            trees + ctx.files.profiles + [ctx.file.kernel_plan, ctx.file.backend_needs, ctx.file.facts, ctx.file.lock, ctx.file.reach, ctx.file.sglang_modules, ctx.file.triton_calls],
            transitive = [ctx.attr._tool[DefaultInfo].default_runfiles.files],
        ),
        outputs = [out],
        mnemonic = "JitCacheInventory",
        progress_message = "First-use compile inventory of stack %s" % ctx.attr.stack,
        use_default_shell_env = False,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

jit_cache_inventory = rule(
    implementation = _inventory_impl,
    doc = "One stack's inventory (`python3 -m tools.jit_cache inventory`) from the patch gate's SGLang tree of that stack.",
    attrs = {
        "stack": attr.string(mandatory = True, doc = "a stack of third_party/pins.lock.json"),
        "tree": attr.label(default = "//sglang_patches:sglang_tree_dir", cfg = _stack_config, allow_files = True),
        "profiles": attr.label(default = "//image:profiles", allow_files = [".json"]),
        "kernel_plan": attr.label(mandatory = True, allow_single_file = True),
        "backend_needs": attr.label(default = _INPUTS["--backend-needs"], allow_single_file = True),
        "facts": attr.label(default = _INPUTS["--facts"], allow_single_file = True),
        "lock": attr.label(default = _INPUTS["--lock"], allow_single_file = True),
        "reach": attr.label(default = _INPUTS["--reach"], allow_single_file = True),
        "sglang_modules": attr.label(default = _INPUTS["--sglang-modules"], allow_single_file = True),
        "triton_calls": attr.label(default = _INPUTS["--triton-calls"], allow_single_file = True),
        "_tool": attr.label(default = "//tools/jit_cache"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)

def _image_plan(stack):
    """The kernel-cache plan file the image of `stack` ships (its arch's default selection)."""
    for p in PLANS.values():
        if p.stack == stack and p.base == DEFAULT_SELECTION[_IMAGE_ARCH] and p.plan.get("arch") == _IMAGE_ARCH:
            return "//kernel_cache:" + p.file
    fail("stack %s: no checked-in kernel-cache plan of selection %s for %s (kernel_cache/plan_*.bzl); add it (docs/DESIGN.md 'Stacks are data' step 3)" % (stack, DEFAULT_SELECTION[_IMAGE_ARCH], _IMAGE_ARCH))

def jit_cache_inventories():
    """:built_<stack> per stack, :built, :update_inventory (see //tools/jit_cache:defs.bzl)."""
    for stack in STACKS:
        jit_cache_inventory(
            name = "built_" + stack,
            stack = stack,
            kernel_plan = _image_plan(stack),
        )
    native.filegroup(name = "built", srcs = [":built_" + s for s in STACKS])
    native.py_binary(
        name = "update_inventory",
        srcs = ["//tools/jit_cache:__main__.py"],
        main = "//tools/jit_cache:__main__.py",
        args = ["install", "--inventory-dir=" + native.package_name()] +
               ["--built=%s=$(rootpath :built_%s)" % (s, s) for s in STACKS],
        data = [":built_" + s for s in STACKS],
        deps = ["//tools/jit_cache"],
    )

# For //tests/cpu/jit_cache:inventory_current: every stack's recomputed inventory, and the
# checked-in ones (a stack without one is reported by the check, not by analysis).
CHECK_ARGS = ["--inventory-dir=jit_cache"] + ["--built=%s=$(rootpath //jit_cache:built_%s)" % (s, s) for s in STACKS]
CHECK_DATA = ["//jit_cache:built_" + s for s in STACKS] + ["//jit_cache:inventories"]
