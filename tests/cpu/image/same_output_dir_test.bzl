"""same_output_dir_test: a `bazel run` target and a check's inputs are built in one output
directory (nothing is built: the paths are known at analysis).

Bazel's cache key of an action holds its output paths, so the same action in two output
directories runs twice even with one disk cache. The main job and the pypi image checks are meant
to share their actions; this fails, naming both directories, when a setting sets them apart.
"""

def _bin_roots(files, owner):
    return sorted({f.root.path: None for f in files.to_list() if not f.is_source and f.owner == owner}.keys())

def _same_output_dir_test_impl(ctx):
    main_owner, checks_owner = Label(ctx.attr.main_owner), Label(ctx.attr.checks_owner)
    main = _bin_roots(ctx.attr.main[DefaultInfo].default_runfiles.files, main_owner)
    checks = _bin_roots(ctx.attr.checks[DefaultInfo].files, checks_owner)
    if not main or not checks:
        fail("same_output_dir_test: no output of %s in %s's runfiles or of %s in %s; fix main_owner/checks_owner" % (
            main_owner,
            ctx.attr.main.label,
            checks_owner,
            ctx.attr.checks.label,
        ))
    if main == checks:
        body = "echo 'one output directory: %s'\n" % main[0]
    else:
        body = "echo '%s builds %s in %s, %s builds %s in %s: their shared actions run twice; give both the same configuration'\nexit 1\n" % (
            ctx.attr.main.label,
            main_owner,
            " ".join(main),
            ctx.attr.checks.label,
            checks_owner,
            " ".join(checks),
        )
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(script, "#!/bin/sh\n" + body, is_executable = True)
    return [DefaultInfo(executable = script)]

same_output_dir_test = rule(
    implementation = _same_output_dir_test_impl,
    test = True,
    doc = "Passes when main_owner's outputs in main's runfiles and checks_owner's in checks lie in one output directory.",
    attrs = {
        "main": attr.label(mandatory = True, doc = "a `bazel run` target"),
        # Labels as strings: as label attributes they would be analysed in the test's own
        # configuration (the default stack), which main and checks leave.
        "main_owner": attr.string(mandatory = True, doc = "the label of a target whose output is in main's runfiles"),
        "checks": attr.label(mandatory = True, doc = "a check's inputs (image_config_files)"),
        "checks_owner": attr.string(mandatory = True, doc = "the label of a target whose output is in checks"),
    },
)
