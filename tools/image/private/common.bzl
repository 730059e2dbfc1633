"""What every image rule shares: the Python toolchain, the tool-as-label attribute, one way to run
a tool module as an action."""

# Every image action runs unsandboxed: the tools read input trees with lstat (symlinks are kept
# as symlinks in a layer, see tools/image/layer_contents.py), so a sandbox's symlink forest would leak
# into the layer; and the inputs are GBs of wheels, which a sandbox only slows down. no-remote:
# GB-sized blobs that a remote cache would only shuttle back and forth.
LOCAL = {"no-sandbox": "1", "no-remote": "1"}

PY_TOOLCHAIN = ["@bazel_tools//tools/python:toolchain_type"]

def tool_attr(label):
    """The `_tool` attribute: a py_library of //tools/image whose transitive sources (and only
    those) are the action's tool inputs."""
    return {"_tool": attr.label(default = label, providers = [PyInfo])}

def tool_files(ctx):
    return ctx.attr._tool[DefaultInfo].default_runfiles.files

def python(ctx):
    """(interpreter path, its files) of the registered Python toolchain (the hashed venv)."""
    runtime = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    if runtime.interpreter != None:
        return runtime.interpreter.path, depset([runtime.interpreter], transitive = [runtime.files])
    return runtime.interpreter_path, runtime.files or depset()

def run_tool(ctx, module, args, inputs, outputs, mnemonic, progress, requirements = LOCAL):
    """Run `python -m tools.<module> ARGS` with the toolchain's interpreter."""
    interpreter, interpreter_files = python(ctx)
    ctx.actions.run_shell(
        # PATH: the system tools the stages call (mmdebstrap, chroot helpers); nothing from
        # the user's environment reaches the action.
        command = 'export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin; ' +
                  'py="$1"; shift; exec "$py" -m tools.%s "$@"' % module,
        arguments = [interpreter, args],
        inputs = depset(inputs, transitive = [tool_files(ctx), interpreter_files]),
        outputs = outputs,
        mnemonic = mnemonic,
        progress_message = progress,
        use_default_shell_env = False,
        execution_requirements = requirements,
    )
