"""image_sbom: the SPDX document of a built image, attached beside its digest (tools/image/image_sbom.py)."""

load(":common.bzl", "PY_TOOLCHAIN", "run_tool", "tool_attr")

def _image_sbom_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".spdx.json")
    cyclonedx = ctx.actions.declare_file(ctx.label.name + ".cdx.json")
    args = ctx.actions.args()
    args.add("--layout", ctx.file.layout.path)
    args.add("--stack", ctx.attr.stack)
    args.add("--lock", ctx.file.lock)
    args.add("--debian-lock", ctx.file.debian_lock)
    args.add("--debian-set", ctx.attr.debian_set)
    args.add_all(ctx.files.gate_manifests, before_each = "--gate-manifest")
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add("--out", out)
    args.add("--out-cyclonedx", cyclonedx)
    inputs = [ctx.file.layout, ctx.file.lock, ctx.file.debian_lock] + ctx.files.gate_manifests
    run_tool(ctx, "image.image_sbom", args, inputs, [out, cyclonedx], "ImageSbom", "Scanning the image %{label} (syft)")
    # The SPDX document is the target's file; the CycloneDX one its output group `cyclonedx`.
    return [DefaultInfo(files = depset([out])), OutputGroupInfo(cyclonedx = depset([cyclonedx]))]

image_sbom = rule(
    implementation = _image_sbom_impl,
    doc = "SPDX 2.3 JSON of everything in an OCI layout: syft's scan plus the lock's hashes, the " +
          "patch gate's states and the compiled modules; syft's CycloneDX in output group " +
          "`cyclonedx` (tools/image/image_sbom.py).",
    attrs = tool_attr("//tools/image:image_sbom") | {
        "layout": attr.label(mandatory = True, allow_single_file = True),
        "stack": attr.string(mandatory = True),
        "lock": attr.label(allow_single_file = True, default = "//third_party:pins.lock.json"),
        "debian_lock": attr.label(mandatory = True, allow_single_file = True),
        "debian_set": attr.string(mandatory = True),
        "gate_manifests": attr.label_list(allow_files = [".json"]),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = PY_TOOLCHAIN,
)
