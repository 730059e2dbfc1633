"""The SM120 kernel cache built cold locally and through the loopback REAPI cluster, timed.

    python3 -m tools.bench.rbe_kernel_cache [--workers 1,2] [--only sampling] [--config pypi]

For each mode (local, then the cluster with each worker count): `tools/bazel clean`, a fresh
cluster (its action cache is in memory, so every action runs again; the CAS keeps the inputs
uploaded before, as a team's cluster would), then `tools/bazel build --disk_cache=
--//kernel_cache:only=ONLY //kernel_cache:sm120_cache`, with --config=rbe for the cluster. Prints
one row per mode: wall, critical path, Bazel's processes by strategy, the nvcc actions run and the
wall per nvcc action, and whether the cache's bytes equal the local build's. Exits 1 when a
remote mode ran no action remotely, its bytes differ, or the cluster was left up.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_file
from tools.bench.rbe import REPO_ROOT, bazel, rbe_cli
from tools.rbe import cluster

TARGET = "//kernel_cache:sm120_cache"
OUTPUT = REPO_ROOT / "bazel-bin" / "kernel_cache" / "sm120_cache_aot"  # what the image ships


def rbe(*args: str) -> None:
    proc = rbe_cli(*args)
    if proc.returncode != 0:
        raise UserError(f"tools.rbe {' '.join(args)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and bytes (a symlink by its target)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            h.update(f"{p.relative_to(root)} -> {os.readlink(p)}\n".encode())
        elif p.is_file():
            h.update(f"{p.relative_to(root)}\n".encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def summary(out: str) -> tuple[float, float, str, int]:
    """(wall s, critical path s, 'N processes' summary, nvcc actions) of one build's output."""
    wall = re.search(r"Elapsed time: ([0-9.]+)s", out)
    crit = re.search(r"Critical Path: ([0-9.]+)s", out)
    procs = re.search(r"INFO: \d+ processes?: (.*)\.", out)
    # An object's action prints "[kernel_cache] MODULE: OBJECT done in" (local or remote).
    objects = set(re.findall(r"\[kernel_cache\] (\S+): (\S+) done in", out))
    return (float(wall.group(1)) if wall else float("nan"), float(crit.group(1)) if crit else float("nan"),
            procs.group(1) if procs else "?", len(objects))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.bench.rbe_kernel_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    ap.add_argument("--only", default="sampling", help="--//kernel_cache:only (default sampling; '' = the whole "
                    "selection, hours on 2 cores)")
    ap.add_argument("--config", default="pypi", help="the stack's --config (default pypi)")
    args = ap.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",") if w]
    if cluster.running(cluster.layout()):
        raise UserError("a cluster is already up: stop it (`python3 -m tools.rbe down`); the bench starts its own")
    flags = [f"--config={args.config}", "--disk_cache=", f"--//kernel_cache:only={args.only}"]
    rows, ok, local_digest = [], True, None
    for workers in [0, *counts]:
        bazel("clean")
        mode = "local" if workers == 0 else f"{workers} worker{'s' if workers > 1 else ''}"
        if workers:
            rbe("up", "--workers", str(workers))
        try:
            t0 = time.monotonic()
            out = bazel("build", *flags, *(["--config=rbe"] if workers else []), TARGET)
            wall_s = time.monotonic() - t0
        finally:
            if workers:
                rbe("down")
        _, crit, procs, objects = summary(out)
        digest = tree_digest(OUTPUT)
        local_digest = local_digest or digest
        same = digest == local_digest
        ok &= same and (workers == 0 or re.search(r"\d+ remote(?! cache)", procs) is not None)
        print(f"{mode}: {procs} ({wall_s:.1f} s)", file=sys.stderr)
        rows.append((mode, f"{wall_s:.1f}", f"{crit:.1f}", procs, str(objects),
                     f"{wall_s / objects:.1f}" if objects else "-", "yes" if same else "NO"))
    ok &= cluster.running(cluster.layout()) is None
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, text=True, capture_output=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d')}, commit {head}, {platform.node()}: {os.cpu_count()} cores; "
          f"`python3 -m tools.bench.rbe_kernel_cache --workers {args.workers} --only '{args.only}' "
          f"--config {args.config}`\n")
    print("| mode | wall s | critical path s | processes | nvcc actions | wall per nvcc action s | bytes = local |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
