"""debian_rootfs: the base OS tar of a Debian set (tools/image/rootfs.py debian: mmdebstrap from
the set's local repository of verified .debs; root, no network)."""

load(":common.bzl", "LOCAL", "PY_TOOLCHAIN", "run_tool", "tool_attr")

def _debian_rootfs_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".tar")
    packages = [f for f in ctx.files.repo if f.basename == "Packages"]
    if len(packages) != 1:
        fail("%s: repo must hold one Packages file (a @debian_<set>//:repo target)" % ctx.label)
    args = ctx.actions.args()
    args.add("debian")
    args.add("--out", out)
    args.add("--lock", ctx.file.lock)
    args.add("--set", ctx.attr.set)
    args.add("--repo", packages[0].dirname)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add("--cache-root-file", ctx.file.cache_root)

    # mmdebstrap needs root (chroot, mounts); its only mirror is the repository of the set's
    # verified .debs, an input of this action, so the action needs no network. The action cache
    # keeps the tar until the set's entries change; tools/image/rootfs.py also keeps it in the
    # user's cache (${KIMI_K3_CACHE:-~/.cache/kimi-k3-build}/rootfs, keyed by the set's entries
    # and re-hashed on use; the action gets the root from cache_root, having no environment), so
    # `bazel clean` does not rebuild it.
    run_tool(
        ctx,
        "image.rootfs",
        args,
        [ctx.file.lock, ctx.file.cache_root] + ctx.files.repo,
        [out],
        "DebianRootfs",
        "Building the rootfs of Debian set %s (mmdebstrap)" % ctx.attr.set,
    )
    return [DefaultInfo(files = depset([out]))]

debian_rootfs = rule(
    implementation = _debian_rootfs_impl,
    attrs = tool_attr("//tools/image:rootfs") | {
        "set": attr.string(mandatory = True, doc = "the set's name in the Debian lock"),
        "lock": attr.label(allow_single_file = True, mandatory = True, doc = "@debian_<set>//:lock"),
        "repo": attr.label(allow_files = True, mandatory = True, doc = "@debian_<set>//:repo"),
        "cache_root": attr.label(allow_single_file = True, mandatory = True, doc = "@debian_<set>//:cache_root: " +
                                                                                   "where the cached rootfs tars live"),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = PY_TOOLCHAIN,
)
