"""Lay out the stack's wheels and the prebuilt kernel cache as one importable site directory.

GPU tests run against exactly what the image ships: the patched FlashInfer wheel (its
`+kimik3` version), the kernel cache built for the GPU's arch placed where FlashInfer looks for
AOT modules (`flashinfer/data/aot/<module>/<module>.so`), and Mooncake. Used by
tests/gpu/conftest.py under Bazel and by tools/gpu_suite/run.py on hosts without Bazel.

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
from typing import Any, Iterable, Mapping, Sequence

from tools.common.errors import UserError, run_cli

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


def unpack_wheel(wheel: Path, site: Path) -> None:
    """Unpack one wheel into site (its purelib/platlib root is the site root)."""
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
        unpack_wheel(wheel, site)
    return install_kernel_cache(kernel_cache, site) if kernel_cache else []


# --------------------------------------------------------------------------------------------
# Which FlashInfer modules the cache under test must have (tests/gpu/conftest.py policy)
# --------------------------------------------------------------------------------------------

MODULES_JSON = Path(__file__).absolute().parents[2] / "kernel_cache" / "modules.json"


def declared_modules(modules_json: Path, arch: str) -> list[str]:
    """The modules kernel_cache/modules.json declares for `arch` (the cache's arch_list): what
    //kernel_cache builds for it and the image ships."""
    from tools.kernel_cache.modules import load_modules

    return sorted(d.name for d in load_modules(modules_json) if d.applies_to(arch))


def parse_only(text: str) -> list[str]:
    """The --//kernel_cache:only subset a cache was built with ('' = every declared module)."""
    return sorted({n.strip() for n in text.replace("\n", ",").split(",") if n.strip()})


def module_verdict(module: str, meta: Mapping[str, Any] | None, modules_json: Path,
                   only: Sequence[str] = ()) -> tuple[str, str]:
    """("run" | "skip" | "fail", reason) for a GPU test that needs FlashInfer `module` from the
    prebuilt cache (JIT disabled). `meta` is the installed cache's kernel_cache.json (None: no
    cache installed). The cache must hold every module modules.json declares for its arch
    (restricted to `only` when the cache was built as a subset): one it lacks is a failure.
    Skipped only where the module is not part of that cache at all (declared for other archs,
    e.g. fused_moe_90 against a 12.0f cache, or left out by `only`)."""
    if meta is None:
        return ("fail", f"FlashInfer module {module}: no kernel cache installed (no "
                f"{AOT}/kernel_cache.json in the flashinfer under test); pass the stack's cache "
                "(KIMI_GPU_KERNEL_CACHE, python3 -m tools.gpu_suite --kernel-cache) or allow JIT with "
                "KIMI_K3_GPU_ALLOW_JIT=1")
    arch = str(meta.get("arch_list", ""))
    have = meta.get("modules") or {}
    if module in have:
        return ("run", "")
    declared = declared_modules(modules_json, arch)
    if module not in declared:
        return ("skip", f"FlashInfer module {module} is not part of the {arch} kernel cache "
                f"({modules_json.name} declares for {arch}: {', '.join(declared) or 'none'})")
    if only and module not in only:
        return ("skip", f"FlashInfer module {module}: the cache was built with "
                f"--//kernel_cache:only={','.join(only)}, which leaves it out")
    return ("fail", f"FlashInfer module {module}: the {arch} kernel cache lacks it, but "
            f"{modules_json.name} declares it for {arch} (the image ships it; has: "
            f"{', '.join(sorted(have)) or 'none'}); rebuild the cache (`tools/bazel build "
            f"//kernel_cache:cache --//kernel_cache:arch={arch}`), or declare a subset build "
            "with KIMI_GPU_KERNEL_CACHE_ONLY / python3 -m tools.gpu_suite --only")


def runner_verdict(module: str, runner: str, meta: Mapping[str, Any] | None) -> tuple[str, str]:
    """("run" | "skip", reason) for a GPU test that needs CUTLASS MoE `runner` (as
    kernel_cache/selections.json spells it) of a module the cache holds. A cache built for a
    kernel selection records the runners it compiled (kernel_cache.json); one outside them
    raises RuntimeError by design, so the test is skipped naming the selection. A cache
    without a selection (`full`) has every runner."""
    sel = ((meta or {}).get("modules") or {}).get(module, {}).get("kernel_selection")
    if not sel or runner in sel.get("runners", []):
        return ("run", "")
    return ("skip", f"FlashInfer module {module}: {runner} is outside kernel selection "
            f"{sel.get('name')} of this {meta.get('arch_list')} cache (it compiles "
            f"{', '.join(sel.get('runners', [])) or 'no runner'}); build the cache with a selection "
            "that has it (kernel_cache/selections.json, e.g. --//kernel_cache:selection=full)")


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
