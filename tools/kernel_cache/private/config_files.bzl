"""kernel_cache_config_files: files of a target built for a stack, a kernel selection and a module
subset (see //tools/kernel_cache:testing.bzl)."""

load("//tools/pins:defs.bzl", "PATCH_PINS")
load(":plans.bzl", "PLANS")

_STACK = str(Label("//third_party:stack"))
_SELECTION = str(Label("//kernel_cache:selection"))
_VARIANT = str(Label("//kernel_cache:variant"))
_ONLY = str(Label("//kernel_cache:only"))
_CUDA_HOME = str(Label("//kernel_cache:cuda_home"))

def _cache_config_impl(_settings, attr):
    # Every setting that picks a plan or the toolchain is fixed, so the files do not follow the
    # command line (the tests compare them with the pinned toolchain), and targets that read only
    # the stack (the patch gate's tree) get one configuration whatever the selection.
    return {
        _STACK: attr.stack,
        _SELECTION: attr.selection,
        _VARIANT: "full",
        _ONLY: attr.only,
        _CUDA_HOME: "",
    }

_cache_config = transition(
    implementation = _cache_config_impl,
    inputs = [],
    outputs = [_STACK, _SELECTION, _VARIANT, _ONLY, _CUDA_HOME],
)

def _config_files_impl(ctx):
    src = ctx.attr.src[0] if type(ctx.attr.src) == "list" else ctx.attr.src
    groups = src[OutputGroupInfo]
    picked = {}
    for group in ctx.attr.output_groups:
        if not hasattr(groups, group):
            fail("output_groups: %s has no output group %s" % (src.label, group))
        files = getattr(groups, group).to_list()
        if group == "objects" and ctx.attr.objects:
            by_name = {f.basename: f for f in files}
            missing = [o for o in ctx.attr.objects if o not in by_name]
            if missing:
                fail("objects %s: not objects of modules %s in the %s plan of stack %s; fix the names" % (
                    ", ".join(missing),
                    ",".join(ctx.attr.only),
                    ctx.attr.selection,
                    ctx.attr.stack,
                ))
            files = [by_name[o] for o in ctx.attr.objects]
        picked[group] = depset(files)
    files = depset(transitive = picked.values())
    return [
        DefaultInfo(files = files, runfiles = ctx.runfiles(transitive_files = files)),
        OutputGroupInfo(**picked),
    ]

kernel_cache_config_files = rule(
    implementation = _config_files_impl,
    doc = "The files of `src`'s output groups, built for stack `stack`, kernel selection `selection` and modules `only`.",
    attrs = {
        "src": attr.label(mandatory = True, cfg = _cache_config, providers = [OutputGroupInfo], doc = "a flashinfer_kernel_cache target, or the patch gate's tree"),
        "stack": attr.string(mandatory = True, doc = "a stack of third_party/pins.lock.json"),
        "selection": attr.string(default = "default", doc = "a kernel selection with a checked-in plan for the stack"),
        "only": attr.string_list(doc = "the modules to wire (--//kernel_cache:only; empty: all)"),
        "output_groups": attr.string_list(mandatory = True, doc = "of a cache: aot, modules, objects, gen, tvm_ffi, plan (private/kernel_cache.bzl); of a tree: tree"),
        "objects": attr.string_list(doc = "keep only these objects of the `objects` group (Bazel then compiles only them)"),
    },
)

def offline_plan_stack(selections):
    """A stack with a checked-in plan of every kernel selection in `selections` whose patch series
    needs no GitHub-only pin (the CPU suite never needs GitHub); fails naming the selections when
    there is none."""
    stacks = sorted({p.stack: None for p in PLANS.values() if not PATCH_PINS[p.stack]}.keys())
    for selection in selections:
        stacks = [s for s in stacks if [p for p in PLANS.values() if p.stack == s and p.base == selection]]
    if not stacks:
        fail("kernel selections %s: no stack without GitHub-only patch pins has a checked-in plan of each; add kernel_cache/plan_<arch slug>_<selection>.<stack>.bzl for one and run `tools/bazel run //kernel_cache:update_plans`" % ", ".join(selections))
    return stacks[0]
