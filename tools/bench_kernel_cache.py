"""Benchmark of the SM120 kernel cache build (not a test): cold lean, cold full, warm rebuild.

    python3 tools/bench_kernel_cache.py --flashinfer-tree T --modules kernel_cache/modules.json \
        --arch 12.0f -j 2 --work /tmp/kc-bench [--only silu_and_mul] [--dry-run]

Each cold build gets its own empty object cache (lean and full share every CUDA object, so a
shared cache would make the second one warm). The warm row rebuilds the last variant from its
filled cache. Peak RSS is the largest process of the build (compilers included), from wait4.
The full module list takes hours on 2 cores (one SM120 grouped-GEMM object: ~4 min, 8.6 GB):
run it on a big host, or use --only / --dry-run here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).absolute().parent.parent))

from tools import kernel_cache as kc
from tools.errors import UserError, run_cli


def timed_build(args: argparse.Namespace, variant: str, cache_dir: Path, out: Path) -> dict:
    cmd = [sys.executable, str(kc.REPO_ROOT / "tools" / "kernel_cache.py"), "build",
           "--flashinfer-tree", str(args.flashinfer_tree), "--modules", str(args.modules),
           "--arch", args.arch, "--variant", variant, "-j", str(args.jobs),
           "--mem-budget-mb", str(args.mem_budget_mb), "--cache-dir", str(cache_dir),
           "--out", str(out)]
    if args.cuda_home:
        cmd += ["--cuda-home", args.cuda_home]
    for m in args.only:
        cmd += ["--only", m]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise UserError(f"build {variant} failed (exit {os.waitstatus_to_exitcode(status)}); "
                        "see output above")
    data = json.loads((out / kc.AOT_SUBDIR / kc.CACHE_JSON_NAME).read_text())
    size = sum((out / kc.AOT_SUBDIR / m["path"]).stat().st_size for m in data["modules"].values())
    return {"secs": secs, "peak_rss_mb": usage.ru_maxrss / 1024, "so_mb": size / 2**20,
            "objects": sum(m["objects"] for m in data["modules"].values())}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashinfer-tree", type=Path, required=True)
    ap.add_argument("--modules", type=Path, default=kc.REPO_ROOT / "kernel_cache" / "modules.json")
    ap.add_argument("--arch", default="12.0f")
    ap.add_argument("--cuda-home")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--mem-budget-mb", type=int, default=16000)
    ap.add_argument("--work", type=Path, required=True, help="scratch dir (wiped)")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--dry-run", action="store_true", help="object counts only, no compiling")
    args = ap.parse_args(argv)

    tc = kc.load_toolchain(args.cuda_home, kc.default_extra_roots())
    print(f"toolchain: nvcc {tc.nvcc_version_text} at {tc.cuda_home}; arch {args.arch}; "
          f"-j {args.jobs}", file=sys.stderr)
    rows: list[tuple[str, dict]] = []
    for variant in kc.VARIANTS:
        plan = kc.make_plan(args.flashinfer_tree, args.modules, args.arch, variant, tc)
        mods = [m for m in plan["modules"] if not args.only or m["name"] in args.only]
        counts = {m["name"]: len(m["objects"]) for m in mods}
        print(f"{variant}: {sum(counts.values())} objects {counts}", file=sys.stderr)
        if args.dry_run:
            rows.append((f"plan {variant}", {"objects": sum(counts.values())}))
            continue
        cache = args.work / f"cache-{variant}"
        shutil.rmtree(cache, ignore_errors=True)
        rows.append((f"cold {variant}", timed_build(args, variant, cache, args.work / f"out-{variant}")))
    if not args.dry_run:
        last = kc.VARIANTS[-1]
        rows.append((f"warm {last}", timed_build(args, last, args.work / f"cache-{last}",
                                                 args.work / f"out-{last}-warm")))
    print(f"{'run':<12} {'objects':>8} {'seconds':>9} {'peak RSS MB':>12} {'.so MB':>8}")
    for name, r in rows:
        print(f"{name:<12} {r['objects']:>8} {r.get('secs', float('nan')):>9.1f} "
              f"{r.get('peak_rss_mb', float('nan')):>12.0f} {r.get('so_mb', float('nan')):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
