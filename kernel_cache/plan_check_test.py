"""`//kernel_cache:plan_check`: the checked-in plan equals what FlashInfer's generators emit for
the patch gate's real tree (with #4460), this nvcc and the selected arch/variant.

A drift names the module/object/flag; the fix is to regenerate the plan (README "How to extend").
"""
from __future__ import annotations

import json
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


def test_bazel_spec_files_equal_the_tools_specs() -> None:
    """defs.bzl writes each compile/link action's spec in Starlark; they must be exactly what
    tools/kernel_cache.py object_spec/link_spec derive from the plan (one format, two writers)."""
    plan = kc.read_plan(_env_path("KIMI_KC_PLAN"))
    files = [Path(p) for p in os.environ.get("KIMI_KC_SPECS", "").split()]
    assert files, "KIMI_KC_SPECS is empty: run this through Bazel"
    for f in files:
        module = f.parent.name.removesuffix("_specs")
        want = (kc.link_spec(plan, module) if f.name == "link.json"
                else kc.object_spec(plan, module, f.name.removesuffix(".json")))
        assert json.loads(f.read_text()) == want, f


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
