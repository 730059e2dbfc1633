"""Build the full image from local inputs and print per-layer sizes and times (not a test).

Usage:
    SOURCE_DATE_EPOCH=... python3 -m tools.bench.image --work DIR --stack default \
        --base-tar base.tar | --base-layout DIR \
        [--torch-wheel W]... [--wheel W]... [--flashinfer-wheel W | --flashinfer-tree DIR] \
        [--kernel-cache DIR] [--sglang-wheel W | --sglang-tree DIR] [--sglang-jit DIR] [--mooncake-wheel W] \
        [--gate-manifest M]... [--push] [--repository R] [--smoke]

Layers, bottom to top (ordered by how often they change): base OS, torch + NVIDIA CUDA wheels,
other third-party wheels, patched FlashInfer, SM120 kernel cache, patched SGLang, its JIT modules, Mooncake,
entrypoint/config, SBOM. Missing inputs are skipped (printed), so a partial image can be timed.
It runs the same stage CLIs Bazel runs, one after another, each timed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from tools.image import layout as oci_image

from tools.image import layer as oci_layer
from tools.image import layer_tar

from tools.image import push as oci_push

from tools.image import sbom
from tools.image.image_caches import SGLANG_JIT_IMAGE_PATH
from tools.common.errors import UserError, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT_IMAGE_PATH = "/usr/local/bin/kimi-k3-entrypoint"


def layer_plan(args: argparse.Namespace, sbom_file: Path) -> list[tuple[str, list[str]]]:
    """(layer name, oci_layer.py source args) in image order; empty layers are left out."""
    def many(flag: str, values: Sequence[str]) -> list[str]:
        return [x for v in values for x in (flag, v)]
    plan = [
        ("base", many("--tar", [args.base_tar] if args.base_tar else [])),
        ("torch-cuda", many("--wheel", args.torch_wheel)),
        ("third-party", many("--wheel", args.wheel)),
        ("flashinfer", many("--wheel", [args.flashinfer_wheel] if args.flashinfer_wheel else [])
         + many("--site-tree", [args.flashinfer_tree] if args.flashinfer_tree else [])),
        ("kernel-cache", many("--site-tree", [args.kernel_cache] if args.kernel_cache else [])),
        ("sglang", many("--wheel", [args.sglang_wheel] if args.sglang_wheel else [])
         + many("--site-tree", [args.sglang_tree] if args.sglang_tree else [])),
        ("sglang_jit", many("--tree", [f"{SGLANG_JIT_IMAGE_PATH}={args.sglang_jit}"] if args.sglang_jit else [])),
        ("mooncake", many("--wheel", [args.mooncake_wheel] if args.mooncake_wheel else [])),
        ("entrypoint", ["--file", f"{ENTRYPOINT_IMAGE_PATH}={REPO_ROOT / 'image' / 'entrypoint.py'}:755"]),
        ("sbom", ["--file", f"{sbom.IMAGE_PATH}={sbom_file}"]),
    ]
    return [(name, srcs) for name, srcs in plan if srcs]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--stack", default="default")
    p.add_argument("--lock", type=Path, default=REPO_ROOT / "third_party" / "pins.lock.json")
    p.add_argument("--base-tar")
    p.add_argument("--base-layout", type=Path)
    p.add_argument("--torch-wheel", action="append", default=[])
    p.add_argument("--wheel", action="append", default=[])
    p.add_argument("--flashinfer-wheel")
    p.add_argument("--flashinfer-tree")
    p.add_argument("--kernel-cache")
    p.add_argument("--sglang-wheel")
    p.add_argument("--sglang-tree")
    p.add_argument("--sglang-jit", help="SGLang JIT modules ahead of time (python3 -m tools.jit_cache build-sglang --out)")
    p.add_argument("--mooncake-wheel")
    p.add_argument("--gate-manifest", action="append", default=[])
    p.add_argument("--push", action="store_true")
    p.add_argument("--repository")
    p.add_argument("--smoke", action="store_true", help="run python3 -m tools.image.smoke --profile kimi-k3")
    args = p.parse_args(argv)
    if not args.base_tar and not args.base_layout:
        raise UserError("--base-tar/--base-layout: give the base (tools/image/rootfs.py debian or pull)")
    layer_tar.source_date_epoch()
    args.work.mkdir(parents=True, exist_ok=True)
    sbom_file = args.work / "sbom.spdx.json"
    sbom.main(["--lock", str(args.lock), "--stack", args.stack, "--out", str(sbom_file),
               *[x for m in args.gate_manifest for x in ("--gate-manifest", m)]])
    image_args = ["--out", str(args.work / "layout"), "--stack", args.stack, "--lock", str(args.lock),
                  "--sbom", str(sbom_file), "--entrypoint", ENTRYPOINT_IMAGE_PATH]
    if args.base_layout:
        image_args += ["--base-layout", str(args.base_layout)]
    rows = []
    for name, sources in layer_plan(args, sbom_file):
        blob, desc = args.work / "layers" / f"{name}.tar.zst", args.work / "layers" / f"{name}.json"
        started = time.monotonic()
        oci_layer.main(["--name", name, "--out", str(blob), "--descriptor", str(desc), *sources])
        seconds = time.monotonic() - started
        d = json.loads(desc.read_text())
        rows.append((name, d["tar_size"], d["size"], seconds))
        image_args += ["--layer", str(desc), str(blob)]
    started = time.monotonic()
    oci_image.main(image_args)
    rows.append(("(layout)", 0, 0, time.monotonic() - started))
    print(f"{'layer':<14}{'tar MiB':>10}{'blob MiB':>10}{'seconds':>9}")
    for name, tar_size, size, seconds in rows:
        print(f"{name:<14}{tar_size / 2**20:>10.1f}{size / 2**20:>10.1f}{seconds:>9.1f}")
    if args.push:
        started = time.monotonic()
        oci_push.main(["--layout", str(args.work / "layout"), *(["--repository", args.repository] if args.repository else [])])
        print(f"push: {time.monotonic() - started:.1f} s")
    if args.smoke:
        from tools.image import smoke as image_smoke
        started = time.monotonic()
        rc = image_smoke.main(["--layout", str(args.work / "layout"), "--profile", "kimi-k3",
                               "--workdir", str(args.work), *[x for m in args.gate_manifest for x in ("--manifest", m)]])
        print(f"smoke: {time.monotonic() - started:.1f} s (exit {rc})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
