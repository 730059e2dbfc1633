"""`//kernel_cache:plan_check`: the checked-in plan equals what FlashInfer's generators emit for
the patch gate's real tree (with #4460), this nvcc and the selected arch/variant.

A drift names the module/object/flag; the fix is to regenerate the plan (README "How to extend").
Not in CI: on the default stack the tree needs FlashInfer PR #4460, a GitHub-only pin. The
Bazel spec files are checked against the plan in CI by //kernel_cache:spec_check.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tools import kernel_cache as kc


def _env_path(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this through Bazel (bazel test //kernel_cache:plan_check)")
    return Path(value)


def test_checked_in_plan_matches_the_patched_tree(tmp_path: Path) -> None:
    tempfile.tempdir = str(tmp_path)  # the probe's scratch dirs stay under the test's tmp
    plan = _env_path("KIMI_KC_PLAN")
    checked_in = kc.read_plan(plan)
    assert kc.main([
        "plan", "--check",
        "--flashinfer-tree", str(_env_path("KIMI_FLASHINFER_TREE")),
        "--modules", str(_env_path("KIMI_KC_MODULES")),
        "--arch", checked_in["arch"], "--variant", checked_in["variant"],
        "--cuda-home", str(_env_path("KIMI_CUDA_HOME")),
        "--host-root", os.environ.get("KIMI_K3_HOST_ROOT") or "auto",
        "--out", str(plan),
    ]) == 0


if __name__ == "__main__":
    # Per-case JUnit for bazel-testlogs (XML_OUTPUT_FILE), like the CPU suite's conftest.
    xml = os.environ.get("XML_OUTPUT_FILE")
    sys.exit(pytest.main([__file__, "-v"] + ([f"--junitxml={xml}"] if xml else [])))
