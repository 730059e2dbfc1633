"""Hermetic by enforcement (tag cpu): an action of this build runs in linux-sandbox.

probe.sh runs inside this test's own action (the strategy that runs any build action runs it)
and writes what it saw. A declared
input is readable, an undeclared file beside it is not, the source tree is read-only, /tmp is the
action's own, and / is the sealed root with the host's root nowhere. Under processwrapper-sandbox
(no namespaces) the source tree is writable and /tmp is the host's; chrooted without pivot_root
Bazel falls back to it.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def probe() -> dict[str, str]:
    """Once, before any test writes to /tmp (pytest's tmp_path does)."""
    out = Path(os.environ["TEST_TMPDIR"]) / "probe.txt"
    subprocess.run(["bash", os.environ["KIMI_SANDBOX_PROBE"], os.environ["KIMI_SANDBOX_DECLARED"], str(out)],
                   check=True, timeout=60)
    return dict(line.split("=", 1) for line in out.read_text().splitlines())


def test_an_action_reads_its_declared_input() -> None:
    assert probe()["declared_readable"] == "yes"


def test_an_action_cannot_read_an_undeclared_file() -> None:
    seen = probe()
    assert seen["execroot_found"] == "yes"
    assert seen["undeclared_readable"] == "no"


def test_an_action_cannot_write_to_the_source_tree() -> None:
    assert probe()["source_tree_writable"] == "no"


def test_an_action_has_a_tmp_of_its_own() -> None:
    assert probe()["tmp_own"] == "yes"


def test_an_action_runs_in_the_sealed_root_without_the_host_root() -> None:
    seen = probe()
    if seen["root_is_sealed_root"] == "no":
        pytest.skip("Bazel runs outside the launcher's sealed root here (a host Bazel 7)")
    assert seen["host_root_mounted"] == "no"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
