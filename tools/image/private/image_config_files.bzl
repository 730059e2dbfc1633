"""image_config_files: targets built in the configuration of an image of a given stack.

The launch-profile check takes parts of the image (layers, the kernel-cache plan, the stack's
SGLang wheel) as test data. This rule builds them for a stack (`stack`, or the one selected on
the command line when empty) and always for the image's kernel-cache arch, which the image
fixes (//image:layer_kernel_cache takes :sm120_cache), so //kernel_cache:selected_plan is the
image's plan whatever --//kernel_cache:arch says. The CPU suite uses it to check the pypi stack's
image from a default-stack run.
"""

_STACK = str(Label("//third_party:stack"))
_ARCH = str(Label("//kernel_cache:arch"))

def _image_config_impl(settings, attr):
    return {
        _STACK: attr.stack or settings[_STACK],
        _ARCH: attr.kernel_cache_arch,
    }

_image_config = transition(
    implementation = _image_config_impl,
    inputs = [_STACK],
    outputs = [_STACK, _ARCH],
)

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
        "srcs": attr.label_list(cfg = _image_config, allow_files = True),
        "stack": attr.string(doc = "a stack of third_party/pins.lock.json; empty: --//third_party:stack"),
        "kernel_cache_arch": attr.string(mandatory = True, doc = "the image's IMAGE_CUDA_ARCH"),
    },
)
