"""What the fetch stage's tests share: the CLI in-process, a lock of given pins, generated git
repositories with fixed identities and dates (the same commit ids on every run)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tools.fetch import cli as fetch

GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_AUTHOR_DATE="2026-01-01T00:00:00Z",
               GIT_COMMITTER_DATE="2026-01-01T00:00:00Z", GIT_CONFIG_NOSYSTEM="1")


def git(*args: str, cwd: Path | None = None, input: bytes | None = None) -> str:
    return subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *args], cwd=cwd,
                          env=GIT_ENV, check=True, capture_output=True, input=input).stdout.decode().strip()


def run_main(*argv: str) -> str:
    """fetch.main in-process; returns stdout's last line (the printed path or pin name)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fetch.main(list(argv)) == 0
    lines = out.getvalue().strip().splitlines()
    return lines[-1] if lines else ""


def write_lock(directory: Path, pins: dict[str, Any], stacks: dict[str, Any] | None = None) -> Path:
    """`directory`/pins.lock.json holding `pins` (and `stacks`)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pins.lock.json"
    path.write_text(json.dumps({"schema_version": 1, "pins": pins, "stacks": stacks or {}}, indent=2))
    return path


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, f"error message must be one line: {text!r}"
    return text


def cas_entries(cache: Path) -> list[Path]:
    """The content-addressed entries of a fetch cache."""
    cas = cache / "cas" / "sha256"
    return sorted(cas.iterdir()) if cas.exists() else []
