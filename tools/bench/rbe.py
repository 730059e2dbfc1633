"""The loopback REAPI cluster end to end, timed: start, remote actions, cache hits, memory, stop.

    python3 -m tools.bench.rbe [--workers 2] [--rounds 5]

Needs no cluster up (it starts and stops its own, `python3 -m tools.rbe`). Each round builds
//rbe:hello with `tools/bazel build --config=rbe` under a new `--action_env` value, so its one
action is new to every cache and runs on a worker ("1 remote"); then `tools/bazel clean` and the
same build again must be "1 remote cache hit". Bazel's disk cache is off for these builds
(`--disk_cache=`), or the second build would be a disk-cache hit. The time of an action is
Bazel's critical path (the build's one action). Prints a table; exits 1 when a build was not
remote (or not a remote cache hit), or when anything of the cluster is left after `down`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.rbe import cluster, config

REPO_ROOT = Path(__file__).absolute().parents[2]
TARGET = "//rbe:hello"


def rbe_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.rbe", *args], cwd=REPO_ROOT, text=True,
                          capture_output=True)


def bazel(*args: str) -> str:
    proc = subprocess.run([str(REPO_ROOT / "tools" / "bazel"), *args], cwd=REPO_ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise UserError(f"tools/bazel {' '.join(args)} failed (exit {proc.returncode}): "
                        f"{[l for l in proc.stdout.splitlines() if 'ERROR' in l][:1]}")
    return proc.stdout


def build(nonce: str) -> tuple[str, float]:
    """(the 'N processes: ...' summary, the critical path in seconds) of one remote build."""
    out = bazel("build", "--config=rbe", "--disk_cache=", f"--action_env=KIMI_K3_RBE_BENCH={nonce}", TARGET)
    summary = re.search(r"INFO: \d+ processes?: (.*)\.", out)
    crit = re.search(r"Critical Path: ([0-9.]+)s", out)
    return (summary.group(1) if summary else "?"), (float(crit.group(1)) if crit else float("nan"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.bench.rbe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if cluster.running(cluster.layout()):
        raise UserError("a cluster is already up: stop it (`python3 -m tools.rbe down`); the bench times its own start")
    ok = True
    t0 = time.monotonic()
    res = rbe_cli("up", "--workers", str(args.workers))
    if res.returncode != 0:
        raise UserError(f"tools.rbe up failed: {res.stderr.strip().splitlines()[-1:]}")
    status = json.loads(res.stdout)
    try:
        remote, hits = [], []
        for i in range(args.rounds):
            nonce = uuid.uuid4().hex
            summary, secs = build(nonce)
            if i == 0:
                first_action_s = time.monotonic() - t0
            ok &= "1 remote" in summary and "cache hit" not in summary
            remote.append(secs)
            print(f"round {i + 1}: {summary} ({secs:.2f} s)", file=sys.stderr)
            bazel("clean")
            summary, secs = build(nonce)
            ok &= "1 remote cache hit" in summary
            hits.append(secs)
            print(f"round {i + 1} after clean: {summary} ({secs:.2f} s)", file=sys.stderr)
        procs = cluster.processes(cluster.running(cluster.layout()).pid)
    finally:
        down = rbe_cli("down")
        bazel("shutdown")
    # Every process the cluster had, by pid and name: none may be left (the PID namespace ended).
    left = [p for p in procs if cluster.processes(p[0])[:1] and cluster.processes(p[0])[0][1] == p[1]]
    lay = cluster.layout()
    clean = (down.returncode == 0 and not cluster.listening(config.DEFAULT_PORT) and cluster.running(lay) is None
             and not left)
    ok &= clean

    def by(name: str) -> tuple[float, float]:
        sel = [p for p in procs if p[1] == name]
        return sum(p[2] for p in sel) / 1024, sum(p[3] for p in sel) / 1024

    timings = status["timings"]
    rows = [
        ("cluster start (`up`, root and venv present)", f"{status['start_s']:.2f} s"),
        ("  PostgreSQL answering / schema migrated / BuildGrid listening", f"{timings['postgres']:.2f} / {timings['migrate']:.2f} / {timings['bgd']:.2f} s"),
        (f"  all {args.workers} workers registered", f"{timings['workers']:.2f} s"),
        ("cold start to the first remote action done (up + Bazel build)", f"{first_action_s:.1f} s"),
        (f"remote action round trip (critical path, {args.rounds} runs): median / min / max",
         f"{statistics.median(remote):.2f} / {min(remote):.2f} / {max(remote):.2f} s"),
        (f"remote cache hit after clean ({args.rounds} runs): median / min / max",
         f"{statistics.median(hits):.2f} / {min(hits):.2f} / {max(hits):.2f} s"),
    ]
    for name, label in (("bgd", "BuildGrid (bgd)"), ("buildbox-casd", "buildbox-casd (all)"),
                        ("buildbox-worker", "buildbox-worker (all)"), ("postgres", "PostgreSQL (all processes)"),
                        ("python3.13", "supervisor (PID 1)")):
        rss, pss = by(name)
        rows.append((f"RSS / PSS: {label}", f"{rss:.0f} / {pss:.0f} MB"))
    rows.append(("RSS / PSS: whole cluster", f"{sum(p[2] for p in procs) / 1024:.0f} / {sum(p[3] for p in procs) / 1024:.0f} MB"))
    rows.append(("`down`: nothing listening on 127.0.0.1:%d, no namespace left" % config.DEFAULT_PORT, "yes" if clean else "NO"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, text=True, capture_output=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d')}, commit {head}, {platform.node()}: {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
          f"`python3 -m tools.bench.rbe --workers {args.workers} --rounds {args.rounds}`\n")
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
