"""The flashkda_wheel rule (see //tools/kernel_cache:defs.bzl): FlashKDA's wheel for one arch from
the pins, compiled with the kernel cache's pinned toolchain (tools/kernel_cache/flashkda.py).

Actions, each sandboxed with every input declared:
  FlashKdaTree     the FlashKDA and CUTLASS tars and the stack's torch headers -> one tree
  FlashKdaPlan     the pinned setup.py -> this arch's plan (commands, version, wheel name)
  FlashKdaCompile  one per source (its object; the .cu one is the long one)
  FlashKdaWheel    link flash_kda_C and write the wheel, named at analysis from the pin's commit
"""

load("@pins//:git_pins.bzl", "GIT_PINS")

def _res_cuda(_os, _inputs):
    # One nvcc of CUTLASS SM90/SM120 kernels: keep a second heavy compile from running beside it
    # on a small host.
    return {"cpu": 1, "memory": 6000}

def flashkda_version(config, arch):
    """The wheel's version: setup.py's base, the pin's commit and the arch (flashkda.py stamp_version)."""
    commit = GIT_PINS[config["pin"]]["commit"]
    return "%s+%s.sm%s" % (config["base_version"], commit[:7], config["archs"][arch])

def flashkda_wheel_name(config, arch):
    tag = config["python_tag"]
    return "%s-%s-%s-%s-linux_x86_64.whl" % (config["distribution"], flashkda_version(config, arch), tag, tag)

def _object_name(source):
    stem = source.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return stem + ".cuda.o" if source.endswith(".cu") else stem + ".o"

def _flashkda_wheel_impl(ctx):
    config = json.decode(ctx.attr.config_json)
    arch = ctx.attr.arch
    py = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    tool_files = ctx.attr._tool[DefaultInfo].default_runfiles.files
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
    toolchain_files = depset(transitive = [ctx.attr._cuda[DefaultInfo].files, ctx.attr._userland[DefaultInfo].files])
    tc_args = ["--cuda-home", ctx.file._cuda_identity.dirname, "--userland", ctx.file._userland_identity.dirname]

    def run(args, inputs, outputs, mnemonic, progress, toolchain = False, **kwargs):
        ctx.actions.run(
            executable = py.interpreter_path,
            arguments = ["-m", "tools.kernel_cache.flashkda"] + args + (tc_args if toolchain else []),
            inputs = depset(inputs, transitive = [tool_files] + ([toolchain_files] if toolchain else [])),
            outputs = outputs,
            env = env,
            mnemonic = mnemonic,
            progress_message = progress,
            **kwargs
        )

    # The tree does not depend on the arch, but each wheel target makes its own (a few seconds).
    tree = ctx.actions.declare_directory(ctx.label.name + "/tree")
    run(
        ["tree", "--config", ctx.file.config.path, "--flashkda-tar", ctx.file.flashkda.path, "--cutlass-tar",
         ctx.file.cutlass.path, "--torch-wheel", ctx.file.torch_wheel.path, "--out", tree.path],
        [ctx.file.config, ctx.file.flashkda, ctx.file.cutlass, ctx.file.torch_wheel],
        [tree],
        "FlashKdaTree",
        "Unpacking FlashKDA %s, CUTLASS and %s headers" % (GIT_PINS[config["pin"]]["commit"][:7], ctx.file.torch_wheel.basename),
    )
    wheel_name = flashkda_wheel_name(config, arch)
    plan = ctx.actions.declare_file(ctx.label.name + "/plan.json")
    run(
        ["plan", "--config", ctx.file.config.path, "--tree", tree.path, "--arch", arch, "--commit",
         GIT_PINS[config["pin"]]["commit"], "--expect-wheel", wheel_name, "--out", plan.path],
        [ctx.file.config, tree],
        [plan],
        "FlashKdaPlan",
        "Planning FlashKDA's %s wheel from its setup.py" % arch,
    )
    objects = []
    for source in config["sources"]:
        obj = ctx.actions.declare_file("%s/objs/%s" % (ctx.label.name, _object_name(source)))
        run(
            ["compile", "--plan", plan.path, "--tree", tree.path, "--object", obj.basename, "--out", obj.path],
            [plan, tree],
            [obj],
            "FlashKdaCompile",
            "Compiling FlashKDA %s for %s" % (source, arch),
            toolchain = True,
            resource_set = _res_cuda if source.endswith(".cu") else None,
        )
        objects.append(obj)
    wheel = ctx.actions.declare_file("%s/%s" % (ctx.label.name, wheel_name))
    run(
        ["wheel", "--config", ctx.file.config.path, "--plan", plan.path, "--tree", tree.path, "--out", wheel.path,
         "--objects"] + [o.path for o in objects],
        [ctx.file.config, plan, tree] + objects,
        [wheel],
        "FlashKdaWheel",
        "Writing %s" % wheel_name,
        toolchain = True,
    )
    return [
        DefaultInfo(files = depset([wheel])),
        OutputGroupInfo(plan = depset([plan]), objects = depset(objects), tree = depset([tree])),
    ]

flashkda_wheel = rule(
    implementation = _flashkda_wheel_impl,
    doc = "FlashKDA's wheel for one arch (kernel_cache/flashkda.bzl), built from its pins.",
    attrs = {
        "arch": attr.string(mandatory = True, doc = "9.0a or 12.0a (kernel_cache/flashkda.bzl archs)"),
        "config_json": attr.string(mandatory = True, doc = "FLASHKDA of kernel_cache/flashkda.bzl, as JSON"),
        "config": attr.label(allow_single_file = True, default = "//kernel_cache:flashkda.bzl"),
        "flashkda": attr.label(allow_single_file = True, default = "@pins//:flashkda"),
        "cutlass": attr.label(allow_single_file = True, default = "@pins//:flashkda-cutlass"),
        "torch_wheel": attr.label(allow_single_file = [".whl"], default = "@pins//stack:torch"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
        "_tool": attr.label(default = "//tools/kernel_cache:flashkda", providers = [PyInfo]),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
