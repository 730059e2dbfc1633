"""The kernel-cache toolchain build settings as Make variables (see //tools/kernel_cache:defs.bzl)."""

load("@bazel_skylib//rules:common_settings.bzl", "BuildSettingInfo")

def _setting(target):
    return target[BuildSettingInfo].value

def _settings_vars_impl(ctx):
    # Make variables for test env: $(KIMI_CUDA_HOME), $(KIMI_K3_HOST_ROOT).
    return [platform_common.TemplateVariableInfo({
        "KIMI_CUDA_HOME": _setting(ctx.attr._cuda_home),
        "KIMI_K3_HOST_ROOT": _setting(ctx.attr._host_root),
    })]

kernel_cache_settings_vars = rule(
    implementation = _settings_vars_impl,
    attrs = {
        "_cuda_home": attr.label(default = "//kernel_cache:cuda_home"),
        "_host_root": attr.label(default = "//kernel_cache:host_root"),
    },
    doc = "The toolchain build settings as Make variables, for py_test env (toolchains = [...]).",
)
