"""CI's remote-execution check, after the test command: a real action through the loopback REAPI
cluster (tools/rbe), then a remote cache hit, with the bytes of the local build.

The patch gate's manifest (//sglang_patches:sglang_manifest) is built locally first (a disk-cache
hit after the test command). Then its output is removed and it is built with --config=rbe and no
disk cache: the action runs on a worker ("N remote"); removed again, it comes from the cluster's
action cache ("N remote cache hit"). Both times the manifest must be the local build's bytes. The
cluster is stopped whatever happens. Prints one line, `remote smoke: ok ...` or what failed; exit
0 or 1.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

TARGET = "//sglang_patches:sglang_manifest"
OUTPUT = Path("bazel-bin/sglang_patches/sglang_gate/manifest.json")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(*flags: str) -> tuple[dict[str, int], str]:
    """Bazel's process counts by kind for one build of TARGET with FLAGS, and its output's sha256."""
    OUTPUT.unlink(missing_ok=True)  # Bazel wrote it; without it Bazel runs or fetches the action again
    proc = subprocess.run(["tools/bazel", "build", *flags, TARGET], capture_output=True, text=True)
    if proc.returncode != 0 or not OUTPUT.is_file():
        tail = [l for l in proc.stderr.splitlines() if l.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
        raise RuntimeError(f"tools/bazel build {' '.join(flags)} {TARGET} failed: "
                           f"{tail[0] if tail else f'no {OUTPUT}'}")
    return process_counts(proc.stderr), sha(OUTPUT)


def process_counts(bazel_output: str) -> dict[str, int]:
    """`INFO: 5 processes: 4 remote cache hit, 1 internal.` -> {"remote cache hit": 4, "internal": 1}."""
    line = next((l for l in bazel_output.splitlines() if re.match(r"INFO: \d+ process", l)), "")
    return {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z][a-z -]*?)(?:,|\.$)", line.split(": ", 2)[-1])}


def main() -> int:
    try:
        _, local = build()
    except RuntimeError as e:
        print(f"remote smoke: failed: the local build: {e}")
        return 1
    up = subprocess.run([sys.executable, "-m", "tools.rbe", "up", "--workers", "1"], capture_output=True, text=True)
    try:
        if up.returncode != 0:
            print(f"remote smoke: failed: {(up.stderr.strip().splitlines() or ['tools.rbe up failed'])[-1]}")
            return 1
        first, first_sha = build("--config=rbe", "--disk_cache=")
        second, second_sha = build("--config=rbe", "--disk_cache=")
    except RuntimeError as e:
        print(f"remote smoke: failed: {e}")
        return 1
    finally:
        down = subprocess.run([sys.executable, "-m", "tools.rbe", "down"], capture_output=True, text=True)
        if down.returncode != 0:
            print(f"remote smoke: `tools.rbe down` failed: {down.stderr.strip()}")
    problems = []
    if not first.get("remote"):
        problems.append(f"the first build ran no action remotely ({first})")
    if not second.get("remote cache hit"):
        problems.append(f"the second build had no remote cache hit ({second})")
    if {first_sha, second_sha} != {local}:
        problems.append(f"the remote manifest is not the local build's bytes ({first_sha[:12]}, {second_sha[:12]}, "
                        f"local {local[:12]})")
    if problems or down.returncode != 0:
        print("remote smoke: failed: " + "; ".join(problems or ["the cluster did not stop cleanly"]))
        return 1
    print(f"remote smoke: ok: {first['remote']} remote, then {second['remote cache hit']} remote cache hit, "
          f"the manifest identical to the local build ({local[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
