"""empty_directory: a directory output with nothing in it (the stand-in kernel cache)."""

def _empty_directory_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run_shell(command = 'mkdir -p "$1/$2"', arguments = [out.path, ctx.attr.subdir], outputs = [out], mnemonic = "EmptyDir")
    return [DefaultInfo(files = depset([out]))]

empty_directory = rule(
    implementation = _empty_directory_impl,
    doc = "A directory output holding only `subdir` (e.g. a kernel cache with no module).",
    attrs = {"subdir": attr.string(default = "")},
)
