"""oci_rootfs: an image's root as the files its layers are written from, without the blobs.

The launch-profile check runs the image's own python3 and SGLang in a chroot. Unpacking the
compressed layers would first compress ~10 GB and then decompress it again; instead the check
mounts the trees the layers are written from (each wheel layer's installed tree, see
oci_layer) under an overlay, and places the small parts (imported tars, files, trees) beside
them (tools/image/image_rootfs.py mounted_rootfs_plan). The plan is a JSON file; its runfiles are
the parts. Nothing here is pushed.
"""

load(":providers.bzl", "LayerInfo")

def _rlocation(f):
    """The runfiles path of f (`<repo>/<path>`), which tests resolve against RUNFILES_DIR."""
    short = f.short_path
    return short[3:] if short.startswith("../") else "_main/" + short

def _oci_rootfs_impl(ctx):
    plan = ctx.actions.declare_file(ctx.label.name + ".rootfs.json")
    layers, parts = [], []
    for target in ctx.attr.layers:
        info = target[LayerInfo]
        layers.append({
            "name": info.name,
            "tars": [_rlocation(f) for f in info.tars],
            "installed": _rlocation(info.installed) if info.installed else None,
            "trees": [[d, _rlocation(f)] for d, f in info.trees],
            "site_trees": [_rlocation(f) for f in info.site_trees],
            "files": [[p, _rlocation(f)] for p, f in info.files],
            "cuda_home": getattr(info, "cuda_home", False) or False,
        })
        parts += info.tars + [f for _, f in info.trees] + info.site_trees + [f for _, f in info.files]
        if info.installed:
            parts.append(info.installed)
    ctx.actions.write(plan, json.encode_indent({
        "schema": "kimi-k3-rootfs-plan/1",
        "env": ["%s=%s" % (k, v) for k, v in sorted(ctx.attr.env.items())],
        "layers": layers,
    }) + "\n")
    return [DefaultInfo(files = depset([plan]), runfiles = ctx.runfiles(files = [plan] + parts))]

oci_rootfs = rule(
    implementation = _oci_rootfs_impl,
    doc = "The image's root as a plan of its layers' parts (bottom first) for tools/image/image_rootfs.py; no blob is built.",
    attrs = {
        "layers": attr.label_list(providers = [LayerInfo], doc = "bottom first, as oci_image_layout takes them"),
        "env": attr.string_dict(doc = "the image's env (oci_image_layout's), merged over its defaults by the reader"),
    },
)
