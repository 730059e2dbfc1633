"""The flashinfer_kernel_cache rule and macro (see //tools/kernel_cache:defs.bzl)."""

load("@bazel_skylib//rules:common_settings.bzl", "BuildSettingInfo")
load(":constants.bzl", "ARCHS", "SPEC_SCHEMA")

def _res_9g(_os, _inputs):
    return {"cpu": 1, "memory": 9000}

def _res_7500m(_os, _inputs):
    return {"cpu": 1, "memory": 7500}

def _res_4g(_os, _inputs):
    return {"cpu": 1, "memory": 4000}

def _res_3g(_os, _inputs):
    return {"cpu": 1, "memory": 3000}

def _res_1500m(_os, _inputs):
    return {"cpu": 1, "memory": 1500}

def _resources(mem_mb):
    # resource_set must name a top-level function of (os, inputs_size): one per memory class of
    # tools/kernel_cache/plan.py _MEM_HINTS_MB (the next class up for anything in between).
    if mem_mb > 7500:
        return _res_9g
    if mem_mb > 4000:
        return _res_7500m
    if mem_mb > 3000:
        return _res_4g
    if mem_mb > 1500:
        return _res_3g
    return _res_1500m

def _setting(target):
    return target[BuildSettingInfo].value

def _kernel_cache_impl(ctx):
    plan = json.decode(ctx.attr.plan_json)
    tree = ctx.attr.flashinfer_tree[OutputGroupInfo].tree.to_list()[0]
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    # The sources of the tool's py_library (//tools/kernel_cache:actions and its deps), nothing
    # else: an edit elsewhere in tools/ (or to the non-Bazel build, verify) must not invalidate
    # hours of compiled objects (every action's key includes these inputs).
    tool_files = ctx.attr._tool[DefaultInfo].default_runfiles.files
    local_cuda = _setting(ctx.attr._cuda_home)
    only = sorted({n.strip(): None for v in _setting(ctx.attr._only) for n in v.split(",") if n.strip()}.keys())
    known = [m["name"] for m in plan["modules"]]
    unknown = [n for n in only if n not in known]
    if unknown:
        fail("--//kernel_cache:only=%s: not in the %s/%s plan (modules: %s); fix the name" % (
            ",".join(unknown),
            plan["arch"],
            plan["variant"],
            ",".join(known),
        ))
    modules = [m for m in plan["modules"] if not only or m["name"] in only]

    # The tool runs from the execroot as `python -m tools.kernel_cache`; it strips FLASHINFER_*
    # and compiler variables itself and puts the userland's compilers first on PATH.
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": ".",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    plan_file = ctx.file.plan_file

    # The compilers are declared inputs of every action: the pinned CUDA root and the compiler
    # userland (each file, so the keys change exactly when a pinned byte does), tvm-ffi's headers
    # from the stack's own wheel. Paths are exec-root relative, the same in every checkout.
    tvm_ffi = ctx.actions.declare_directory(ctx.label.name + "_tvm_ffi")
    ctx.actions.run(
        executable = py.interpreter_path,
        arguments = ["-m", "tools.kernel_cache", "unpack-tvm-ffi", "--wheel", ctx.file._tvm_ffi_wheel.path, "--out", tvm_ffi.path],
        inputs = depset([ctx.file._tvm_ffi_wheel], transitive = [tool_files]),
        outputs = [tvm_ffi],
        env = env,
        mnemonic = "KernelCacheTvmFfi",
        progress_message = "Unpacking tvm-ffi headers from %s" % ctx.file._tvm_ffi_wheel.basename,
    )
    userland = ctx.file._userland_identity.dirname
    toolchain_files = [ctx.attr._userland[DefaultInfo].files]
    if local_cuda:
        # The escape hatch: a local CUDA is not a declared input, so its actions stay off remote
        # caches and executors (their keys cannot tell two local CUDAs apart).
        cuda_home = local_cuda
        exec_reqs = {"no-remote": "1"}
    else:
        cuda_home = ctx.file._cuda_identity.dirname
        toolchain_files.append(ctx.attr._cuda[DefaultInfo].files)
        exec_reqs = {}
    common = ["--cuda-home", cuda_home, "--userland", userland, "--tvm-ffi", tvm_ffi.path]

    # The plan file is not an input of compile and link actions: they read their own entry (a
    # spec file written below, same fields as tools/kernel_cache/actions.py object_spec/
    # link_spec), so lean and full share identical objects and a regenerated plan recompiles
    # only the objects whose command changed.
    base_inputs = depset([tvm_ffi], transitive = [tool_files] + toolchain_files)

    def run(args, inputs, outputs, mnemonic, progress, **kwargs):
        ctx.actions.run(
            executable = py.interpreter_path,
            arguments = ["-m", "tools.kernel_cache"] + args,
            inputs = depset(inputs, transitive = [base_inputs]),
            outputs = outputs,
            env = env,
            mnemonic = mnemonic,
            progress_message = progress,
            execution_requirements = exec_reqs,
            **kwargs
        )
    total = 0
    for m in modules:
        total += len(m["objects"])
    index = 0
    module_sos = []
    specs = []
    all_objects = []
    gen_dirs = []
    assemble_args = ["assemble"] + common + ["--plan", plan_file.path]
    for module in modules:
        name = module["name"]
        gen_dir = None
        gen_inputs = []
        if module["gen_files"]:
            gen_dir = ctx.actions.declare_directory("%s/%s_gen" % (ctx.label.name, name))
            run(
                ["gen-sources"] + common + [
                    "--flashinfer-tree",
                    tree.path,
                    "--plan",
                    plan_file.path,
                    "--modules",
                    ctx.file.modules.path,
                    "--module",
                    name,
                    "--out",
                    gen_dir.path,
                ],
                [tree, ctx.file.modules, plan_file],
                [gen_dir],
                "KernelCacheGen",
                "Generating FlashInfer sources of %s (%d files)" % (name, len(module["gen_files"])),
            )
            gen_inputs = [gen_dir]
            gen_dirs.append(gen_dir)
        objects = []
        for obj in module["objects"]:
            index += 1
            out = ctx.actions.declare_file("%s/%s_objs/%s" % (ctx.label.name, name, obj["out"]))
            spec = ctx.actions.declare_file("%s/%s_specs/%s.json" % (ctx.label.name, name, obj["out"]))
            ctx.actions.write(spec, json.encode({
                "spec": "object",
                "schema_version": SPEC_SCHEMA,
                "module": name,
                "nvcc_release": plan["nvcc_release"],
                "object": {k: v for k, v in obj.items() if k != "mem_mb"},
            }))
            specs.append(spec)
            args = ["compile-object"] + common + [
                "--flashinfer-tree",
                tree.path,
                "--spec",
                spec.path,
                "--out",
                out.path,
            ]
            if gen_dir:
                args += ["--gen-dir", gen_dir.path]
            run(
                args,
                [tree, spec] + gen_inputs,
                [out],
                "KernelCacheCompile",
                # Bazel has no global counter; the object's index in the wired plan stands in.
                "FlashInfer object %d/%d: %s/%s (~%d MB)" % (index, total, name, obj["out"], obj["mem_mb"]),
                resource_set = _resources(obj["mem_mb"]),
            )
            objects.append(out)
        all_objects += objects
        so = ctx.actions.declare_file("%s/%s.so" % (ctx.label.name, name))
        link_spec = ctx.actions.declare_file("%s/%s_specs/link.json" % (ctx.label.name, name))
        ctx.actions.write(link_spec, json.encode({
            "spec": "link",
            "schema_version": SPEC_SCHEMA,
            "module": name,
            "nvcc_release": plan["nvcc_release"],
            "link": module["link"],
            "objects": [o["out"] for o in module["objects"]],
        }))
        specs.append(link_spec)
        run(
            ["link-module"] + common + [
                "--spec",
                link_spec.path,
                "--objects-dir",
                objects[0].dirname,
                "--out",
                so.path,
            ],
            objects + [link_spec],
            [so],
            "KernelCacheLink",
            "Linking FlashInfer module %s (%d objects)" % (name, len(objects)),
        )
        module_sos.append(so)
        assemble_args += ["--module-so", "%s=%s" % (name, so.path)]
    if only:
        assemble_args += ["--only", ",".join(only)]

    out_dir = ctx.actions.declare_directory(ctx.label.name + "_aot")
    run(
        assemble_args + ["--out", out_dir.path],
        module_sos + [plan_file],
        [out_dir],
        "KernelCacheAssemble",
        "Assembling FlashInfer AOT cache %s (%d modules, %d objects)" % (ctx.label.name, len(module_sos), total),
    )
    # The subset this cache holds, for the verify test (an empty file: the whole plan).
    subset = ctx.actions.declare_file(ctx.label.name + "_only.txt")
    ctx.actions.write(subset, ",".join(only) + "\n" if only else "")
    return [
        DefaultInfo(files = depset([out_dir])),
        OutputGroupInfo(
            aot = depset([out_dir]),
            only = depset([subset]),
            modules = depset(module_sos),
            # For spec_check, which compares them with tools/kernel_cache/actions.py object_spec/link_spec.
            specs = depset(specs),
            # For the CPU tests that take the stage's own products apart (tools/kernel_cache/
            # testing.bzl): Bazel runs only the actions of the files a test asks for.
            objects = depset(all_objects),
            gen = depset(gen_dirs),
            tvm_ffi = depset([tvm_ffi]),
            plan = depset([plan_file]),
        ),
    ]

_kernel_cache = rule(
    implementation = _kernel_cache_impl,
    attrs = {
        "plan_json": attr.string(mandatory = True, doc = "the selected plan, as JSON"),
        "plan_file": attr.label(allow_single_file = True, mandatory = True, doc = "the same plan's file (read by gen-sources and assemble; compile and link read spec files)"),
        "modules": attr.label(allow_single_file = True, default = "//kernel_cache:modules.json"),
        "flashinfer_tree": attr.label(mandatory = True, providers = [OutputGroupInfo], doc = "patched_tree target (output group tree)"),
        "_cuda_home": attr.label(default = "//kernel_cache:cuda_home"),
        "_only": attr.label(default = "//kernel_cache:only"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
        "_tvm_ffi_wheel": attr.label(allow_single_file = True, default = "@pins//stack:tvm_ffi"),
        "_tool": attr.label(default = "//tools/kernel_cache:actions", providers = [PyInfo]),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)

def _tree_stand_in_impl(ctx):
    tree = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run_shell(outputs = [tree], command = "mkdir -p " + tree.path, mnemonic = "TreeStandIn")
    return [OutputGroupInfo(tree = depset([tree]))]

flashinfer_tree_stand_in = rule(
    implementation = _tree_stand_in_impl,
    doc = """An empty directory in place of the patch gate's tree, for targets that are only analysed
(their spec files are analysis-time writes) and so must not need the tree's inputs: on the
default stack the tree needs FlashInfer #4460, a GitHub-only pin.""",
)

def _plan_select(plans, arch, what):
    """select() over the build settings giving plans[(arch, variant)] for each planned combo."""
    branches = {}
    for (a, v), value in plans.items():
        if arch != None and a != arch:
            continue
        setting = "//kernel_cache:is_%s_%s" % (ARCHS[a], v) if arch == None else "//kernel_cache:variant_is_%s" % v
        branches[setting] = value
    return select(branches, no_match_error = "no checked-in kernel cache plan for this --//kernel_cache:arch/variant (%s); planned: %s" % (
        what,
        ", ".join(["%s/%s" % k for k in plans.keys()]),
    ))

def flashinfer_kernel_cache(name, plans, arch = None, flashinfer_tree = "//flashinfer_patches:flashinfer_tree", **kwargs):
    """The kernel cache for the plan the build settings select.

    Args:
      name: target name; outputs <name>_aot/ (output groups aot, only, modules).
      plans: {(arch, variant): (plan dict loaded from the .bzl, plan file label)}.
      arch: fix the arch (e.g. "12.0f"); None follows --//kernel_cache:arch.
      flashinfer_tree: the patch gate's patched_tree target.
      **kwargs: common attributes (tags, visibility).
    """
    _kernel_cache(
        name = name,
        plan_json = _plan_select({k: json.encode(v[0]) for k, v in plans.items()}, arch, name),
        plan_file = _plan_select({k: v[1] for k, v in plans.items()}, arch, name),
        flashinfer_tree = flashinfer_tree,
        **kwargs
    )
