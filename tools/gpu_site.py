"""Lay out the stack's wheels and the prebuilt kernel cache as one importable site directory.

GPU tests run against exactly what the image ships: the patched FlashInfer wheel (its
`+kimik3` version), the kernel cache built for the GPU's arch placed where FlashInfer looks for
AOT modules (`flashinfer/data/aot/<module>/<module>.so`), and Mooncake. Used by
tests/gpu/conftest.py under Bazel and by tools/run_gpu_suite.py on hosts without Bazel.

Wheels are unpacked (a wheel is a zip whose purelib/platlib root is the site root), not
installed with pip: nothing here may reach a network or resolve dependencies; the host's own
torch is used.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

from tools.errors import UserError, run_cli

AOT = Path("flashinfer") / "data" / "aot"


def _wheels_in(paths: Iterable[Path]) -> list[Path]:
    """Expand directories (e.g. a Bazel tree artifact holding one wheel) into their wheels."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(p.glob("*.whl")))
        elif p.suffix == ".whl" and p.is_file():
            out.append(p)
        else:
            raise UserError(f"{p}: not a wheel or a directory of wheels; pass the wheel files to lay out")
    return out


def _unpack_wheel(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.startswith("/") or ".." in Path(name).parts:
                raise UserError(f"{wheel.name}: member {name!r} escapes the site directory; refusing the wheel")
            # .data/{purelib,platlib}/ go to the site root; scripts/headers are not needed here.
            parts = Path(name).parts
            if parts and parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = str(Path(*parts[2:]))
            target = site / name
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode | 0o600)


def install_kernel_cache(cache: Path, site: Path) -> list[str]:
    """Copy a kernel cache (a directory holding flashinfer/data/aot) into the site's flashinfer."""
    src = cache / AOT
    if not src.is_dir():
        raise UserError(f"{cache}: no {AOT} inside; pass the output of //kernel_cache (or kernel_cache.py build --out)")
    if not (site / "flashinfer").is_dir():
        raise UserError(f"{site}: no flashinfer package to put the kernel cache into; pass the FlashInfer wheel too")
    dst = site / AOT
    shutil.copytree(src, dst, dirs_exist_ok=True)
    meta = dst / "kernel_cache.json"
    return sorted(json.loads(meta.read_text()).get("modules", {})) if meta.is_file() else []


def prepare(site: Path, wheels: Sequence[Path], kernel_cache: Path | None) -> list[str]:
    """Unpack `wheels` into `site` and install `kernel_cache`; return the cached module names."""
    site.mkdir(parents=True, exist_ok=True)
    for wheel in _wheels_in(wheels):
        _unpack_wheel(wheel, site)
    return install_kernel_cache(kernel_cache, site) if kernel_cache else []


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, required=True)
    ap.add_argument("--wheel", type=Path, action="append", default=[])
    ap.add_argument("--kernel-cache", type=Path)
    args = ap.parse_args(argv)
    modules = prepare(args.site, args.wheel, args.kernel_cache)
    print(f"site {args.site}: {len(args.wheel)} wheel inputs, kernel cache modules: {', '.join(modules) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
