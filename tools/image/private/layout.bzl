"""oci_image_layout: the OCI layout (directory) from layers, bottom first (tools/image/layout.py)."""

load(":common.bzl", "PY_TOOLCHAIN", "run_tool", "tool_attr")
load(":providers.bzl", "LayerInfo")

def _oci_image_layout_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name + ".oci")
    args = ctx.actions.args()
    args.add("--out", out.path)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add("--tag", ctx.attr.tag)
    inputs = []
    for layer in ctx.attr.layers:
        info = layer[LayerInfo]
        args.add("--layer").add(info.descriptor).add(info.blob)
        inputs += [info.descriptor, info.blob]
    if ctx.attr.stack:
        args.add("--stack", ctx.attr.stack)
    if ctx.file.lock:
        args.add("--lock", ctx.file.lock)
        inputs.append(ctx.file.lock)
    if ctx.file.sbom:
        args.add("--sbom", ctx.file.sbom)
        inputs.append(ctx.file.sbom)
    args.add_all(ctx.attr.entrypoint, before_each = "--entrypoint")
    args.add_all(["%s=%s" % (k, v) for k, v in sorted(ctx.attr.env.items())], before_each = "--env")
    args.add_all(["%s=%s" % (k, v) for k, v in sorted(ctx.attr.labels.items())], before_each = "--label")
    run_tool(ctx, "image.layout", args, inputs, [out], "OciImage", "Assembling the OCI layout %{label}")
    return [DefaultInfo(files = depset([out]))]

oci_image_layout = rule(
    implementation = _oci_image_layout_impl,
    doc = "OCI image layout directory (tools/image/layout.py); prints manifest/config/index digests.",
    attrs = tool_attr("//tools/image:layout") | {
        "layers": attr.label_list(providers = [LayerInfo], doc = "bottom first"),
        "stack": attr.string(),
        "lock": attr.label(allow_single_file = True),
        "sbom": attr.label(allow_single_file = True),
        "entrypoint": attr.string_list(),
        "env": attr.string_dict(),
        "labels": attr.string_dict(),
        "tag": attr.string(default = "latest", doc = "ref name recorded in index.json"),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = PY_TOOLCHAIN,
)
