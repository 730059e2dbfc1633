"""oci_layer: one reproducible layer blob + its descriptor (tools/image/layer.py);
entrypoint_layer: the image's entrypoint and launch profiles, checked first
(tools/image/entrypoint_layer.py)."""

load(":common.bzl", "PY_TOOLCHAIN", "run_tool", "tool_attr")
load(":providers.bzl", "LayerInfo")

_BLOB_SUFFIX = {"zstd": ".tar.zst", "gzip": ".tar.gz"}

_COMPRESSION = attr.string(
    mandatory = True,
    values = ["zstd", "gzip"],
    doc = "the blob's encoding (tools/image/layer.py --compression; the image's BUILD takes it from a flag)",
)

def _image_file_spec(image_path_and_mode, file):
    """`IMAGE_PATH[:MODE]` (the dict value in BUILD) -> tools/image/layer.py's --file value."""
    image_path, _, mode = image_path_and_mode.partition(":")
    return "%s=%s%s" % (image_path, file.path, (":" + mode) if mode else "")

def _single_file(target, what):
    files = target.files.to_list()
    if len(files) != 1:
        fail("%s: %s must be exactly one file or directory, got %d" % (what, target.label, len(files)))
    return files[0]

def _oci_layer_impl(ctx):
    blob = ctx.actions.declare_file(ctx.label.name + _BLOB_SUFFIX[ctx.attr.compression])
    descriptor = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    args = ctx.actions.args()
    args.add("--name", ctx.attr.layer_name or ctx.label.name.removeprefix("layer_"))
    args.add("--out", blob)
    args.add("--descriptor", descriptor)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add("--compression", ctx.attr.compression)
    inputs = []
    for f in ctx.files.tars:
        args.add("--tar", f)
        inputs.append(f)
    installed = None
    if ctx.files.wheels or ctx.files.wheel_dirs:
        # Wheels are installed by their own action into a tree (the layer's files as the image
        # sees them), which the blob is written from and the launch-profile check mounts as the
        # image's root (oci_rootfs): the check needs no compressed blob.
        installed = ctx.actions.declare_directory(ctx.label.name + ".installed")
        install_args = ctx.actions.args()
        install_args.add("--out-tree", installed.path)
        install_args.add_all(ctx.files.wheels, before_each = "--wheel")
        install_args.add_all([f.path for f in ctx.files.wheel_dirs], before_each = "--wheel-dir")
        run_tool(ctx, "image.layer", install_args, ctx.files.wheels + ctx.files.wheel_dirs, [installed],
                 "OciLayerInstall", "Installing the wheels of image layer %{label}")
        args.add("--tree", "=" + installed.path)
        inputs.append(installed)
    for f in ctx.files.site_trees:
        args.add("--site-tree", f.path)
        inputs.append(f)
    for target, image_dir in ctx.attr.trees.items():
        d = _single_file(target, "trees")
        args.add("--tree", "%s=%s" % (image_dir, d.path))
        inputs.append(d)
    for target, image_path in ctx.attr.files.items():
        f = _single_file(target, "files")
        args.add("--file", _image_file_spec(image_path, f))
        inputs.append(f)
    if ctx.attr.kernel_cache_arch:
        args.add("--kernel-cache-arch", ctx.attr.kernel_cache_arch)
    if ctx.attr.cuda_home:
        args.add("--cuda-home")
    run_tool(ctx, "image.layer", args, inputs, [blob, descriptor], "OciLayer", "Writing image layer %{label}")
    return [
        DefaultInfo(files = depset([blob, descriptor])),
        LayerInfo(
            blob = blob,
            descriptor = descriptor,
            name = ctx.attr.layer_name or ctx.label.name.removeprefix("layer_"),
            tars = ctx.files.tars,
            installed = installed,
            trees = [(image_dir, _single_file(t, "trees")) for t, image_dir in ctx.attr.trees.items()],
            site_trees = ctx.files.site_trees,
            files = [(image_path, _single_file(t, "files")) for t, image_path in ctx.attr.files.items()],
            cuda_home = ctx.attr.cuda_home,
        ),
    ]

oci_layer = rule(
    implementation = _oci_layer_impl,
    doc = "One reproducible layer (tools/image/layer.py): sorted entries, fixed mtimes/owners/modes, fixed gzip.",
    attrs = tool_attr("//tools/image:layer") | {
        "layer_name": attr.string(doc = "name recorded in the manifest annotation (default: target name without layer_)"),
        "tars": attr.label_list(allow_files = [".tar"], doc = "rootfs tars (owners and special bits kept)"),
        "wheels": attr.label_list(allow_files = [".whl"], doc = "installed as Debian's python3 would (installer library)"),
        "wheel_dirs": attr.label_list(allow_files = True, doc = "directories whose .whl files are installed (repacked patched wheels)"),
        "site_trees": attr.label_list(allow_files = True, doc = "directories placed as-is under site-packages"),
        "trees": attr.label_keyed_string_dict(allow_files = True, doc = "directory -> image directory"),
        "files": attr.label_keyed_string_dict(allow_files = True, doc = "file -> IMAGE_PATH[:OCTAL_MODE]"),
        "kernel_cache_arch": attr.string(doc = "the trees are kernel caches: the action refuses one whose kernel_cache.json is for another arch"),
        "cuda_home": attr.bool(doc = "the layer also holds the image's CUDA home, /usr/local/cuda (tools/common/cuda_home.py): the layer that installs the CUDA wheels"),
        "source_date_epoch": attr.string(mandatory = True),
        "compression": _COMPRESSION,
    },
    toolchains = PY_TOOLCHAIN,
)

def _entrypoint_layer_impl(ctx):
    blob = ctx.actions.declare_file(ctx.label.name + _BLOB_SUFFIX[ctx.attr.compression])
    descriptor = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    args = ctx.actions.args()
    args.add("--entrypoint", ctx.file.entrypoint)
    args.add("--entrypoint-image-path", ctx.attr.entrypoint_image_path)
    for f in ctx.files.profiles:
        args.add("--profile", f)
    args.add("--profiles-image-dir", ctx.attr.profiles_image_dir)
    args.add("--needs", ctx.file.needs)
    args.add("--selections", ctx.file.selections)
    args.add("--lock", ctx.file.lock)
    args.add("--name", ctx.attr.layer_name or ctx.label.name.removeprefix("layer_"))
    args.add("--out", blob)
    args.add("--descriptor", descriptor)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add("--compression", ctx.attr.compression)
    inputs = [ctx.file.entrypoint, ctx.file.needs, ctx.file.selections, ctx.file.lock] + ctx.files.profiles
    run_tool(ctx, "image.entrypoint_layer", args, inputs, [blob, descriptor], "OciLayer",
             "Checking the launch profiles and writing image layer %{label}")
    return [
        DefaultInfo(files = depset([blob, descriptor])),
        LayerInfo(
            blob = blob,
            descriptor = descriptor,
            name = ctx.attr.layer_name or ctx.label.name.removeprefix("layer_"),
            tars = [],
            installed = None,
            trees = [],
            site_trees = [],
            files = [(ctx.attr.entrypoint_image_path + ":755", ctx.file.entrypoint)] +
                    [(ctx.attr.profiles_image_dir + "/" + f.basename, f) for f in ctx.files.profiles],
        ),
    ]

entrypoint_layer = rule(
    implementation = _entrypoint_layer_impl,
    doc = "The entrypoint layer: the launch profiles validated with the entrypoint's own guard, then " +
          "the entrypoint (mode 755) and the profiles written as one reproducible layer.",
    attrs = tool_attr("//tools/image:entrypoint_layer") | {
        "layer_name": attr.string(doc = "name recorded in the manifest annotation (default: target name without layer_)"),
        "entrypoint": attr.label(allow_single_file = True, mandatory = True),
        "entrypoint_image_path": attr.string(mandatory = True),
        "profiles": attr.label_list(allow_files = [".json"], mandatory = True, doc = "the launch profiles NAME.json"),
        "profiles_image_dir": attr.string(mandatory = True),
        "needs": attr.label(allow_single_file = True, mandatory = True, doc = "image/backend_needs.json"),
        "selections": attr.label(allow_single_file = True, mandatory = True, doc = "kernel_cache/selections.json"),
        "lock": attr.label(allow_single_file = True, mandatory = True, doc = "the pins lock (each stack's Mooncake)"),
        "source_date_epoch": attr.string(mandatory = True),
        "compression": _COMPRESSION,
    },
    toolchains = PY_TOOLCHAIN,
)
