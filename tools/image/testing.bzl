"""Rules the image's tests use (not part of building an image; internals in private/).

    image_config_files   the files of targets built in the configuration of a stack's image (the
                         launch-profile check's inputs, tests/cpu/image:profiles_check_*)
"""

load("//tools/image/private:image_config_files.bzl", _image_config_files = "image_config_files")

image_config_files = _image_config_files
