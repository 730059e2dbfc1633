"""Thin Bazel rules over the image tools (all logic is in tools/image/*.py, tested on its own).

    debian_rootfs      tools/image/rootfs.py debian: the base OS tar of a Debian set (mmdebstrap; root)
    oci_layer          tools/image/layer.py: one reproducible layer blob + its descriptor
    entrypoint_layer   tools/image/entrypoint_layer.py: the launch profiles checked (the entrypoint
                       guard's rule included), then the entrypoint + profiles layer
    empty_directory    a directory output with nothing in it (stand-in kernel cache)
    sbom               tools/image/sbom.py: the SPDX document shipped in the image
    oci_image_layout   tools/image/layout.py: the OCI layout (directory) from layers, bottom first
    oci_rootfs         the image's root as its layers' parts, for the launch-profile check (no blobs)
    image_sbom         tools/image/image_sbom.py: the SPDX document of a built layout (syft + the locks)
    oci_push           `bazel run` target: tools/image/push.py on that layout (+ attachments, signed)
    image_config_binary  a `bazel run` target (oci_push) built in the configuration of a stack's
                       image, the one the CPU suite's image checks use (one disk cache for both)
    oci_verify         `bazel run` target: tools/image/verify.py (signature, blobs, provenance, SBOM)
    signing_key        `bazel run` target: tools/image/signing.py generate (a sigstore key pair)

One action per layer, so Bazel's action cache is the layer cache: changing one SGLang patch
re-runs the gate, the SGLang wheel repack and the SGLang layer action; every other layer action
sees identical inputs and is a cache hit. Each rule's tool is a py_library label
(//tools/image:layer, :sbom, ...): the action's tool inputs are that library's transitive
sources only, so an edit to another tool (say smoke.py) invalidates none of the layer actions.
SOURCE_DATE_EPOCH is a mandatory attribute (the BUILD file's constant), never the wall clock, so
the same inputs give the same digests. Rule internals: tools/image/private/; rules only the
image's tests use: tools/image/testing.bzl.
"""

load("//tools/image/private:empty_directory.bzl", _empty_directory = "empty_directory")
load("//tools/image/private:layer.bzl", _entrypoint_layer = "entrypoint_layer", _oci_layer = "oci_layer")
load("//tools/image/private:layout.bzl", _oci_image_layout = "oci_image_layout")
load("//tools/image/private:providers.bzl", _LayerInfo = "LayerInfo")
load("//tools/image/private:image_config_binary.bzl", _image_config_binary = "image_config_binary")
load("//tools/image/private:image_sbom.bzl", _image_sbom = "image_sbom")
load("//tools/image/private:push.bzl", _oci_push = "oci_push", _oci_verify = "oci_verify", _signing_key = "signing_key")
load("//tools/image/private:rootfs.bzl", _debian_rootfs = "debian_rootfs")
load("//tools/image/private:rootfs_plan.bzl", _oci_rootfs = "oci_rootfs")
load("//tools/image/private:sbom.bzl", _sbom = "sbom")

debian_rootfs = _debian_rootfs
oci_layer = _oci_layer
entrypoint_layer = _entrypoint_layer
empty_directory = _empty_directory
sbom = _sbom
oci_image_layout = _oci_image_layout
oci_rootfs = _oci_rootfs
oci_push = _oci_push
image_config_binary = _image_config_binary
oci_verify = _oci_verify
signing_key = _signing_key
image_sbom = _image_sbom
LayerInfo = _LayerInfo
