"""Assemble layer blobs into a reproducible OCI image layout.

Usage:
    python3 -m tools.image.layout --out LAYOUT_DIR --layer DESC.json BLOB [--layer ...] \
        [--base-layout BASE_DIR] [--stack NAME] [--lock pins.lock.json] [--sbom sbom.spdx.json] \
        [--entrypoint ARG]... [--cmd ARG]... [--env K=V]... [--label K=V]... [--tag latest]

Writes LAYOUT_DIR/{oci-layout,index.json,blobs/sha256/...} atomically (temp sibling, rename)
and prints the manifest, config and index digests. Every JSON blob is canonical (sorted keys,
no spaces), `created` comes from SOURCE_DATE_EPOCH, so the same inputs give the same digests.

Labels written: org.kimi-k3.stack, org.kimi-k3.pins-sha256 (sha256 of the stack's entry and its pins),
org.kimi-k3.base-digest (the base layout's manifest digest, else the first layer's diff_id),
org.kimi-k3.sbom-sha256, org.kimi-k3.layer-compression, org.opencontainers.image.created.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically
from tools.common.hashing import sha256_bytes, sha256_file
from tools.common.jsonfmt import canonical_json
from tools.image.compression import MEDIA_TYPES
from tools.image.layer_tar import source_date_epoch

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_MEDIA_TYPES = {
    *MEDIA_TYPES.values(),
    "application/vnd.docker.image.rootfs.diff.tar.gzip",  # a docker base converted by skopeo
}
DEFAULT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")
LABEL_PREFIX = "org.kimi-k3."


@dataclass(frozen=True)
class Layer:
    """A layer as the image sees it: blob descriptor + uncompressed digest + where the blob is."""

    name: str
    media_type: str
    digest: str
    size: int
    diff_id: str
    blob: Path
    compression: str = ""  # what layer.py compressed it with; "" for a pulled base's layers

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size,
                "annotations": {LABEL_PREFIX + "layer": self.name}}


@dataclass(frozen=True)
class BuiltImage:
    layout: Path
    manifest_digest: str
    config_digest: str
    index_digest: str
    layers: tuple[Layer, ...]


def sha256_digest(data: bytes) -> str:
    return "sha256:" + sha256_bytes(data)


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64:
        raise UserError(f"{layout}: digest {digest!r} is not sha256:<64 hex>; rebuild the layout")
    return layout / "blobs" / "sha256" / hexdigest


def read_layer_descriptor(desc_path: Path, blob: Path) -> Layer:
    try:
        desc = json.loads(desc_path.read_text())
        layer = Layer(name=str(desc["name"]), media_type=str(desc["mediaType"]),
                      digest=str(desc["digest"]), size=int(desc["size"]),
                      diff_id=str(desc["diff_id"]), blob=blob, compression=str(desc.get("compression", "")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--layer {desc_path}: not a layer descriptor from tools/image/layer.py ({e}); "
                        "rebuild the layer") from e
    if layer.media_type not in LAYER_MEDIA_TYPES:
        raise UserError(f"--layer {desc_path}: unknown mediaType {layer.media_type!r}")
    if not blob.is_file() or blob.stat().st_size != layer.size:
        raise UserError(f"--layer {desc_path} {blob}: blob missing or not {layer.size} bytes; "
                        "pass the blob written with this descriptor")
    return layer


def read_index_manifest(layout: Path) -> tuple[dict[str, Any], bytes]:
    """The single image manifest of a layout (linux/amd64 if the index lists several)."""
    try:
        index = json.loads((layout / "index.json").read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"{layout}: no readable index.json ({e}); pass an OCI image layout dir") from e
    manifests = index.get("manifests", [])
    if len(manifests) > 1:
        manifests = [m for m in manifests if m.get("platform", {}).get("architecture") == "amd64"
                     and m.get("platform", {}).get("os") == "linux"]
    if len(manifests) != 1:
        raise UserError(f"{layout}/index.json: expected one linux/amd64 image manifest, found "
                        f"{len(manifests)}; copy a single image (skopeo copy docker://R@sha256:D oci:DIR)")
    desc = manifests[0]
    data = blob_path(layout, desc["digest"]).read_bytes()
    if desc.get("mediaType") == INDEX_MEDIA_TYPE or json.loads(data).get("manifests"):
        raise UserError(f"{layout}: the index points at another index; copy one platform's image")
    if sha256_digest(data) != desc["digest"]:
        raise UserError(f"{layout}: manifest blob does not match its digest; re-copy the layout")
    return desc, data


def base_layers(base_layout: Path) -> tuple[list[Layer], dict[str, Any], str]:
    """Layers and config of a base image copied into an OCI layout (e.g. by tools/image/rootfs.py pull)."""
    desc, manifest_bytes = read_index_manifest(base_layout)
    manifest = json.loads(manifest_bytes)
    config = json.loads(blob_path(base_layout, manifest["config"]["digest"]).read_bytes())
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    if len(diff_ids) != len(manifest["layers"]):
        raise UserError(f"{base_layout}: config lists {len(diff_ids)} diff_ids for "
                        f"{len(manifest['layers'])} layers; re-copy the base image")
    layers = [Layer(name=f"base-{i}", media_type=l["mediaType"], digest=l["digest"], size=l["size"],
                    diff_id=diff_id, blob=blob_path(base_layout, l["digest"]))
              for i, (l, diff_id) in enumerate(zip(manifest["layers"], diff_ids))]
    # tools/image/rootfs.py pull records the digest asked for: a Docker-format base converted to OCI
    # has a new manifest digest, but the registry digest is the one that identifies the base.
    recorded = base_layout / "base-digest"
    base_digest = recorded.read_text().strip() if recorded.is_file() else desc["digest"]
    return layers, config, base_digest


def _put_blob(layout: Path, layer: Layer) -> None:
    """Hard-link (or copy) a layer blob in, verifying its digest on the way."""
    dest = blob_path(layout, layer.digest)
    if dest.exists():
        return
    if "sha256:" + sha256_file(layer.blob) != layer.digest:
        raise UserError(f"{layer.blob}: content does not match {layer.digest} ({layer.name}); rebuild the layer")
    try:
        os.link(layer.blob, dest)
    except OSError:
        shutil.copyfile(layer.blob, dest)


def _parse_pairs(items: Sequence[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        if "=" not in item or item.startswith("="):
            raise UserError(f"{flag} {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        pairs.append((key, value))
    return pairs


def config_env(env: Sequence[str], base_env: Sequence[str] | None = None) -> list[str]:
    """The image config's Env: the base image's (or DEFAULT_ENV), then `env` (KEY=VALUE) over it."""
    merged = dict(e.split("=", 1) for e in (base_env or DEFAULT_ENV))
    merged.update(dict(e.split("=", 1) for e in env))
    return [f"{k}={v}" for k, v in merged.items()]


def image_config(layers: Sequence[Layer], epoch: int, env: Sequence[str], entrypoint: Sequence[str],
                 cmd: Sequence[str], labels: dict[str, str], base_config: dict[str, Any] | None) -> dict[str, Any]:
    created = rfc3339(epoch)
    base_cfg = (base_config or {}).get("config", {}) or {}
    config: dict[str, Any] = {"Env": config_env(env, base_cfg.get("Env")),
                              "Labels": dict(sorted({**(base_cfg.get("Labels") or {}), **labels}.items())),
                              "WorkingDir": "/"}
    if entrypoint:
        config["Entrypoint"] = list(entrypoint)
    if cmd:
        config["Cmd"] = list(cmd)
    history = list((base_config or {}).get("history", []))
    history += [{"created": created, "created_by": f"kimi-k3 layer {l.name}"}
                for l in layers[len([h for h in history if not h.get("empty_layer")]):]]
    return {"architecture": "amd64", "os": "linux", "created": created, "config": config,
            "rootfs": {"type": "layers", "diff_ids": [l.diff_id for l in layers]}, "history": history}


def file_sha256(path: Path, flag: str) -> str:
    try:
        return "sha256:" + sha256_file(path)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read ({e}); pass an existing file") from e


def stack_pins_digest(lock_path: Path, stack: str) -> str:
    """sha256 of the canonical JSON of one stack and the pins it uses.

    Not the lock file's bytes: an edit to another stack or an unused pin must not change this
    image's config digest (same pins -> same manifest digest).
    """
    from tools.pins import lock as lockfile

    lock = lockfile.load(lock_path)
    names = lock.stack(stack).pin_names()
    raw = lockfile.read_raw(lock_path)
    return sha256_digest(canonical_json({"stack": raw["stacks"][stack],
                                         "pins": {n: raw["pins"][n] for n in names}}))


def build_image(out: Path, layers: Sequence[Layer], epoch: int, *, env: Sequence[str] = (),
                entrypoint: Sequence[str] = (), cmd: Sequence[str] = (), labels: dict[str, str] | None = None,
                base_config: dict[str, Any] | None = None, base_digest: str | None = None,
                tag: str = "latest") -> BuiltImage:
    """Write the layout at `out` (replacing it atomically) and return its digests."""
    if not layers:
        raise UserError("--layer: an image needs at least one layer")
    all_labels = dict(labels or {})
    all_labels[LABEL_PREFIX + "base-digest"] = base_digest or layers[0].diff_id
    all_labels[LABEL_PREFIX + "layer-compression"] = ",".join(sorted({l.compression for l in layers if l.compression}))
    all_labels["org.opencontainers.image.created"] = rfc3339(epoch)
    config = image_config(layers, epoch, env, entrypoint, cmd, all_labels, base_config)
    config_bytes = canonical_json(config)
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256_digest(config_bytes),
                           "size": len(config_bytes)},
                "layers": [l.descriptor() for l in layers]}
    manifest_bytes = canonical_json(manifest)
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE,
             "manifests": [{"mediaType": MANIFEST_MEDIA_TYPE, "digest": sha256_digest(manifest_bytes),
                            "size": len(manifest_bytes),
                            "platform": {"architecture": "amd64", "os": "linux"},
                            "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    index_bytes = canonical_json(index)

    out = out.absolute()
    with dir_replaced_atomically(out, "--out", tool=None) as tmp:
        (tmp / "blobs" / "sha256").mkdir(parents=True)
        for layer in layers:
            _put_blob(tmp, layer)
        for data in (config_bytes, manifest_bytes):
            blob_path(tmp, sha256_digest(data)).write_bytes(data)
        (tmp / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
        (tmp / "index.json").write_bytes(index_bytes)
        # Only what this tool wrote: layer blobs may be hard links to read-only build outputs.
        for p in [tmp, tmp / "blobs", tmp / "blobs" / "sha256"]:
            os.chmod(p, 0o755)
        for p in [tmp / "oci-layout", tmp / "index.json", *(blob_path(tmp, sha256_digest(d)) for d in (config_bytes, manifest_bytes))]:
            os.chmod(p, 0o644)
    return BuiltImage(layout=out, manifest_digest=sha256_digest(manifest_bytes),
                      config_digest=sha256_digest(config_bytes), index_digest=sha256_digest(index_bytes),
                      layers=tuple(layers))


def print_digests(image: BuiltImage) -> None:
    print(f"manifest digest: {image.manifest_digest}")
    print(f"config digest:   {image.config_digest}")
    print(f"index digest:    {image.index_digest}")
    for layer in image.layers:
        print(f"layer {layer.name}: {layer.digest} {layer.size} bytes")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="OCI layout directory to (re)write")
    p.add_argument("--layer", nargs=2, action="append", default=[], metavar=("DESC_JSON", "BLOB"),
                   help="a layer from tools/image/layer.py, bottom first")
    p.add_argument("--base-layout", type=Path, help="OCI layout of a base image pulled by digest")
    p.add_argument("--stack", help="stack name (label)")
    p.add_argument("--lock", type=Path, help="pins lock file (the digest of --stack's pins becomes a label)")
    p.add_argument("--sbom", type=Path, help="the SBOM file shipped in a layer (its sha256 becomes a label)")
    p.add_argument("--entrypoint", action="append", default=[])
    p.add_argument("--cmd", action="append", default=[])
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--label", action="append", default=[], metavar="K=V")
    p.add_argument("--tag", default="latest", help="ref name recorded in index.json")
    p.add_argument("--source-date-epoch", default=None, help="default: $SOURCE_DATE_EPOCH")
    args = p.parse_args(argv)
    epoch = source_date_epoch(args.source_date_epoch)

    labels = dict(_parse_pairs(args.label, "--label"))
    _parse_pairs(args.env, "--env")
    if args.stack:
        labels[LABEL_PREFIX + "stack"] = args.stack
    if args.lock:
        if not args.stack:
            raise UserError("--lock: needs --stack (the label is the digest of that stack's pins)")
        labels[LABEL_PREFIX + "pins-sha256"] = stack_pins_digest(args.lock, args.stack)
    if args.sbom:
        labels[LABEL_PREFIX + "sbom-sha256"] = file_sha256(args.sbom, "--sbom")
    layers: list[Layer] = []
    base_config = None
    base_digest = None
    if args.base_layout:
        layers, base_config, base_digest = base_layers(args.base_layout)
    layers += [read_layer_descriptor(Path(d), Path(b)) for d, b in args.layer]
    image = build_image(args.out, layers, epoch, env=args.env, entrypoint=args.entrypoint, cmd=args.cmd,
                        labels=labels, base_config=base_config, base_digest=base_digest, tag=args.tag)
    print_digests(image)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
