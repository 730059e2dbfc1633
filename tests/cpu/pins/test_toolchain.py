"""The test toolchain is the hashed venv on Python 3.11 with the CPU torch, not the host python3."""
from __future__ import annotations

import sys

import pytest


def test_python_is_the_locked_venv() -> None:
    assert sys.version_info[:2] == (3, 11), sys.version
    assert sys.prefix != sys.base_prefix, "tests must run in the locked venv, not a bare interpreter"


def test_torch_is_the_cpu_build() -> None:
    import torch
    assert torch.__version__ == "2.13.0+cpu", torch.__version__
    assert torch.version.cuda is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
