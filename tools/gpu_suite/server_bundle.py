"""The image's root for a GPU host that runs the real SGLang server (issue #38's proof), in parts
small enough to carry one per transfer:

    python3 -m tools.gpu_suite.server_bundle --layout OCI_LAYOUT --out DIR \
        [--host-spec tools/gpu_suite/gpu_host.json] [--tree IMAGE_PATH=LOCAL_DIR ...] [--part-mib 56]

A GPU host without a container runtime cannot start the image, but it can hold the image's files
at the image's own paths: Debian's python3.11 at /usr/bin, its standard library, the installed
site-packages at /usr/local/lib/python3.11/dist-packages, the entrypoint and its profiles. The
paths matter: Triton's keys and the kernels' line info hold them, so what a server compiles
there is what it compiles in the image. DIR holds:

  root.tar.gz.NNN   one gzip'd tar of the image's files, split into parts of --part-mib
  manifest.json     the image's manifest digest, the layers taken and left out (with why), the
                    files left out for the host to provide, each part's sha256, the whole
                    stream's sha256, the image's env

Left out (gpu_host.json `server_bundle`): the layers that are the image's SM120 builds (kernel
cache, its SGLang JIT modules) and the attachments, and the CUDA libraries the GPU host's own
torch brings (cuBLAS, cuDNN, ...: `server_host.py install` links the host's copies where the
image has them), so a bundle is a third of the image. `--tree` adds a directory at an image path
(the GPU's own first-use caches, built here for its arch); `--trees-only` writes those alone, an
overlay for a host that already installed a bundle.

DIR is this tool's output (marked): written in a temp sibling and swapped in whole.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically
from tools.common.jsondata import ANY, TEXT, ListOf, MapOf, Object, load_json_file
from tools.common.jsonfmt import review_json
from tools.common.progress import human_bytes

TOOL = "tools.gpu_suite.server_bundle"
HOST_SPEC = Path(__file__).absolute().parent / "gpu_host.json"
MANIFEST = "manifest.json"
PART_PREFIX = "root.tar.gz."

SERVER_BUNDLE_SCHEMA = Object({
    "why": TEXT,
    "layers_left_out": MapOf(TEXT),
    "from_host": MapOf(ListOf(TEXT, non_empty=True)),
})


def _blob(layout: Path | None, digest: str, path: str | None = None) -> Path:
    if path is not None:
        return Path(path)
    algo, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algo / hexdigest


def image_layers(layout: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(manifest digest, its layer descriptors bottom first, the image config) of the layout's one
    image."""
    index_path = layout / "index.json"
    if not index_path.is_file():
        raise UserError(f"--layout {layout}: no index.json; pass the OCI layout the main job wrote "
                        "(tools/bazel build --config=pypi //image:image)")
    index = json.loads(index_path.read_text())
    manifests = index.get("manifests") or []
    if len(manifests) != 1:
        raise UserError(f"--layout {layout}: index.json lists {len(manifests)} manifests, expected one image")
    digest = manifests[0]["digest"]
    manifest = json.loads(_blob(layout, digest).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    return digest, manifest["layers"], config


def layer_name(descriptor: dict[str, Any]) -> str:
    """The layer's name as the image's build gives it (its annotation), else its digest."""
    annotations = descriptor.get("annotations") or {}
    return annotations.get("org.opencontainers.image.title") or annotations.get("kimi-k3.layer") or descriptor["digest"]


def left_out_by_host(name: str, from_host: dict[str, list[str]]) -> str | None:
    """The host library group whose pattern matches this member's path, if any."""
    for group, patterns in from_host.items():
        for pattern in patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return group
    return None


@contextlib.contextmanager
def _layer_tar(layout: Path, descriptor: dict[str, Any]) -> Iterator[tarfile.TarFile]:
    """The layer blob as a tar stream; zstd (the image's layer compression) through zstd's CLI,
    which this Python's tarfile cannot read."""
    blob = _blob(layout, descriptor["digest"], descriptor.get("path"))
    if not descriptor.get("mediaType", "").endswith("+zstd"):
        with tarfile.open(blob, mode="r|*") as tar:
            yield tar
        return
    zstd = shutil.which("zstd")
    if zstd is None:
        raise UserError("zstd: not on PATH; install Debian's zstd (the image's layers are zstd tars)")
    with subprocess.Popen([zstd, "-dc", str(blob)], stdout=subprocess.PIPE) as proc:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            yield tar
        # tarfile stops at the end-of-archive block; the rest (padding) must be read, or zstd
        # dies of SIGPIPE.
        while proc.stdout.read(1 << 20):
            pass
        proc.stdout.close()
        if proc.wait() != 0:
            raise UserError(f"{blob}: zstd -dc failed (exit {proc.returncode}); rebuild the image")


class _PartWriter(io.RawIOBase):
    """A write-only stream cut into files of `part_bytes`, hashing the whole and each part."""

    def __init__(self, out: Path, part_bytes: int) -> None:
        self.out, self.part_bytes = out, part_bytes
        self.whole = hashlib.sha256()
        self.parts: list[dict[str, Any]] = []
        self._file = None
        self._hash = None
        self._size = 0

    def writable(self) -> bool:
        return True

    def _next_part(self) -> None:
        self._close_part()
        name = f"{PART_PREFIX}{len(self.parts):03d}"
        self._file = open(self.out / name, "wb")
        self._hash, self._size = hashlib.sha256(), 0
        self.parts.append({"file": name})

    def _close_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1].update(sha256=self._hash.hexdigest(), size=self._size)
            self._file = None

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data)
        written = 0
        while written < len(view):
            if self._file is None or self._size >= self.part_bytes:
                self._next_part()
            take = min(len(view) - written, self.part_bytes - self._size)
            chunk = view[written:written + take]
            self._file.write(chunk)
            self._hash.update(chunk)
            self.whole.update(chunk)
            self._size += take
            written += take
        return written

    def close(self) -> None:
        self._close_part()
        super().close()


def built_layers(paths: Sequence[Path], env: Sequence[str]) -> tuple[None, list[dict[str, Any]], dict[str, Any]]:
    """Like image_layers, from the image's layer actions' outputs (`<name>.layer.json` beside its
    `<name>.tar.zst`, bottom first) before the image is assembled: no manifest digest yet."""
    descriptors = []
    for path in paths:
        meta = json.loads(path.read_text())
        blob = path.with_name(path.name[:-len(".layer.json")] + ".tar.zst")
        if not blob.is_file():
            raise UserError(f"--layer {path}: no {blob.name} beside it; build the layer first")
        descriptors.append({"digest": meta["digest"], "mediaType": meta["mediaType"], "path": str(blob),
                            "annotations": {"kimi-k3.layer": "layer_" + meta["name"]}})
    return None, descriptors, {"config": {"Env": list(env)}}


def write_bundle(layout: Path | None, out: Path, spec: dict[str, Any], trees: dict[str, Path], part_bytes: int,
                 layers: tuple[str | None, list[dict[str, Any]], dict[str, Any]] | None = None) -> dict:
    digest, descriptors, config = layers if layers is not None else image_layers(layout)
    layers_left_out = spec["layers_left_out"]
    taken, skipped = [], []
    host_files: dict[str, list[str]] = {}
    writer = _PartWriter(out, part_bytes)
    # mtime 0 and level 6: the parts are transport, not a release artifact; the manifest's
    # sha256 of the stream is what the GPU host checks.
    files = total = 0
    # mtime 0: the parts are transport, not a release artifact; the manifest's sha256 of the
    # stream is what the GPU host checks. Members are streamed layer by layer, bottom first: tar
    # extracts a later member over an earlier one, as the image's later layer wins.
    with gzip.GzipFile(fileobj=writer, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for descriptor in descriptors:
            name = layer_name(descriptor)
            if name in layers_left_out:
                skipped.append({"layer": name, "digest": descriptor["digest"], "why": layers_left_out[name]})
                continue
            taken.append({"layer": name, "digest": descriptor["digest"]})
            with _layer_tar(layout, descriptor) as layer:
                for member in layer:
                    path = member.name.lstrip("./")
                    group = left_out_by_host(path, spec["from_host"])
                    if group is not None:
                        host_files.setdefault(group, []).append(path)
                        continue
                    tar.addfile(member, layer.extractfile(member) if member.isreg() else None)
                    files += 1
                    total += member.size if member.isreg() else 0
        for image_path, local in sorted(trees.items()):
            for dirpath, dirnames, filenames in os.walk(local):
                dirnames.sort()
                rel = os.path.relpath(dirpath, local)
                base = image_path.strip("/") if rel == "." else f"{image_path.strip('/')}/{rel}"
                info = tarfile.TarInfo(base)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
                for filename in sorted(filenames):
                    source = Path(dirpath, filename)
                    info = tarfile.TarInfo(f"{base}/{filename}")
                    info.size = source.stat().st_size
                    info.mode = 0o755 if os.access(source, os.X_OK) else 0o644
                    with open(source, "rb") as f:
                        tar.addfile(info, f)
                    files += 1
                    total += info.size
    writer.close()
    return {
        "schema_version": 1,
        "image": digest,
        "env": config.get("config", {}).get("Env", []),
        "layers": taken,
        "layers_left_out": skipped,
        "trees": {k: str(v) for k, v in sorted(trees.items())},
        "from_host": {group: sorted(paths) for group, paths in sorted(host_files.items())},
        "files": files,
        "bytes_unpacked": total,
        "parts": writer.parts,
        "sha256": writer.whole.hexdigest(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--layout", type=Path, help="the image's OCI layout directory")
    source.add_argument("--layer", type=Path, action="append", help="a layer's <name>.layer.json, bottom first")
    source.add_argument("--trees-only", action="store_true",
                        help="only the --tree directories: an overlay installed over a host that holds an earlier "
                             "bundle (the first-use caches built after its recording), a few parts instead of all")
    parser.add_argument("--env", action="append", default=[], help="with --layer: the image's env, NAME=VALUE")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--host-spec", type=Path, default=HOST_SPEC)
    parser.add_argument("--tree", action="append", default=[], metavar="IMAGE_PATH=DIR")
    parser.add_argument("--part-mib", type=int, default=56)
    args = parser.parse_args(argv)
    spec = load_json_file(args.host_spec, "--host-spec", Object({"server_bundle": SERVER_BUNDLE_SCHEMA}, other=ANY),
                          "fix the file")["server_bundle"]
    trees: dict[str, Path] = {}
    for item in args.tree:
        image_path, sep, local = item.partition("=")
        if not sep or not image_path.startswith("/") or not Path(local).is_dir():
            raise UserError(f"--tree {item}: expected /IMAGE/PATH=LOCAL_DIR with an existing directory")
        trees[image_path] = Path(local)
    if args.trees_only and not trees:
        raise UserError("--trees-only: give at least one --tree /IMAGE/PATH=LOCAL_DIR")
    with dir_replaced_atomically(args.out, "--out", tool=TOOL) as tmp:
        layers = built_layers(args.layer, args.env) if args.layer else None
        if args.trees_only:
            layers = (None, [], {})  # install applies no env or links for an overlay
        manifest = write_bundle(args.layout, tmp, spec, trees, args.part_mib << 20, layers)
        manifest["overlay"] = args.trees_only
        (tmp / MANIFEST).write_bytes(review_json(manifest))
    size = sum(p["size"] for p in manifest["parts"])
    print(f"wrote {args.out}: image {(manifest['image'] or 'not assembled')[:19]}, {manifest['files']} files, "
          f"{human_bytes(manifest['bytes_unpacked'])} unpacked, {len(manifest['parts'])} parts, {human_bytes(size)}")
    for group, paths in manifest["from_host"].items():
        print(f"  left for the host: {group}: {len(paths)} files")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
