"""The checked-in plans by (arch, plan), from their file names (kernel_cache/README.md "Files"):

    plan_<arch slug>_<base>.bzl           the default stack's plan (DEFAULT_STACK of the lock)
    plan_<arch slug>_<base>.<stack>.bzl   another stack's (its own FlashInfer tree)

base is a variant of the `full` selection (full, lean) or a kernel selection's name; plan is
<base>, or <base>.<stack> for a stack other than the default. Each file's content must say the
same (arch, selection, variant): a renamed or mislabelled plan fails loading, naming the file.
"""

load("@kernel_cache_plans//:plans.bzl", "PLAN_CONTENTS")
load("//tools/pins:defs.bzl", "DEFAULT_STACK", "ROLE_PINS", "STACKS")
load(":constants.bzl", "ARCHS", "VARIANTS")

_ARCH_BY_SLUG = {slug: arch for arch, slug in ARCHS.items()}

def plan_entry(name, plan, stacks, default_stack):
    """(arch, plan key) and struct(file, plan, stack, base) of plan file `name` holding `plan`, or
    (None, why) for a name or content that does not fit the scheme above."""
    slug, sep, key = name[len("plan_"):-len(".bzl")].partition("_")
    if not sep or slug not in _ARCH_BY_SLUG:
        return None, "no arch slug after plan_"
    arch = _ARCH_BY_SLUG[slug]
    stack, base = default_stack, key
    for s in stacks:
        if s != default_stack and key.endswith("." + s):
            stack, base = s, key[:-len(s) - 1]
    if "." in base or not base:
        return None, "'%s' is not a variant or selection (with a stack of the lock after the dot)" % key
    if plan.get("arch") != arch:
        return None, "its arch is %s, its name says %s" % (plan.get("arch"), arch)
    said = (plan.get("selection", "full"), plan.get("variant"))
    want = ("full", base) if base in VARIANTS else (base, "full")
    if said != want:
        return None, "it holds selection %s variant %s, its name says %s" % (said[0], said[1], base)
    return (arch, key), struct(file = name, plan = plan, stack = stack, base = base)

def index_plans(contents, stacks, default_stack):
    """{(arch, plan): struct} of `contents` (file name -> plan); a file that does not fit fails."""
    plans = {}
    for name, plan in contents.items():
        key, entry = plan_entry(name, plan, stacks, default_stack)
        if key == None:
            fail("kernel_cache/%s: %s; name a plan plan_<arch slug>_<variant or selection>[.<stack>].bzl (arch slugs: %s; stacks: %s) and regenerate it with `tools/bazel run //kernel_cache:update_plans`" % (
                name,
                entry,
                ", ".join(sorted(_ARCH_BY_SLUG.keys())),
                ", ".join(stacks),
            ))
        plans[key] = entry
    return plans

# (arch, plan) -> struct(file, plan, stack, base) for every checked-in plan.
PLANS = index_plans(PLAN_CONTENTS, STACKS, DEFAULT_STACK)

# Kernel selections (kernel_cache/selections.json) with a checked-in plan: name -> arch. The
# selection `full` (everything FlashInfer compiles) is planned per variant instead.
SELECTIONS = {p.base: a for (a, _), p in PLANS.items() if p.base not in VARIANTS}

def _plans_tool():
    """The arguments and data of `python3 -m tools.kernel_cache.plans check|update` for every
    checked-in plan: --plan FILE=STACK, each such stack's pinned flashinfer-python wheel, the lock,
    modules.json, selections.json and the FlashInfer patch folder."""
    stacks = sorted({p.stack: None for p in PLANS.values()}.keys())
    wheels = {s: "@pins//:" + ROLE_PINS[s]["flashinfer"] for s in stacks}
    inputs = {
        "--lock": "//third_party:pins.lock.json",
        "--modules": "//kernel_cache:modules.json",
        "--selections": "//kernel_cache:selections.json",
    }
    args = ["--plan=$(rootpath //kernel_cache:%s)=%s" % (p.file, p.stack) for p in PLANS.values()]
    args += ["--wheel=%s=$(rootpath %s)" % (s, w) for s, w in wheels.items()]
    args += ["%s=$(rootpath %s)" % (flag, label) for flag, label in inputs.items()]
    args.append("--patch-dir=flashinfer_patches")
    data = ["//kernel_cache:" + p.file for p in PLANS.values()] + inputs.values() + ["//flashinfer_patches:series"]
    return args, data + {w: None for w in wheels.values()}.keys()  # stacks may share a wheel

# For //kernel_cache:update_plans and //tests/cpu/kernel_cache:plans_current.
PLANS_TOOL_ARGS, PLANS_TOOL_DATA = _plans_tool()
