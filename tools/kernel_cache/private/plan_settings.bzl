"""The config settings that pick a checked-in kernel-cache plan (see //kernel_cache:BUILD.bazel).

A plan is picked by (arch, plan) (private/plans.bzl PLANS): plan is a variant of the `full`
selection (full, lean) or a kernel selection's name, with ".<stack>" for a stack other than the
default. tools/kernel_cache/private/kernel_cache.bzl selects on variant_is_<plan> (arch fixed by
the target) and is_<arch slug>_<plan>. Each matches its stack and the selection named, or
"default" where that is the arch's default selection (for the variants: the selection `full`;
lean also under "default", as it exists only for `full`).
"""

load("@bazel_skylib//lib:selects.bzl", "selects")
load(":constants.bzl", "ARCHS", "DEFAULT_SELECTION", "VARIANTS")

def _selections(arch, base):
    if base in VARIANTS:
        return ["full"] + (["default"] if base == "lean" else [])
    return [base] + (["default"] if DEFAULT_SELECTION[arch] == base else [])

def kernel_cache_plan_settings(selection, variant, stack, plans):
    """Declares the settings in the calling package.

    Args:
      selection: the selection string_flag's label.
      variant: the variant string_flag's label.
      stack: the stack string_flag's label (//third_party:stack).
      plans: {(arch, plan): struct(stack, base, ...)}, private/plans.bzl PLANS.
    """
    sels_of = {}
    for (arch, plan), entry in plans.items():
        sels_of.setdefault(plan, (entry, _selections(arch, entry.base)))
    for plan, (entry, sels) in sels_of.items():
        for sel in sels:
            native.config_setting(
                name = "_plan_%s_as_%s" % (plan, sel),
                flag_values = {
                    selection: sel,
                    variant: entry.base if entry.base in VARIANTS else "full",
                    stack: entry.stack,
                },
            )
        selects.config_setting_group(
            name = "variant_is_" + plan,
            match_any = [":_plan_%s_as_%s" % (plan, sel) for sel in sels],
        )
    for arch, plan in plans.keys():
        selects.config_setting_group(
            name = "is_%s_%s" % (ARCHS[arch], plan),
            match_all = [
                ":arch_is_" + ARCHS[arch],
                ":variant_is_" + plan,
            ],
        )
