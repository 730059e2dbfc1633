"""What every benchmark here does: name the machine, clone HEAD, run a command to a log, stop a
clone's Bazel server."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]


def machine() -> str:
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    mem_kb = 0
    try:
        mem_kb = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                          if ln.startswith("MemTotal")))
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({cpu or platform.processor()}), {mem_kb / 2**20:.0f} GiB, {platform.platform()}"


def clone(dest: Path) -> None:
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(dest)], check=True)


def run(cmd: Sequence[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[int, float, str]:
    """Run cmd, its output to log and to this terminal's stderr; (rc, seconds, output)."""
    print(f"[bench] {cwd.name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            sys.stderr.write(line)
        rc = proc.wait()
    return rc, time.monotonic() - start, log.read_text(errors="replace")


def run_together(jobs: Sequence[tuple[Sequence[str], Path, dict[str, str], Path]]) -> list[tuple[int, float, str]]:
    """Start every (cmd, cwd, env, log) at once, each to its own log; wait for all. Per job: (rc,
    seconds from the common start to its end, output)."""
    start = time.monotonic()
    procs = []
    for cmd, cwd, env, log in jobs:
        print(f"[bench] {cwd.name}: {' '.join(cmd)} (together, log {log})", file=sys.stderr, flush=True)
        out = open(log, "w")
        procs.append((subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    ends: dict[int, float] = {}
    while len(ends) < len(procs):
        for i, (proc, _) in enumerate(procs):
            if i not in ends and proc.poll() is not None:
                ends[i] = time.monotonic() - start
        time.sleep(0.2)
    results = []
    for i, ((proc, out), (_, _, _, log)) in enumerate(zip(procs, jobs)):
        out.close()
        results.append((proc.returncode, ends[i], log.read_text(errors="replace")))
    return results


def shutdown(clone_dir: Path, env: dict[str, str]) -> None:
    subprocess.run(["tools/bazel", "shutdown"], cwd=clone_dir, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
