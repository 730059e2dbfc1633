"""Smoke-test an OCI image layout without a container runtime.

Usage:
    python3 -m tools.image.smoke --layout DIR [--profile kimi-k3] [--import MOD]... \
        [--manifest GATE_MANIFEST.json]... [--require IMAGE_PATH]... [--forbid IMAGE_PATH]... \
        [--env K=V]... [--workdir DIR] [--keep-rootfs] [--driver-stub] [--launch-profile NAME]... \
        [--launch-profiles-dir DIR] [--kernel-cache-plan PLAN.bzl]

1. `umoci unpack` applies the layers (whiteouts, links, owners) into a rootfs, as a runtime would.
2. Every file a patch gate manifest lists (changed_files[].path relative to site-packages,
   sha256_after; `files` also accepted)
   must have that hash in the rootfs: the image ships the patched bytes, not upstream's.
3. --require / --forbid paths must exist / be absent (e.g. the SM120 kernel cache must exist;
   an official flashinfer_jit_cache must not, since FlashInfer would load its unpatched kernels).
4. In a chroot of the rootfs (own mount namespace, /proc mounted), `/usr/bin/python3` imports
   each module with only the image's environment plus --env.

5. Launch profiles (--launch-profile NAME, or every profile the image ships with --profile
   kimi-k3): tools/image/launch_profile_check.py runs tools/image/profile_probe.py in the chroot, without
   network: the image's entrypoint resolves the profile and its guard must accept it, the
   image's SGLang parses and resolves it (no GPU, no checkpoint: the steps it skips are listed),
   and every FlashInfer module and feature its backends need must be in the image. One line per
   profile; a failure names the profile and the argument. --launch-profiles-dir checks other
   profile files against the image (default: the ones it ships); --kernel-cache-plan takes the
   module list from a plan for an image assembled without its kernel-cache layer.

--profile kimi-k3 = imports flashinfer, sglang, mooncake.engine; FLASHINFER_DISABLE_JIT=1; requires
flashinfer/data/aot in site-packages; forbids flashinfer_jit_cache; checks every shipped launch
profile and Triton's first launch (check_triton_driver: its driver module from the image's
Triton cache, no build). Needs root (chroot).

--driver-stub: on hosts without the NVIDIA driver (build machines), mooncake.engine cannot load
libcuda.so.1, which the container runtime injects on GPU hosts. This builds a stand-in
libcuda.so.1 defining the driver symbols (cu*) that the image's libraries needing it import
(they fail with CUDA_ERROR_NO_DEVICE) and puts it on LD_LIBRARY_PATH in the unpacked copy only,
never in the image, so the imports are checked anyway; the report says so.

The jobs live one per module: image_rootfs (the root unpacked or mounted, image paths in it),
image_chroot (running in it), driver_stub (the stand-in libcuda.so.1), launch_profile_check and
triton_driver_check (the checks run in it); smoke.py keeps the patched files' check, the smoke
test and its CLI.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_file
from tools.image.driver_stub import driver_symbols, with_library_path, write_driver_stub
from tools.image.image_caches import SGLANG_JIT_IMAGE_PATH, SGLANG_JIT_MANIFEST
from tools.image.image_chroot import run_imports
from tools.image.image_rootfs import image_env, inside, unpack
from tools.image.launch_profile_check import check_launch_profiles
from tools.image.triton_driver_check import check_triton_driver
from tools.image.wheel_install import SITE_PACKAGES

# launch_profiles: "*" = every launch profile the image ships.
PROFILES: dict[str, dict[str, list[str]]] = {
    "kimi-k3": {
        "imports": ["flashinfer", "sglang", "mooncake.engine"],
        "env": ["FLASHINFER_DISABLE_JIT=1"],
        "require": [f"/{SITE_PACKAGES}/flashinfer/data/aot",
                    f"{SGLANG_JIT_IMAGE_PATH}/{SGLANG_JIT_MANIFEST}"],
        "forbid": [f"/{SITE_PACKAGES}/flashinfer_jit_cache"],
        "launch_profiles": ["*"],
        "triton_driver": True,
    },
}


@dataclass
class SmokeReport:
    failures: list[str] = field(default_factory=list)
    passes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        (self.passes if ok else self.failures).append(what)


def check_manifest(rootfs: Path, manifest_path: Path, report: SmokeReport) -> None:
    """Patched files must carry the gate's sha256_after (null = the patch deleted the file)."""
    try:
        data = json.loads(manifest_path.read_text())
        # tools/patch_gate writes `changed_files`; `files` is accepted for hand-made manifests.
        files = data["changed_files"] if "changed_files" in data else data["files"]
        entries = [(str(f["path"]), f.get("sha256_after")) for f in files]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--manifest {manifest_path}: not a patch gate manifest with changed_files[].path/sha256_after "
                        f"({e}); pass the gate's manifest.json") from e
    for rel, expected in entries:
        host = inside(rootfs, f"/{SITE_PACKAGES}/{rel}")
        if expected is None:
            report.check(not host.exists() and not host.is_symlink(), f"{rel} deleted by the patch")
            continue
        actual = sha256_file(host) if host.is_file() and not host.is_symlink() else "missing"
        report.check(actual == expected, f"{rel} sha256 {actual[:12]} == gate {str(expected)[:12]}")


def smoke(layout: Path, workdir: Path, imports: Sequence[str], manifests: Sequence[Path], require: Sequence[str],
          forbid: Sequence[str], extra_env: Sequence[str], keep: bool = False,
          driver_stub: bool = False, launch_profiles: Sequence[str] = (),
          launch_profiles_dir: Path | None = None, kernel_cache_plan: Path | None = None,
          inventory: Path | None = None, triton_calls: Path | None = None,
          triton_driver: bool = False) -> SmokeReport:
    report = SmokeReport()
    bundle = Path(tempfile.mkdtemp(prefix="smoke.", dir=workdir)) / "bundle"
    try:
        rootfs = unpack(layout, bundle)
        for m in manifests:
            check_manifest(rootfs, m, report)
        for path in require:
            p = inside(rootfs, path)
            report.check(p.exists() and (not p.is_dir() or any(p.iterdir())), f"{path} present")
        for path in forbid:
            p = inside(rootfs, path)
            report.check(not p.exists() and not p.is_symlink(), f"{path} absent")
        if imports:
            env = [*image_env(layout), *extra_env]
            note = ""
            if driver_stub:
                symbols = driver_symbols(rootfs)
                env = with_library_path(env, write_driver_stub(rootfs, symbols))
                note = f" (with a stand-in libcuda.so.1 of {len(symbols)} driver symbols)"
            for r in run_imports(rootfs, imports, env):
                detail = str(r["detail"])
                if not r["ok"] and "libcuda.so.1" in detail and not driver_stub:
                    detail += (" (no NVIDIA driver here; GPU hosts get it from the container runtime;"
                               " --driver-stub checks the import with a stand-in)")
                report.check(bool(r["ok"]), f"import {r['module']}: {detail}{note if r['ok'] else ''}")
        if launch_profiles or launch_profiles_dir:
            for verdict in check_launch_profiles(rootfs, [*image_env(layout), *extra_env], launch_profiles,
                                                 launch_profiles_dir, kernel_cache_plan, inventory=inventory,
                                                 triton_calls=triton_calls):
                report.check(verdict.ok, verdict.line)
                report.notes += [f"{verdict.profile}: {d}" for d in verdict.details]
        if triton_driver:
            report.check(*check_triton_driver(rootfs, [*image_env(layout), *extra_env]))
    finally:
        if keep:
            print(f"rootfs kept at {bundle / 'rootfs'}", file=sys.stderr)
        else:
            shutil.rmtree(bundle.parent, ignore_errors=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", required=True, type=Path)
    p.add_argument("--profile", choices=sorted(PROFILES))
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--manifest", action="append", default=[], type=Path, help="patch gate manifest.json")
    p.add_argument("--require", action="append", default=[], help="image path that must exist")
    p.add_argument("--forbid", action="append", default=[], help="image path that must not exist")
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--keep-rootfs", action="store_true")
    p.add_argument("--driver-stub", action="store_true",
                   help="hosts without the NVIDIA driver: a stand-in libcuda.so.1 for the imports")
    p.add_argument("--launch-profile", action="append", default=[], metavar="NAME",
                   help="check this launch profile against the image (--profile kimi-k3: all it ships)")
    p.add_argument("--launch-profiles-dir", type=Path,
                   help="check these profile files (e.g. image/profiles) instead of the image's own")
    p.add_argument("--kernel-cache-plan", type=Path,
                   help="the image has no kernel-cache layer: take its modules from this plan")
    p.add_argument("--inventory", type=Path,
                   help="the image's stack's jit_cache/inventory.<stack>.json: its prebuilt sites must be in the image")
    p.add_argument("--triton-calls", type=Path,
                   help="jit_cache/triton_calls.json, which the image's Triton layer is built from (its prebuilt Triton sites)")
    args = p.parse_args(argv)
    prof = PROFILES.get(args.profile or "", {})
    for e in args.env:
        if "=" not in e:
            raise UserError(f"--env {e!r}: expected K=V")
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = smoke(args.layout, args.workdir, [*prof.get("imports", []), *args.imports], args.manifest,
                   [*prof.get("require", []), *args.require], [*prof.get("forbid", []), *args.forbid],
                   [*prof.get("env", []), *args.env], args.keep_rootfs, args.driver_stub,
                   [*prof.get("launch_profiles", []), *args.launch_profile], args.launch_profiles_dir,
                   args.kernel_cache_plan, args.inventory, args.triton_calls, prof.get("triton_driver", False))
    for line in report.passes:
        print(f"ok   {line}")
    for line in report.notes:
        print(f"     {line}")
    for line in report.failures:
        print(f"FAIL {line}")
    print(f"{len(report.passes)} passed, {len(report.failures)} failed")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
