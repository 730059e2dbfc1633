"""sbom: the SPDX document shipped in the image (tools/image/sbom.py)."""

load(":common.bzl", "PY_TOOLCHAIN", "run_tool", "tool_attr")

def _sbom_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".spdx.json")
    args = ctx.actions.args()
    args.add("--lock", ctx.file.lock)
    args.add("--stack", ctx.attr.stack)
    args.add("--out", out)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add_all(ctx.files.gate_manifests, before_each = "--gate-manifest")
    inputs = [ctx.file.lock] + ctx.files.gate_manifests
    if ctx.file.debian_lock:
        args.add("--debian-lock", ctx.file.debian_lock)
        args.add("--debian-set", ctx.attr.debian_set)
        inputs.append(ctx.file.debian_lock)
    for wheel, pins in ctx.attr.built_wheels.items():
        files = wheel[DefaultInfo].files.to_list()
        if len(files) != 1:
            fail("built_wheels: %s gives %d files; give one wheel" % (wheel.label, len(files)))
        args.add("--built-wheel", "%s=%s" % (files[0].path, pins))
        inputs.append(files[0])
    run_tool(ctx, "image.sbom", args, inputs, [out], "Sbom", "Writing the SBOM %{label}")
    return [DefaultInfo(files = depset([out]))]

sbom = rule(
    implementation = _sbom_impl,
    attrs = tool_attr("//tools/image:sbom") | {
        "lock": attr.label(allow_single_file = True, default = "//third_party:pins.lock.json"),
        "stack": attr.string(mandatory = True),
        "gate_manifests": attr.label_list(allow_files = [".json"]),
        "debian_lock": attr.label(allow_single_file = True, doc = "the base layer's set, e.g. @debian_image_base//:lock"),
        "debian_set": attr.string(doc = "the set's name (with debian_lock)"),
        "source_date_epoch": attr.string(mandatory = True),
        "built_wheels": attr.label_keyed_string_dict(doc = "wheels this project builds from pins -> those pins, comma-separated (an image variant's FlashKDA)"),
    },
    toolchains = PY_TOOLCHAIN,
)
