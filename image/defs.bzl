"""DRAFT (for the lead to wire and debug): Bazel rules around the image stages.

    load("//image:defs.bzl", "oci_layer", "oci_image_layout", "oci_push", "sbom")

    oci_layer(name = "layer_sglang", wheels = ["@pins//stack:sglang"])          # or site_trees
    oci_layer(name = "layer_base", tars = [":debian_rootfs_tar"])
    sbom(name = "sbom", stack = "default", gate_manifests = [...])
    oci_layer(name = "layer_sbom", files = {":sbom": "/usr/share/kimi-k3/sbom.spdx.json"})
    oci_image_layout(
        name = "image",
        layers = [":layer_base", ":layer_torch", ":layer_third_party", ":layer_flashinfer",
                  ":layer_kernel_cache", ":layer_sglang", ":layer_mooncake",
                  ":layer_entrypoint", ":layer_sbom"],                # bottom first
        stack = "default", lock = "//third_party:pins.lock.json", sbom = ":sbom",
        entrypoint = ["/usr/local/bin/kimi-k3-entrypoint"],
    )
    oci_push(name = "push", layout = ":image")                           # bazel run //image:push -- --tag x

One action per layer: Bazel's action cache is the layer cache, so changing one SGLang patch
re-runs only the sglang layer action (plus the tiny sbom layer and the layout assembly).
SOURCE_DATE_EPOCH is a fixed attribute (not the wall clock): pass the same value everywhere.
The base rootfs (tools/rootfs.py debian) needs network and root; build it outside the sandbox
(`tags = ["no-sandbox", "requires-network"]`) or take a tar from a pinned repository.
"""

_EPOCH_DEFAULT = "1767225600"  # 2026-01-01T00:00:00Z; any fixed value works, keep it stable

LayerInfo = provider(fields = {"blob": "layer blob File", "descriptor": "descriptor JSON File"})

def _oci_layer_impl(ctx):
    blob = ctx.actions.declare_file(ctx.label.name + ".tar.gz")
    desc = ctx.actions.declare_file(ctx.label.name + ".layer.json")
    args = ctx.actions.args()
    args.add("--name", ctx.attr.layer_name or ctx.label.name)
    args.add("--out", blob)
    args.add("--descriptor", desc)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    inputs = []
    for w in ctx.files.wheels:
        args.add("--wheel", w)
        inputs.append(w)
    for t in ctx.files.tars:
        args.add("--tar", t)
        inputs.append(t)
    for d in ctx.files.site_trees:  # directory artifacts (patch gate, kernel cache)
        args.add("--site-tree", d.path)
        inputs.append(d)
    for target, image_path in ctx.attr.files.items():
        for f in target.files.to_list():
            args.add("--file", "%s=%s%s" % (image_path, f.path, (":" + ctx.attr.file_mode) if ctx.attr.file_mode else ""))
            inputs.append(f)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [args],
        inputs = inputs,
        outputs = [blob, desc],
        mnemonic = "OciLayer",
        progress_message = "Writing layer %s" % ctx.label.name,
        use_default_shell_env = False,
    )
    return [DefaultInfo(files = depset([blob, desc])), LayerInfo(blob = blob, descriptor = desc)]

oci_layer = rule(
    implementation = _oci_layer_impl,
    attrs = {
        "layer_name": attr.string(),
        "wheels": attr.label_list(allow_files = [".whl"]),
        "tars": attr.label_list(allow_files = [".tar"]),
        "site_trees": attr.label_list(allow_files = True),
        "files": attr.label_keyed_string_dict(allow_files = True),
        "file_mode": attr.string(doc = "octal mode for `files`, e.g. 755"),
        "source_date_epoch": attr.string(default = _EPOCH_DEFAULT),
        "_tool": attr.label(default = "//tools:oci_layer", executable = True, cfg = "exec"),
    },
)

def _oci_image_layout_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name + ".oci")
    args = ctx.actions.args()
    args.add("--out", out.path)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
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
    for e in ctx.attr.entrypoint:
        args.add("--entrypoint", e)
    for k, v in ctx.attr.env.items():
        args.add("--env", "%s=%s" % (k, v))
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [args],
        inputs = inputs,
        outputs = [out],
        mnemonic = "OciImage",
        use_default_shell_env = False,
    )
    return [DefaultInfo(files = depset([out]))]

oci_image_layout = rule(
    implementation = _oci_image_layout_impl,
    attrs = {
        "layers": attr.label_list(providers = [LayerInfo]),
        "stack": attr.string(),
        "lock": attr.label(allow_single_file = True),
        "sbom": attr.label(allow_single_file = True),
        "entrypoint": attr.string_list(),
        "env": attr.string_dict(),
        "source_date_epoch": attr.string(default = _EPOCH_DEFAULT),
        "_tool": attr.label(default = "//tools:oci_image", executable = True, cfg = "exec"),
    },
)

def _sbom_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".spdx.json")
    args = ctx.actions.args()
    args.add("--lock", ctx.file.lock)
    args.add("--stack", ctx.attr.stack)
    args.add("--out", out)
    args.add("--source-date-epoch", ctx.attr.source_date_epoch)
    for m in ctx.files.gate_manifests:
        args.add("--gate-manifest", m)
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [args],
        inputs = [ctx.file.lock] + ctx.files.gate_manifests,
        outputs = [out],
        mnemonic = "Sbom",
        use_default_shell_env = False,
    )
    return [DefaultInfo(files = depset([out]))]

sbom = rule(
    implementation = _sbom_impl,
    attrs = {
        "lock": attr.label(allow_single_file = True, default = "//third_party:pins.lock.json"),
        "stack": attr.string(mandatory = True),
        "gate_manifests": attr.label_list(allow_files = [".json"]),
        "source_date_epoch": attr.string(default = _EPOCH_DEFAULT),
        "_tool": attr.label(default = "//tools:sbom", executable = True, cfg = "exec"),
    },
)

def _oci_push_impl(ctx):
    # `bazel run` target: pushing is a side effect, never a build action. Extra args
    # (--repository, --tag) pass through; credentials come from the user's environment.
    layout = ctx.files.layout[0]
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(script, "#!/bin/sh\nexec \"%s\" --layout \"%s\" \"$@\"\n" % (
        ctx.executable._tool.short_path,
        layout.short_path,
    ), is_executable = True)
    runfiles = ctx.runfiles(files = [layout]).merge(ctx.attr._tool[DefaultInfo].default_runfiles)
    return [DefaultInfo(executable = script, runfiles = runfiles)]

oci_push = rule(
    implementation = _oci_push_impl,
    executable = True,
    attrs = {
        "layout": attr.label(mandatory = True),
        "_tool": attr.label(default = "//tools:oci_push", executable = True, cfg = "exec"),
    },
)
