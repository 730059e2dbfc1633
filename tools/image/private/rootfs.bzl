"""debian_rootfs: the base OS tar (tools/image/rootfs.py debian, mmdebstrap; network + root)."""

load(":common.bzl", "LOCAL", "PY_TOOLCHAIN", "run_tool", "tool_attr")

def _debian_rootfs_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    args = ctx.actions.args()
    args.add("debian")
    args.add("--out", out)
    args.add("--suite", ctx.attr.suite)
    args.add("--mirror", ctx.attr.mirror)
    args.add("--variant", ctx.attr.variant)
    args.add_all(ctx.attr.include, before_each = "--include")
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)

    # mmdebstrap downloads .debs and needs root (chroot, mounts). The action cache keeps the
    # tar until an attribute changes; tools/image/rootfs.py also keeps it in the user's cache
    # (${KIMI_K3_CACHE:-~/.cache/kimi-k3-build}/rootfs), so `bazel clean` does not refetch.
    # Reproducible only while the mirror's content is fixed: set `mirror` to a
    # snapshot.debian.org URL to pin it.
    run_tool(
        ctx,
        "image.rootfs",
        args,
        [],
        [out],
        "DebianRootfs",
        "Building the Debian %s rootfs (mmdebstrap)" % ctx.attr.suite,
        requirements = LOCAL | {"requires-network": "1"},
    )
    return [DefaultInfo(files = depset([out]))]

debian_rootfs = rule(
    implementation = _debian_rootfs_impl,
    attrs = tool_attr("//tools/image:rootfs") | {
        "suite": attr.string(default = "bookworm"),
        "mirror": attr.string(default = "http://deb.debian.org/debian"),
        "variant": attr.string(default = "minbase"),
        "include": attr.string_list(mandatory = True, doc = "Debian packages on top of the variant"),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = PY_TOOLCHAIN,
)
