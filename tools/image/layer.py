"""Reproducible OCI layer tars: same inputs -> byte-identical blob, same digest.

Usage:
    python3 -m tools.image.layer --out-tree DIR [--wheel WHEEL]... [--wheel-dir DIR]...
    python3 -m tools.image.layer --name NAME --out LAYER.tar.gz --descriptor LAYER.json \
        [--tree IMAGE_DIR=HOST_DIR]... [--site-tree HOST_DIR]... [--wheel WHEEL]... \
        [--wheel-dir DIR]... [--file IMAGE_PATH=HOST_FILE[:MODE]]... [--tar ROOTFS.tar]
        [--compression zstd|gzip|none]
        [--kernel-cache-arch ARCH] [--cuda-home]

The descriptor JSON ({name, mediaType, digest, size, diff_id}) is what tools/image/layout.py reads.

--kernel-cache-arch ARCH: every --tree/--site-tree is a FlashInfer kernel cache, and one built
for another arch is refused: its flashinfer/data/aot/kernel_cache.json must say arch_list ARCH
(an empty flashinfer/data/aot, a stack without a cache, passes). The image's kernel-cache layer
sets it to the image's FLASHINFER_CUDA_ARCH_LIST, so no build flag can ship other kernels.

--cuda-home: the layer also holds the image's CUDA home, /usr/local/cuda (tools/common/cuda_home.py
says what it is and why the image needs one); the layer that installs the CUDA wheels sets it.

The jobs live one per module: layer_contents (what a layer holds), wheel_install (wheels into a
tree), layer_tar (the tar, its order and its descriptor; why it is hand-written), compression
(the encoding).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from tools.common.errors import UserError, run_cli
from tools.common import cuda_home
from tools.image.compression import MEDIA_TYPES
from tools.image.layer_contents import Entry, LayerContents
from tools.image.layer_tar import source_date_epoch, write_descriptor, write_layer
from tools.image.wheel_install import SITE_PACKAGES, install_wheels, wheels_in_dirs


def _split_assignment(raw: str, flag: str) -> tuple[str, str]:
    if "=" not in raw:
        raise UserError(f"{flag} {raw!r}: expected IMAGE_PATH=HOST_PATH")
    left, right = raw.split("=", 1)
    return left, right


KERNEL_CACHE_AOT = Path("flashinfer") / "data" / "aot"
KERNEL_CACHE_JSON = "kernel_cache.json"  # tools/kernel_cache CACHE_JSON_NAME


def check_kernel_cache_arch(flag: str, host_dir: Path, arch: str) -> None:
    """Refuse a kernel cache tree whose kernel_cache.json is not for `arch`."""
    aot = host_dir / KERNEL_CACHE_AOT
    if not aot.is_dir():
        raise UserError(f"{flag} {host_dir}: no {KERNEL_CACHE_AOT} in it; --kernel-cache-arch layers take "
                        "a kernel cache tree (tools/kernel_cache assemble)")
    cache_json = aot / KERNEL_CACHE_JSON
    if not cache_json.exists():
        if any(aot.iterdir()):
            raise UserError(f"{flag} {host_dir}: {KERNEL_CACHE_AOT} holds modules but no {KERNEL_CACHE_JSON}; "
                            "pass a cache assembled by tools/kernel_cache")
        return  # the empty stand-in of a stack without a cache: FlashInfer compiles at first use
    try:
        found = json.loads(cache_json.read_text()).get("arch_list")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{cache_json}: unreadable ({type(e).__name__}); rebuild the kernel cache") from None
    if found != arch:
        raise UserError(f"{flag} {host_dir}: kernel cache built for arch {found!r}, this layer is for {arch!r}; "
                        f"pass a cache built for {arch} (the image takes //kernel_cache:sm120_cache)")


def build_contents(trees: Iterable[str], site_trees: Iterable[str], wheels: Iterable[str],
                   files: Iterable[str], tars: Iterable[str], staging: Path,
                   with_cuda_home: bool = False) -> LayerContents:
    contents = LayerContents()
    if with_cuda_home:
        contents.add(Entry(cuda_home.CUDA_HOME, "dir", 0o755), "--cuda-home")
        for name, target in cuda_home.links(SITE_PACKAGES).items():
            contents.add(Entry(f"{cuda_home.CUDA_HOME}/{name}", "symlink", 0o777, linkname=target), "--cuda-home")
    for tar in tars:
        contents.add_tar(Path(tar))
    for raw in trees:
        image_dir, host_dir = _split_assignment(raw, "--tree")
        contents.add_tree(image_dir, Path(host_dir))
    for host_dir in site_trees:
        contents.add_tree(SITE_PACKAGES, Path(host_dir))
    for raw in files:
        image_path, spec = _split_assignment(raw, "--file")
        mode: int | None = None
        host, sep, mode_text = spec.rpartition(":")
        if sep and mode_text and all(c in "01234567" for c in mode_text):
            mode = int(mode_text, 8)
        else:
            host = spec
        contents.add_file(image_path, Path(host), mode)
    if wheels:
        installed = staging / "installed"
        install_wheels([Path(w) for w in wheels], installed)
        contents.add_tree("", installed)
    return contents


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", help="layer name (recorded in the descriptor)")
    p.add_argument("--out", type=Path, help="layer blob to write")
    p.add_argument("--descriptor", type=Path, help="descriptor JSON to write")
    p.add_argument("--out-tree", type=Path, metavar="DIR",
                   help="instead of a blob: install the --wheel/--wheel-dir wheels into DIR (the "
                        "layer's tree, rooted at the image's /) and write nothing else")
    p.add_argument("--tree", action="append", default=[], metavar="IMAGE_DIR=HOST_DIR")
    p.add_argument("--site-tree", action="append", default=[], metavar="HOST_DIR",
                   help=f"a tree placed under /{SITE_PACKAGES} (patched packages, kernel cache)")
    p.add_argument("--wheel", action="append", default=[], metavar="WHEEL")
    p.add_argument("--wheel-dir", action="append", default=[], metavar="DIR", help="every .whl in DIR")
    p.add_argument("--file", action="append", default=[], metavar="IMAGE_PATH=HOST_FILE[:MODE]")
    p.add_argument("--tar", action="append", default=[], metavar="ROOTFS_TAR")
    p.add_argument("--compression", choices=sorted(MEDIA_TYPES), default="zstd",
                   help="the blob's encoding (default zstd; gzip for runtimes older than containerd 1.5 / Docker 23)")
    p.add_argument("--kernel-cache-arch", metavar="ARCH",
                   help="refuse a --tree/--site-tree kernel cache whose kernel_cache.json is for another arch")
    p.add_argument("--cuda-home", action="store_true", help="add the image's CUDA home (tools/common/cuda_home.py)")
    p.add_argument("--source-date-epoch", default=None, help="default: $SOURCE_DATE_EPOCH")
    args = p.parse_args(argv)
    if args.out_tree is not None:
        others = [f for f, v in (("--out", args.out), ("--descriptor", args.descriptor), ("--tree", args.tree),
                                 ("--site-tree", args.site_tree), ("--file", args.file), ("--tar", args.tar)) if v]
        if others:
            raise UserError(f"--out-tree installs wheels only: drop {', '.join(others)} (the blob is written "
                            "from the tree with --tree =DIR)")
        wheels = [Path(w) for w in [*args.wheel, *wheels_in_dirs(args.wheel_dir)]]
        if not wheels:
            raise UserError("--out-tree: no --wheel/--wheel-dir to install; pass the layer's wheels")
        install_wheels(wheels, args.out_tree)
        print(f"installed {len(wheels)} wheels into {args.out_tree}", file=sys.stderr)
        return 0
    missing = [f for f, v in (("--name", args.name), ("--out", args.out), ("--descriptor", args.descriptor)) if not v]
    if missing:
        raise UserError(f"{', '.join(missing)}: required to write a layer blob (or pass --out-tree to install wheels)")
    epoch = source_date_epoch(args.source_date_epoch)
    if args.kernel_cache_arch is not None:
        if not (args.tree or args.site_tree):
            raise UserError("--kernel-cache-arch: no --tree/--site-tree to check; pass the kernel cache tree")
        for raw in args.tree:
            check_kernel_cache_arch("--tree", Path(_split_assignment(raw, "--tree")[1]), args.kernel_cache_arch)
        for raw in args.site_tree:
            check_kernel_cache_arch("--site-tree", Path(raw), args.kernel_cache_arch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".oci_layer_stage.", dir=args.out.parent) as staging:
        wheels = [*args.wheel, *wheels_in_dirs(args.wheel_dir)]
        contents = build_contents(args.tree, args.site_tree, wheels, args.file, args.tar, Path(staging),
                                  with_cuda_home=args.cuda_home)
        if not contents.entries:
            raise UserError(f"--name {args.name}: the layer has no inputs; pass --tree/--wheel/--file/--tar")
        desc = write_layer(contents, args.name, args.out, epoch, compression=args.compression)
    write_descriptor(desc, args.descriptor)
    print(f"layer {desc.name}: {desc.digest} {desc.size} bytes (tar {desc.tar_size} bytes, "
          f"{len(contents.entries)} entries)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
