"""A third stack is data: the per-stack facts (tools/pins/private/stack_facts.bzl) and the plan
index (tools/kernel_cache/private/plans.bzl), run on a copy of the lock's stacks with a stack
`third` added (pypi's pins, an unpatched FlashInfer series, patched SGLang) and its plan file,
give that stack everything the BUILD files iterate over, with no Starlark edit. The whole
workspace analysed with such a lock: //tests/cpu/pins:third_stack_analysis."""

load("@bazel_skylib//lib:unittest.bzl", "asserts", "unittest")
load("@kernel_cache_plans//:plans.bzl", "PLAN_CONTENTS")
load("//tools/kernel_cache/private:plans.bzl", "index_plans", "plan_entry")
load("//tools/pins:defs.bzl", "DEFAULT_STACK", "PATCHED", "PATCH_PINS", "ROLE_PINS", "STACKS")
load("//tools/pins/private:stack_facts.bzl", "series_applies", "stack_facts")

def _lock_with_third_stack():
    """The lock's stacks as the generated facts know them (roles and patch pins), plus `third`."""
    stacks = {s: dict(ROLE_PINS[s], patch_pins = PATCH_PINS[s]) for s in STACKS}
    stacks["third"] = dict(ROLE_PINS["pypi"], patch_pins = [])
    pins = {p: {} for s in STACKS for p in ROLE_PINS[s].values() + PATCH_PINS[s]}
    return {"pins": pins, "stacks": stacks}

_THIRD_SERIES = {
    "flashinfer": "# nothing to apply: the pinned wheel carries it\n\n",
    "sglang": "# the project's patches\nfile:0001-a.patch  # why\n",
}

def _facts_test_impl(ctx):
    env = unittest.begin(ctx)
    patched = dict(PATCHED, third = [r for r, text in _THIRD_SERIES.items() if series_applies(text)])
    facts = stack_facts(_lock_with_third_stack(), patched)
    asserts.equals(env, sorted(STACKS + ["third"]), facts["STACKS"])
    asserts.equals(env, DEFAULT_STACK, facts["DEFAULT_STACK"])
    asserts.equals(env, ROLE_PINS["pypi"], facts["ROLE_PINS"]["third"])
    asserts.equals(env, [], facts["PATCH_PINS"]["third"])
    asserts.equals(env, ["sglang"], facts["PATCHED"]["third"])
    for s in STACKS:  # the existing stacks' facts are what the generated file says
        asserts.equals(env, ROLE_PINS[s], facts["ROLE_PINS"][s])
        asserts.equals(env, PATCHED[s], facts["PATCHED"][s])
    return unittest.end(env)

def _plans_test_impl(ctx):
    env = unittest.begin(ctx)
    stacks = STACKS + ["third"]
    contents = dict(PLAN_CONTENTS)
    contents["plan_120f_kimi-k3.third.bzl"] = PLAN_CONTENTS["plan_120f_kimi-k3.pypi.bzl"]
    plans = index_plans(contents, stacks, DEFAULT_STACK)
    third = plans[("12.0f", "kimi-k3.third")]
    asserts.equals(env, ("plan_120f_kimi-k3.third.bzl", "third", "kimi-k3"), (third.file, third.stack, third.base))
    asserts.equals(env, DEFAULT_STACK, plans[("12.0f", "kimi-k3")].stack)
    asserts.equals(env, "pypi", plans[("12.0f", "kimi-k3.pypi")].stack)
    asserts.equals(env, len(PLAN_CONTENTS) + 1, len(plans))

    # Names that do not fit are refused with the reason (index_plans fails naming the file).
    pypi = PLAN_CONTENTS["plan_120f_kimi-k3.pypi.bzl"]
    for name, plan, why in [
        ("plan_120f_kimi-k3.fourth.bzl", pypi, "'kimi-k3.fourth' is not a variant or selection"),
        ("plan_90a_kimi-k3.third.bzl", pypi, "its arch is 12.0f, its name says 9.0a"),
        ("plan_120f_full.third.bzl", pypi, "it holds selection kimi-k3 variant full, its name says full"),
        ("plan_kimi-k3.bzl", pypi, "no arch slug after plan_"),
    ]:
        key, reason = plan_entry(name, plan, stacks, DEFAULT_STACK)
        asserts.equals(env, None, key, name)
        asserts.true(env, reason.startswith(why), "%s: %s" % (name, reason))
    return unittest.end(env)

def _series_test_impl(ctx):
    env = unittest.begin(ctx)
    asserts.false(env, series_applies(""))
    asserts.false(env, series_applies("# only comments\n   # and blanks\n\n"))
    asserts.true(env, series_applies("pin:flashinfer-pr4460"))
    asserts.true(env, series_applies("  file:x.patch # a comment after the entry\n"))
    return unittest.end(env)

facts_test = unittest.make(_facts_test_impl)
plans_test = unittest.make(_plans_test_impl)
series_test = unittest.make(_series_test_impl)

def stack_facts_test_suite(name):
    """:<name>_facts, :<name>_plans, :<name>_series (tag cpu) and the test_suite :<name>."""
    tests = {"facts": facts_test, "plans": plans_test, "series": series_test}
    for suffix, rule in tests.items():
        rule(name = "%s_%s" % (name, suffix), tags = ["cpu"])
    native.test_suite(name = name, tests = [":%s_%s" % (name, s) for s in tests], tags = ["cpu"])
