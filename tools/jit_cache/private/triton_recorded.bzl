"""triton_recorded_cache: the first-use caches of a recording (jit_cache/recordings/<stack>.<arch>.json)
rebuilt ahead of time in Triton's cache layout (see //tools/jit_cache:defs.bzl)."""

load("//image:constants.bzl", "SOURCE_DATE_EPOCH", "TRITON_LIBCUDA_PATH")
load("//tools/image/private:providers.bzl", "LayerInfo")
load(":image_inputs.bzl", "image_tool_args", "run_on_image")

def _triton_recorded_cache_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args, image_files = image_tool_args(ctx, "build-from-recording")
    args.add("--recording", ctx.file.recording)
    args.add("--source-date-epoch", str(SOURCE_DATE_EPOCH))
    inputs = [ctx.file.recording]
    if ctx.file.kernel_plan:
        args.add("--kernel-plan", ctx.file.kernel_plan)
        inputs.append(ctx.file.kernel_plan)
    transitive = []
    if ctx.attr.sglang_jit:
        [sglang_dir] = ctx.files.sglang_jit
        args.add("--sglang-manifest", sglang_dir.path)
        transitive.append(ctx.attr.sglang_jit[DefaultInfo].files)
    if ctx.file.device_of:
        args.add("--device-of", ctx.file.device_of)
        inputs.append(ctx.file.device_of)
    if ctx.file.runtime:
        args.add("--runtime", ctx.file.runtime)
        args.add("--host-triton", ctx.file.host_triton)
        inputs += [ctx.file.runtime, ctx.file.host_triton]
    else:
        # Triton's driver module (cuda_utils) for the image's Python: the image has no C compiler,
        # so a cache without it compiles at the first launch.
        args.add("--cuda-home", ctx.file._cuda_identity.dirname)
        args.add("--userland", ctx.file._userland_identity.dirname)
        args.add("--libcuda-path", TRITON_LIBCUDA_PATH)
        inputs += [ctx.file._cuda_identity, ctx.file._userland_identity]
        transitive += [ctx.attr._cuda[DefaultInfo].files, ctx.attr._userland[DefaultInfo].files]
    args.add("--out", out.path)

    # Sandboxed and remote-cacheable: the image's base tar and installed trees, the recording,
    # the plan and SGLang JIT build it is checked against, the pinned compiler userland and CUDA
    # root (the driver module and its libcuda link stub) and the tool's sources are every input
    # (Triton and its ptxas are the image's own).
    return run_on_image(
        ctx,
        "tools.jit_cache.triton_recorded",
        args,
        image_files,
        inputs,
        transitive,
        out,
        "TritonRecorded",
        "Rebuilding the first-use caches of %s (stack %s, %s)" % (ctx.file.recording.basename, ctx.attr.stack, ctx.attr.arch),
    )

triton_recorded_cache = rule(
    implementation = _triton_recorded_cache_impl,
    doc = "Triton cache entries and autotune results of a recording, keyed exactly as recorded, + kimi-k3-triton.json (bind with triton_aot bind). Output group image_inputs: the base tar and installed trees it ran on.",
    attrs = {
        "arch": attr.string(mandatory = True, doc = "the recorded device's capability, X.Y"),
        "stack": attr.string(mandatory = True),
        "recording": attr.label(allow_single_file = [".json"], mandatory = True, doc = "jit_cache/recordings/<stack>.<arch>.json"),
        "layers": attr.label_list(providers = [LayerInfo], mandatory = True, doc = "the image's layers up to SGLang's own: base first"),
        "kernel_plan": attr.label(allow_single_file = [".bzl"], doc = "the stack's kernel-cache plan: every recorded FlashInfer module must be in it"),
        "sglang_jit": attr.label(doc = "the SGLang JIT build (sglang_jit_cache) every recorded sglang-jit module must be in"),
        "runtime": attr.label(allow_single_file = [".json"], doc = "the recording ran another host's Triton: a JSON file with a triton_runtime object; needs host_triton"),
        "device_of": attr.label(allow_single_file = [".json"], doc = "the stand-in device answers as this file's triton_runtime device (tools/gpu_suite/gpu_host.json), keyed for the image's Triton"),
        "host_triton": attr.label(allow_single_file = [".whl"], doc = "with runtime: that host's Triton wheel"),
        "_tool": attr.label(default = "//tools/jit_cache:triton_recorded"),
        "_cuda": attr.label(default = "@kimi_cuda//:root"),
        "_cuda_identity": attr.label(allow_single_file = True, default = "@kimi_cuda//:identity"),
        "_userland": attr.label(default = "@kimi_cxx_userland//:root"),
        "_userland_identity": attr.label(allow_single_file = True, default = "@kimi_cxx_userland//:identity"),
    },
    toolchains = ["@bazel_tools//tools/python:toolchain_type"],
)
