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
    run_tool(ctx, "image.sbom", args, [ctx.file.lock] + ctx.files.gate_manifests, [out], "Sbom", "Writing the SBOM %{label}")
    return [DefaultInfo(files = depset([out]))]

sbom = rule(
    implementation = _sbom_impl,
    attrs = tool_attr("//tools/image:sbom") | {
        "lock": attr.label(allow_single_file = True, default = "//third_party:pins.lock.json"),
        "stack": attr.string(mandatory = True),
        "gate_manifests": attr.label_list(allow_files = [".json"]),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = PY_TOOLCHAIN,
)
