"""The test toolchain is the hashed venv on Python 3.11 with the CPU torch, not the host python3."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def test_python_is_the_locked_venv() -> None:
    assert sys.version_info[:2] == (3, 11), sys.version
    assert sys.prefix != sys.base_prefix, "tests must run in the locked venv, not a bare interpreter"


def test_torch_is_the_cpu_build() -> None:
    torch = pytest.importorskip("torch")
    assert torch.__version__ == "2.13.0+cpu", torch.__version__
    assert torch.version.cuda is None


def test_stack_flag_values_match_the_lock() -> None:
    root = Path(__file__).resolve().parents[2]
    lock = json.loads((root / "third_party/pins.lock.json").read_text())
    build = (root / "third_party/BUILD.bazel").read_text()
    declared = build.split("STACKS = [", 1)[1].split("]", 1)[0]
    names = sorted(s.strip().strip('",') for s in declared.split() if s.strip().strip('",'))
    assert names == sorted(lock["stacks"]), "third_party/BUILD.bazel STACKS must list the lock's stacks"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
