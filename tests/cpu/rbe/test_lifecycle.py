"""tools/rbe up/down with bad input: one line (exit 2), nothing started, nothing written.

Runs the CLI as a user does, with the cache root in tmp_path: every check here comes before
the root is provisioned, so no cluster (and no root privilege) is needed.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]


def rbe(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KIMI_K3_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "tools.rbe", *args], cwd=REPO_ROOT, env=env, text=True,
                          capture_output=True, timeout=60)


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on 127.0.0.1 that something listens on."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def our_processes(tmp_path: Path) -> list[str]:
    """Processes whose command line names this test's cache root (a cluster it might have started)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(tmp_path) in cmd:
                found.append(cmd)
    return found


def assert_one_line_nothing_left(res: subprocess.CompletedProcess[str], tmp_path: Path, *words: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert our_processes(tmp_path) == []
    assert not (tmp_path / "cache" / "rbe").exists()


def test_port_in_use(tmp_path: Path, listener: int) -> None:
    res = rbe(tmp_path, "up", "--workers", "1", "--port", str(listener))
    assert_one_line_nothing_left(res, tmp_path, f"127.0.0.1:{listener} is in use", "--port")


@pytest.mark.parametrize("args, words", [
    (["--instance", "a b"], ["--instance 'a b'"]),
    (["--instance", "main/blobs"], ["reserved"]),
    (["--workers", "0"], ["--workers 0"]),
    (["--workers", "65"], ["--workers 65"]),
    (["--port", "70000"], ["--port 70000"]),
], ids=["instance-blank", "instance-reserved", "no-workers", "too-many-workers", "port-range"])
def test_bad_input(tmp_path: Path, args: list[str], words: list[str]) -> None:
    assert_one_line_nothing_left(rbe(tmp_path, "up", *args), tmp_path, *words)


def test_down_and_status_without_a_cluster(tmp_path: Path) -> None:
    res = rbe(tmp_path, "down")
    assert res.returncode == 0 and res.stderr.strip() == "rbe: no cluster is up"
    res = rbe(tmp_path, "status")
    assert res.returncode == 1 and res.stderr.strip() == "rbe: no cluster is up"
    assert not (tmp_path / "cache" / "rbe").exists()


def test_a_dead_clusters_state_file_is_not_a_cluster(tmp_path: Path, listener: int) -> None:
    """A state file left by a killed run (its pid gone) is not `already up`: up goes on to the
    next check (here the port)."""
    run = tmp_path / "cache" / "rbe" / "cluster" / "run"
    run.mkdir(parents=True)
    (run / "cluster.json").write_text('{"pid": 999999999, "port": 1, "instance": "main", "workers": 1}\n')
    res = rbe(tmp_path, "up", "--workers", "1", "--port", str(listener))
    assert res.returncode == 2 and "is in use" in res.stderr
    assert (run / "cluster.json").exists()  # not its to delete: up never got that far


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
