"""tools/pins/private/fetch.bzl (used by pins.bzl): every pin repository re-runs when a Python file its fetch command
imports changes. The rule watches whole tool packages (no hand-kept file list); this checks that
those packages cover every module `python3 -m tools.fetch` loads, so a new import of another
package cannot go unwatched."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
PINS_BZL = REPO_ROOT / "tools" / "pins" / "private" / "fetch.bzl"


def watched() -> tuple[list[Path], list[Path]]:
    """(directories, files) the repository rule watches: a label of a package's BUILD.bazel
    stands for that package's directory (all of its .py files), any other label for its file."""
    dirs: list[Path] = []
    files: list[Path] = []
    for package, name in re.findall(r'"//([A-Za-z0-9_/]*):([A-Za-z0-9_.]+)"', PINS_BZL.read_text()):
        if name == "MODULE.bazel" or not package.startswith("tools"):
            continue
        (dirs if name == "BUILD.bazel" else files).append(REPO_ROOT / package / name)
    return [d.parent for d in dirs], files


def fetch_modules() -> list[Path]:
    """The files of every `tools` module the fetch CLI imports (as the repository rule runs it)."""
    code = ("import json, sys, runpy; sys.argv = ['fetch', '--help']\n"
            "try:\n    runpy.run_module('tools.fetch', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m.__file__ for n, m in list(sys.modules.items())"
            " if n.split('.')[0] == 'tools' and getattr(m, '__file__', None))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr
    return [Path(p).absolute() for p in json.loads(proc.stdout.splitlines()[-1])]


def test_pin_repositories_watch_every_module_fetch_imports() -> None:
    dirs, files = watched()
    assert dirs, f"{PINS_BZL}: no watched tool packages found"
    modules = fetch_modules()
    assert any(m.name == "cli.py" for m in modules), modules  # the CLI really ran
    unwatched = [m for m in modules if m not in files and not any(m.is_relative_to(d) for d in dirs)]
    assert unwatched == [], f"fetch imports modules the pin repositories do not watch: {unwatched}"


def test_pin_repositories_keep_no_list_of_tool_files() -> None:
    # Watching packages, not files: a module added to a watched package needs no edit here.
    _, files = watched()
    assert [f.relative_to(REPO_ROOT).as_posix() for f in files] == ["tools/__init__.py"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
