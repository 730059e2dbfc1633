"""Providers shared between the image rules."""

LayerInfo = provider(
    doc = "One image layer from tools/image/layer.py.",
    fields = {
        "blob": "the layer blob (tar+gzip)",
        "descriptor": "its descriptor JSON",
        # What the blob is written from, for oci_rootfs (the image's root without its blobs):
        "name": "the layer's name (its descriptor's)",
        "tars": "rootfs tars imported whole (owners and special bits kept)",
        "installed": "the tree its wheels were installed into (rooted at /), or None",
        "trees": "[(image directory, directory File)]",
        "site_trees": "directories placed under the image's site-packages",
        "files": "[(IMAGE_PATH[:OCTAL_MODE], File)]",
        "cuda_home": "whether it holds the image's CUDA home (tools/common/cuda_home.py; unset: False)",
    },
)
