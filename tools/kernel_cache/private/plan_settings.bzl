"""The config settings that pick a checked-in kernel-cache plan (see //kernel_cache:BUILD.bazel).

A plan is picked by (arch, plan) (PLAN_FILES): plan is a variant of the `full` selection (full,
lean) or a kernel selection's name, with ".pypi" for the pypi stack's FlashInfer.
tools/kernel_cache/private/kernel_cache.bzl selects on variant_is_<plan> (arch fixed by the
target) and is_<arch slug>_<plan>. Each matches its stack and the selection named, or
"default" where that is the arch's default selection (for the variants: the selection `full`;
lean also under "default", as it exists only for `full`).
"""

load("@bazel_skylib//lib:selects.bzl", "selects")
load(":constants.bzl", "ARCHS", "DEFAULT_SELECTION", "PLAN_FILES", "VARIANTS")

def _stack(plan):
    return "pypi" if plan.endswith(".pypi") else "default"

def _base(plan):
    return plan[:-len(".pypi")] if plan.endswith(".pypi") else plan

def _selections(arch, plan):
    base = _base(plan)
    if base in VARIANTS:
        return ["full"] + (["default"] if base == "lean" else [])
    return [base] + (["default"] if DEFAULT_SELECTION[arch] == base else [])

def kernel_cache_plan_settings(selection, variant, stack):
    """Declares the settings in the calling package.

    Args:
      selection: the selection string_flag's label.
      variant: the variant string_flag's label.
      stack: the stack string_flag's label (//third_party:stack).
    """
    plans = {}
    for arch, plan in PLAN_FILES.keys():
        plans.setdefault(plan, _selections(arch, plan))
    for plan, sels in plans.items():
        for sel in sels:
            native.config_setting(
                name = "_plan_%s_as_%s" % (plan, sel),
                flag_values = {
                    selection: sel,
                    variant: _base(plan) if _base(plan) in VARIANTS else "full",
                    stack: _stack(plan),
                },
            )
        selects.config_setting_group(
            name = "variant_is_" + plan,
            match_any = [":_plan_%s_as_%s" % (plan, sel) for sel in sels],
        )
    for arch, plan in PLAN_FILES.keys():
        selects.config_setting_group(
            name = "is_%s_%s" % (ARCHS[arch], plan),
            match_all = [
                ":arch_is_" + ARCHS[arch],
                ":variant_is_" + plan,
            ],
        )
