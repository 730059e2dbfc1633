"""Benchmark of the SM120 kernel cache build (not a test): cold lean, cold full, warm rebuild.

    python3 -m tools.bench.kernel_cache --flashinfer-tree T --modules kernel_cache/modules.json \
        --arch 12.0f -j 2 --work /tmp/kc-bench [--only silu_and_mul] [--dry-run]
    python3 -m tools.bench.kernel_cache --bazel [--output-root DIR] [-- BAZEL_FLAGS...]

--bazel times the Bazel target instead: `tools/bazel build //kernel_cache:sm120_cache` (cold when
the output root is fresh), the same again (warm), `--//kernel_cache:variant=lean` after it (lean
and full share every CUDA object's action, so only the 6 host objects and the links run), and full
again; each row counts the actions Bazel ran ("N local").

Each cold build gets its own empty object cache (lean and full share every CUDA object, so a
shared cache would make the second one warm). The warm row rebuilds the last variant from its
filled cache. Peak RSS is the largest process of the build (compilers included), from wait4.
The full module list takes hours on 2 cores (one SM120 grouped-GEMM object alone takes minutes and
several GB; docs/measurements/): run it on a big host, or use --only / --dry-run here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tools.kernel_cache.actions import CACHE_JSON_NAME
from tools.kernel_cache.modules import VARIANTS
from tools.kernel_cache.plan import make_plan
from tools.kernel_cache.toolchain import load_toolchain
from tools.kernel_cache.tree import AOT_SUBDIR, REPO_ROOT
from tools.common.errors import UserError, run_cli


def timed_build(args: argparse.Namespace, variant: str, cache_dir: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tools.kernel_cache", "build",
           "--flashinfer-tree", str(args.flashinfer_tree), "--modules", str(args.modules),
           "--arch", args.arch, "--variant", variant, "-j", str(args.jobs),
           "--mem-budget-mb", str(args.mem_budget_mb), "--cache-dir", str(cache_dir),
           "--out", str(out)]
    if args.cuda_home:
        cmd += ["--cuda-home", args.cuda_home]
    if args.userland:
        cmd += ["--userland", args.userland]
    for m in args.only:
        cmd += ["--only", m]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise UserError(f"build {variant} failed (exit {os.waitstatus_to_exitcode(status)}); "
                        "see output above")
    data = json.loads((out / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    size = sum((out / AOT_SUBDIR / m["path"]).stat().st_size for m in data["modules"].values())
    return {"secs": secs, "peak_rss_mb": usage.ru_maxrss / 1024, "so_mb": size / 2**20,
            "objects": sum(m["objects"] for m in data["modules"].values())}


_BAZEL_RUNS = (("first", ()), ("again (warm)", ()),
               ("lean after full", ("--//kernel_cache:variant=lean",)), ("full again", ()))
_PROCESSES = re.compile(r"INFO: (\d+) process(?:es)?: (.*)")


def actions_run(log: str) -> int:
    """Actions Bazel executed (not cache hits), from its 'INFO: N processes: ...' summary."""
    m = None
    for m in _PROCESSES.finditer(log):
        pass
    if m is None:
        return 0
    kinds = dict((k.strip(), int(n)) for n, k in re.findall(r"(\d+) ([\w-]+)", m.group(2)))
    return sum(n for k, n in kinds.items() if k != "internal")


def bazel_bench(output_root: Path | None, flags: Sequence[str]) -> int:
    env = dict(os.environ)
    if output_root is not None:
        env["KIMI_K3_BAZEL_OUTPUT_ROOT"] = str(output_root.absolute())
    rows = []
    for name, extra in _BAZEL_RUNS:
        cmd = [str(REPO_ROOT / "tools" / "bazel"), "build", "//kernel_cache:sm120_cache",
               *flags, *extra]
        print(f"bench: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
        secs = time.monotonic() - t0
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode != 0:
            raise UserError(f"bench {name}: `{' '.join(cmd)}` failed (exit {proc.returncode}); "
                            "see its output above")
        rows.append((name, actions_run(proc.stderr), secs))
    print(f"{'run':<16} {'actions run':>12} {'seconds':>9}")
    for name, n, secs in rows:
        print(f"{name:<16} {n:>12} {secs:>9.1f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--bazel" in argv:
        flags = argv[argv.index("--") + 1:] if "--" in argv else []
        own = argv[:argv.index("--")] if "--" in argv else argv
        bp = argparse.ArgumentParser(description="Bazel mode")
        bp.add_argument("--bazel", action="store_true")
        bp.add_argument("--output-root", type=Path, help="KIMI_K3_BAZEL_OUTPUT_ROOT for tools/bazel")
        a = bp.parse_args(own)
        return bazel_bench(a.output_root, flags)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashinfer-tree", type=Path, required=True)
    ap.add_argument("--modules", type=Path, default=REPO_ROOT / "kernel_cache" / "modules.json")
    ap.add_argument("--arch", default="12.0f")
    ap.add_argument("--cuda-home")
    ap.add_argument("--userland", help="the compiler userland (see tools/kernel_cache/toolchain.py)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--mem-budget-mb", type=int, default=16000)
    ap.add_argument("--work", type=Path, required=True, help="scratch parent: the run works in a new folder under it, removed afterwards")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--dry-run", action="store_true", help="object counts only, no compiling")
    args = ap.parse_args(argv)

    tc = load_toolchain(args.cuda_home, args.userland)
    print(f"toolchain: nvcc {tc.nvcc_version_text} at {tc.cuda_home}; arch {args.arch}; "
          f"-j {args.jobs}", file=sys.stderr)
    rows: list[tuple[str, dict]] = []
    # A new folder of its own under --work, removed afterwards: nothing of the user's is wiped.
    args.work.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="kernel-cache-bench-", dir=args.work))
    try:
        for variant in VARIANTS:
            plan = make_plan(args.flashinfer_tree, args.modules, args.arch, variant, tc)
            mods = [m for m in plan["modules"] if not args.only or m["name"] in args.only]
            counts = {m["name"]: len(m["objects"]) for m in mods}
            print(f"{variant}: {sum(counts.values())} objects {counts}", file=sys.stderr)
            if args.dry_run:
                rows.append((f"plan {variant}", {"objects": sum(counts.values())}))
                continue
            rows.append((f"cold {variant}", timed_build(args, variant, run / f"cache-{variant}",
                                                        run / f"out-{variant}")))
        if not args.dry_run:
            last = VARIANTS[-1]
            rows.append((f"warm {last}", timed_build(args, last, run / f"cache-{last}",
                                                     run / f"out-{last}-warm")))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    print(f"{'run':<12} {'objects':>8} {'seconds':>9} {'peak RSS MB':>12} {'.so MB':>8}")
    for name, r in rows:
        print(f"{name:<12} {r['objects']:>8} {r.get('secs', float('nan')):>9.1f} "
              f"{r.get('peak_rss_mb', float('nan')):>12.0f} {r.get('so_mb', float('nan')):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
