"""What every patch gate rule shares: the tool and its inputs."""

# `python3 -m tools.patch_gate`; its runfiles are the action inputs, so an action reruns when (and
# only when) a module the CLI imports changes.
TOOL = "//tools/patch_gate:cli"

def tool_inputs(ctx):
    """The tool's sources: the runfiles of the :cli py_library (its transitive srcs)."""
    return ctx.attr._tool[DefaultInfo].default_runfiles.files
