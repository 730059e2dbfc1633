"""image_config_files: targets built in the configuration of an image of a given stack.

The launch-profile check takes parts of the image (layers, the kernel-cache plan, the stack's
SGLang wheel) as test data. This rule builds them in the image's configuration (image_config.bzl).
The CPU suite uses it to check the pypi stack's image from a default-stack run.
"""

load(":image_config.bzl", "image_config")

def _image_config_files_impl(ctx):
    files = depset(transitive = [src[DefaultInfo].files for src in ctx.attr.srcs])
    runfiles = ctx.runfiles(transitive_files = files).merge_all(
        [src[DefaultInfo].default_runfiles for src in ctx.attr.srcs],
    )
    return [DefaultInfo(files = files, runfiles = runfiles)]

image_config_files = rule(
    implementation = _image_config_files_impl,
    doc = "The files of srcs, built for stack `stack` (empty: the selected one) and kernel-cache arch `kernel_cache_arch`.",
    attrs = {
        "srcs": attr.label_list(cfg = image_config, allow_files = True),
        "stack": attr.string(doc = "a stack of third_party/pins.lock.json; empty: --//third_party:stack"),
        "kernel_cache_arch": attr.string(mandatory = True, doc = "the image's IMAGE_CUDA_ARCH"),
    },
)
