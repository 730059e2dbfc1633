"""image_config_binary: a `bazel run` target built in the configuration of a stack's image.

`tools/bazel run //image:push_pypi` pushes the pypi stack's image from the command line's own
configuration, through the transition the CPU suite's image checks use (image_config.bzl). The
layers, the SGLang JIT build and the patch gates then have the output paths, so the cache keys,
that the test command gives them, and whichever of the two commands runs second takes them from
the disk cache. (`--config=pypi` selects the stack on the command line instead: another output
directory, the same bytes, nothing shared.)
"""

load(":image_config.bzl", "image_config")

def _image_config_binary_impl(ctx):
    src = ctx.attr.binary[0] if type(ctx.attr.binary) == "list" else ctx.attr.binary
    binary = src[DefaultInfo]
    # The binary's script resolves its inputs from the runfiles tree `bazel run` starts it in, not
    # from its own path, so a link to it under this target's name runs it unchanged.
    link = ctx.actions.declare_file(ctx.label.name)
    ctx.actions.symlink(output = link, target_file = binary.files_to_run.executable, is_executable = True)
    return [DefaultInfo(executable = link, runfiles = binary.default_runfiles)]

image_config_binary = rule(
    implementation = _image_config_binary_impl,
    executable = True,
    doc = "`bazel run` target: `binary`, built for stack `stack` and kernel-cache arch `kernel_cache_arch`.",
    attrs = {
        "binary": attr.label(mandatory = True, executable = True, cfg = image_config, doc = "a `bazel run` target (oci_push)"),
        "stack": attr.string(mandatory = True, doc = "a stack of third_party/pins.lock.json"),
        "kernel_cache_arch": attr.string(mandatory = True, doc = "the image's IMAGE_CUDA_ARCH"),
    },
)
