"""What a built layout holds, read back for the push's report and the provenance: its layers by
name, and the compiled modules (FlashInfer's kernel cache, SGLang's JIT) with their sha256."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tools.image.layout import LABEL_PREFIX, blob_path, read_index_manifest
from tools.image.image_caches import SGLANG_JIT_IMAGE_PATH, SGLANG_JIT_MANIFEST


LAYER_ANNOTATION = LABEL_PREFIX + "layer"  # how tools/image/layout.py names each layer
# The manifests of the layers of compiled modules: layer name -> (the manifest's path in the
# layer, how each module's sha256 is read from it, what a printed line calls the module).
_MODULE_MANIFESTS = {
    "kernel_cache": ("flashinfer/data/aot/kernel_cache.json",
                     lambda data: {m: v["sha256"] for m, v in data.get("modules", {}).items()}, "kernel module"),
    "sglang_jit": (f"{SGLANG_JIT_IMAGE_PATH.lstrip('/')}/{SGLANG_JIT_MANIFEST}",
                   lambda data: {m["module"]: m["so_sha256"] for m in data.get("modules", [])}, "sglang-jit module"),
}


def image_layers(layout: Path) -> list[tuple[str, str, int]]:
    """[(layer name, digest, size)] of a layout, bottom first."""
    _, manifest_bytes = read_index_manifest(layout)
    return [(l.get("annotations", {}).get(LAYER_ANNOTATION, "?"), l["digest"], int(l["size"]))
            for l in json.loads(manifest_bytes)["layers"]]


def layer_json(layout: Path, digest: str, path: str) -> dict | None:
    """The JSON file at `path` (a suffix of its path in the image) in the layer blob `digest`."""
    from tools.image.compression import open_layer_blob
    with open_layer_blob(blob_path(layout, digest)) as tar:
        for member in tar:
            if member.isfile() and member.name.lstrip("./").endswith(path):
                return json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
    return None


def image_contents(layout: Path) -> tuple[list[tuple[str, str, int]], dict[str, dict[str, str]]]:
    """([(layer name, digest, size)], {layer name: {module: sha256}}) of a layout: what a user
    compares with another machine's build (docs/DIGESTS.md) to find the layer, and inside a layer
    of compiled modules (FlashInfer's kernel cache, SGLang's JIT modules) the module, whose bytes
    differ."""
    layers = image_layers(layout)
    modules: dict[str, dict[str, str]] = {}
    for name, digest, _ in layers:
        if name in _MODULE_MANIFESTS:
            path, read, _ = _MODULE_MANIFESTS[name]
            data = layer_json(layout, digest, path)
            if data is not None:
                modules[name] = dict(sorted(read(data).items()))
    return layers, modules


def kernel_selection(layout: Path) -> str:
    """The kernel selection the image's kernel cache was built from ("" without a kernel cache)."""
    for name, digest, _ in image_layers(layout):
        if name == "kernel_cache":
            return str((layer_json(layout, digest, _MODULE_MANIFESTS[name][0]) or {}).get("selection", ""))
    return ""


def print_contents(layout: Path) -> None:
    layers, modules = image_contents(layout)
    for name, digest, size in layers:
        print(f"layer {name:<13} {digest} {size} bytes")
    for layer, found in modules.items():
        for name, sha in found.items():
            print(f"{_MODULE_MANIFESTS[layer][2]} {name:<24} sha256:{sha}")


def default_repository_path(layout: Path) -> str:
    try:
        desc, manifest_bytes = read_index_manifest(layout)
        config_digest = json.loads(manifest_bytes)["config"]["digest"]
        labels = json.loads(blob_path(layout, config_digest).read_bytes()).get("config", {}).get("Labels") or {}
        stack = labels.get("org.kimi-k3.stack", "image")
    except (OSError, ValueError, KeyError):
        stack = "image"
    return f"kimi-k3/{re.sub(r'[^a-z0-9._-]', '-', stack.lower())}"
