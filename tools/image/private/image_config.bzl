"""The configuration of a stack's image: the stack (`stack`, or the one selected on the command
line when empty) and always the image's kernel-cache arch, which the image fixes
(//image:layer_kernel_cache takes :sm120_cache), so //kernel_cache:selected_plan is the image's
plan whatever --//kernel_cache:arch says.

One transition for the checks of an image (image_config_files) and for pushing it
(image_config_binary): from the same command-line configuration they give the same output
directory, so the same actions have the same cache keys and one disk cache serves the test command
and the main job.
"""

_STACK = str(Label("//third_party:stack"))
_ARCH = str(Label("//kernel_cache:arch"))

def _image_config_impl(settings, attr):
    return {
        _STACK: attr.stack or settings[_STACK],
        _ARCH: attr.kernel_cache_arch,
    }

image_config = transition(
    implementation = _image_config_impl,
    inputs = [_STACK],
    outputs = [_STACK, _ARCH],
)
