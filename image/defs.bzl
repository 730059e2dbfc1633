"""Thin Bazel rules over the image tools (all logic is in tools/*.py, tested on its own).

    debian_rootfs      tools/image/rootfs.py debian: the base OS tar (mmdebstrap; network + root)
    oci_layer          tools/image/layer.py: one reproducible layer blob + its descriptor
    empty_directory    a directory output with nothing in it (stand-in kernel cache)
    sbom               tools/image/sbom.py: the SPDX document shipped in the image
    oci_image_layout   tools/image/layout.py: the OCI layout (directory) from layers, bottom first
    oci_push           `bazel run` target: tools/image/push.py on that layout
    kernel_cache_layer_test   analysis test: the kernel-cache layer's tree and arch guard

One action per layer, so Bazel's action cache is the layer cache: changing one SGLang patch
re-runs the gate, the SGLang wheel repack and the SGLang layer action; every other layer action
sees identical inputs and is a cache hit. SOURCE_DATE_EPOCH is a mandatory attribute (the
BUILD file's constant), never the wall clock, so the same inputs give the same digests.

Every image action runs unsandboxed: the tools read input trees with lstat (symlinks are
kept as symlinks in a layer, see tools/image/layer.py), so a sandbox's symlink forest would leak
into the layer; and the inputs are GBs of wheels, which a sandbox only slows down.
"""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")

# Execution requirements of every image action (see above); no-remote: GB-sized blobs that a
# remote cache would only shuttle back and forth.
_LOCAL = {"no-sandbox": "1", "no-remote": "1"}

def _python(ctx):
    """(interpreter path, its files) of the registered Python toolchain (the hashed venv)."""
    runtime = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    if runtime.interpreter != None:
        return runtime.interpreter.path, depset([runtime.interpreter], transitive = [runtime.files])
    return runtime.interpreter_path, runtime.files or depset()

def _tool_files(ctx):
    return depset(ctx.files._tool_srcs)

def _run_tool(ctx, module, args, inputs, outputs, mnemonic, progress, requirements = _LOCAL):
    """Run `python -m tools.<module> ARGS` with the toolchain's interpreter."""
    interpreter, interpreter_files = _python(ctx)
    ctx.actions.run_shell(
        # PATH: the system tools the stages call (mmdebstrap, chroot helpers); nothing from
        # the user's environment reaches the action.
        command = 'export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin; ' +
                  'py="$1"; shift; exec "$py" -m tools.%s "$@"' % module,
        arguments = [interpreter, args],
        inputs = depset(inputs, transitive = [_tool_files(ctx), interpreter_files]),
        outputs = outputs,
        mnemonic = mnemonic,
        progress_message = progress,
        use_default_shell_env = False,
        execution_requirements = requirements,
    )

# Each rule's inputs name only the tool modules it runs (and what they import), not all of
# //tools: an edit to an unrelated tool (say tools/kernel_cache) must not invalidate the
# multi-GB layer actions. Keep these lists in step with the `from tools ...` imports.
_COMMON_SRCS = ["//tools:__init__.py", "//tools/common:errors.py", "//tools/image:layer.py"]
_IMAGE_SRCS = _COMMON_SRCS + ["//tools/image:layout.py", "//tools/pins:lock.py"]

def _tool_attrs(srcs):
    return {"_tool_srcs": attr.label_list(default = srcs, allow_files = [".py"])}

_LAYER_TOOL_ATTRS = _tool_attrs(_COMMON_SRCS)
_ROOTFS_TOOL_ATTRS = _tool_attrs(_COMMON_SRCS + ["//tools/common:hashing.py", "//tools/image:rootfs.py"])
_SBOM_TOOL_ATTRS = _tool_attrs(_IMAGE_SRCS + ["//tools/image:sbom.py"])
_IMAGE_TOOL_ATTRS = _tool_attrs(_IMAGE_SRCS)
_PUSH_TOOL_ATTRS = _tool_attrs(_IMAGE_SRCS + ["//tools/image:push.py"])
_PY_TOOLCHAIN = ["@bazel_tools//tools/python:toolchain_type"]

# ---------------------------------------------------------------- base rootfs

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
    _run_tool(
        ctx,
        "image.rootfs",
        args,
        [],
        [out],
        "DebianRootfs",
        "Building the Debian %s rootfs (mmdebstrap)" % ctx.attr.suite,
        requirements = _LOCAL | {"requires-network": "1"},
    )
    return [DefaultInfo(files = depset([out]))]

debian_rootfs = rule(
    implementation = _debian_rootfs_impl,
    attrs = _ROOTFS_TOOL_ATTRS | {
        "suite": attr.string(default = "bookworm"),
        "mirror": attr.string(default = "http://deb.debian.org/debian"),
        "variant": attr.string(default = "minbase"),
        "include": attr.string_list(mandatory = True, doc = "Debian packages on top of the variant"),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = _PY_TOOLCHAIN,
)

# ---------------------------------------------------------------- layers

LayerInfo = provider(
    doc = "One image layer from tools/image/layer.py.",
    fields = {"blob": "the layer blob (tar+gzip)", "descriptor": "its descriptor JSON"},
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
    blob = ctx.actions.declare_file(ctx.label.name + ".tar.gz")
    descriptor = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    args = ctx.actions.args()
    args.add("--name", ctx.attr.layer_name or ctx.label.name.removeprefix("layer_"))
    args.add("--out", blob)
    args.add("--descriptor", descriptor)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    inputs = []
    for f in ctx.files.tars:
        args.add("--tar", f)
        inputs.append(f)
    for f in ctx.files.wheels:
        args.add("--wheel", f)
        inputs.append(f)
    for f in ctx.files.wheel_dirs:
        args.add("--wheel-dir", f.path)
        inputs.append(f)
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
    _run_tool(ctx, "image.layer", args, inputs, [blob, descriptor], "OciLayer", "Writing image layer %{label}")
    return [
        DefaultInfo(files = depset([blob, descriptor])),
        LayerInfo(blob = blob, descriptor = descriptor),
    ]

oci_layer = rule(
    implementation = _oci_layer_impl,
    doc = "One reproducible layer (tools/image/layer.py): sorted entries, fixed mtimes/owners/modes, fixed gzip.",
    attrs = _LAYER_TOOL_ATTRS | {
        "layer_name": attr.string(doc = "name recorded in the manifest annotation (default: target name without layer_)"),
        "tars": attr.label_list(allow_files = [".tar"], doc = "rootfs tars (owners and special bits kept)"),
        "wheels": attr.label_list(allow_files = [".whl"], doc = "installed as Debian's python3 would (installer library)"),
        "wheel_dirs": attr.label_list(allow_files = True, doc = "directories whose .whl files are installed (repacked patched wheels)"),
        "site_trees": attr.label_list(allow_files = True, doc = "directories placed as-is under site-packages"),
        "trees": attr.label_keyed_string_dict(allow_files = True, doc = "directory -> image directory"),
        "files": attr.label_keyed_string_dict(allow_files = True, doc = "file -> IMAGE_PATH[:OCTAL_MODE]"),
        "kernel_cache_arch": attr.string(doc = "the trees are kernel caches: the action refuses one whose kernel_cache.json is for another arch"),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = _PY_TOOLCHAIN,
)

def _empty_directory_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run_shell(command = 'mkdir -p "$1/$2"', arguments = [out.path, ctx.attr.subdir], outputs = [out], mnemonic = "EmptyDir")
    return [DefaultInfo(files = depset([out]))]

empty_directory = rule(
    implementation = _empty_directory_impl,
    doc = "A directory output holding only `subdir` (e.g. a kernel cache with no module).",
    attrs = {"subdir": attr.string(default = "")},
)

# ---------------------------------------------------------------- SBOM, layout, push

def _sbom_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".spdx.json")
    args = ctx.actions.args()
    args.add("--lock", ctx.file.lock)
    args.add("--stack", ctx.attr.stack)
    args.add("--out", out)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    args.add_all(ctx.files.gate_manifests, before_each = "--gate-manifest")
    _run_tool(ctx, "image.sbom", args, [ctx.file.lock] + ctx.files.gate_manifests, [out], "Sbom", "Writing the SBOM %{label}")
    return [DefaultInfo(files = depset([out]))]

sbom = rule(
    implementation = _sbom_impl,
    attrs = _SBOM_TOOL_ATTRS | {
        "lock": attr.label(allow_single_file = True, default = "//third_party:pins.lock.json"),
        "stack": attr.string(mandatory = True),
        "gate_manifests": attr.label_list(allow_files = [".json"]),
        "source_date_epoch": attr.string(mandatory = True),
    },
    toolchains = _PY_TOOLCHAIN,
)

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
    _run_tool(ctx, "image.layout", args, inputs, [out], "OciImage", "Assembling the OCI layout %{label}")
    return [DefaultInfo(files = depset([out]))]

oci_image_layout = rule(
    implementation = _oci_image_layout_impl,
    doc = "OCI image layout directory (tools/image/layout.py); prints manifest/config/index digests.",
    attrs = _IMAGE_TOOL_ATTRS | {
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
    toolchains = _PY_TOOLCHAIN,
)

_PUSH_SCRIPT = """#!/bin/bash
# Generated by //image:defs.bzl oci_push: push {layout} with tools/image/push.py.
set -euo pipefail
# `bazel run` starts us in the runfiles tree; the layout and tools/ are resolved there, then
# we return to the user's directory so relative paths in the arguments (--authfile) work.
runfiles=$PWD
layout=$(readlink -f "$runfiles/{layout}")
cd "${{BUILD_WORKING_DIRECTORY:-$runfiles}}"
PYTHONPATH="$runfiles" PYTHONDONTWRITEBYTECODE=1 exec "{python}" -m tools.image.push --layout "$layout" "$@"
"""

def _oci_push_impl(ctx):
    # Pushing is a side effect of `bazel run`, never a build action. Extra arguments
    # (--repository, --tag, --authfile) pass through; credentials come from the environment.
    layout = ctx.file.layout
    interpreter, interpreter_files = _python(ctx)
    runtime = ctx.toolchains["@bazel_tools//tools/python:toolchain_type"].py3_runtime
    if runtime.interpreter != None:  # an in-build interpreter: run it from the runfiles tree
        interpreter = "$runfiles/" + runtime.interpreter.short_path
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(script, _PUSH_SCRIPT.format(layout = layout.short_path, python = interpreter), is_executable = True)
    runfiles = ctx.runfiles(files = [layout], transitive_files = depset(transitive = [_tool_files(ctx), interpreter_files]))
    return [DefaultInfo(executable = script, runfiles = runfiles)]

oci_push = rule(
    implementation = _oci_push_impl,
    executable = True,
    doc = "`bazel run` target: push the layout by digest, verify, then tag (tools/image/push.py).",
    attrs = _PUSH_TOOL_ATTRS | {
        "layout": attr.label(mandatory = True, allow_single_file = True),
    },
    toolchains = _PY_TOOLCHAIN,
)

# ---------------------------------------------------------------- wiring test

def _kernel_cache_layer_test_impl(ctx):
    env = analysistest.begin(ctx)
    actions = [a for a in analysistest.target_actions(env) if a.mnemonic == "OciLayer"]
    asserts.equals(env, 1, len(actions), "OciLayer actions of the target under test")
    if actions:
        inputs = [f.short_path for f in actions[0].inputs.to_list()]
        caches = [p for p in inputs if p.startswith("kernel_cache/")]
        asserts.equals(env, [ctx.attr.expected_tree], caches, "kernel cache trees the layer takes")
        argv = actions[0].argv
        i = argv.index("--kernel-cache-arch") if "--kernel-cache-arch" in argv else -1
        asserts.true(env, i >= 0 and argv[i + 1] == ctx.attr.expected_arch,
                     "the layer action must run its arch guard with --kernel-cache-arch %s: %s" % (ctx.attr.expected_arch, argv))
    return analysistest.end(env)

# With --//kernel_cache:arch=9.0a in effect (the default stack), the kernel-cache layer must still
# take the SM120 cache and run its arch guard: the image's environment says 12.0f.
kernel_cache_layer_test = analysistest.make(
    _kernel_cache_layer_test_impl,
    attrs = {
        "expected_tree": attr.string(mandatory = True, doc = "short path of the kernel cache tree"),
        "expected_arch": attr.string(mandatory = True),
    },
    config_settings = {
        str(Label("//kernel_cache:arch")): "9.0a",
        str(Label("//third_party:stack")): "default",
    },
)
