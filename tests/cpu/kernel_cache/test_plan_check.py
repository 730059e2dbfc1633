"""`//tests/cpu/kernel_cache:plan_check`: the checked-in plan equals what FlashInfer's generators
emit for the patch gate's real tree (with #4460), this nvcc and the selected arch, kernel
selection and variant.

A drift names the module/object/flag; the fix is to regenerate the plan (kernel_cache/README.md
"How to extend"). Manual, not in CI: on the default stack the tree needs FlashInfer PR #4460, a
GitHub-only pin. The Bazel spec files are checked against the plan in CI by
//tests/cpu/kernel_cache:spec_check.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path, pinned_toolchain_paths
from tools.kernel_cache.cli import main
from tools.kernel_cache.plan import read_plan


def test_checked_in_plan_matches_the_patched_tree(tmp_path: Path) -> None:
    tempfile.tempdir = str(tmp_path)  # the probe's scratch dirs stay under the test's tmp
    plan = env_path("KIMI_KC_PLAN")
    checked_in = read_plan(plan)
    assert main([
        "plan", "--check",
        "--flashinfer-tree", str(env_path("KIMI_FLASHINFER_TREE")),
        "--modules", str(env_path("KIMI_KC_MODULES")),
        "--arch", checked_in["arch"], "--variant", checked_in["variant"],
        # A kernel selection's plan: the same selection (selections.json beside modules.json).
        "--selection", checked_in.get("selection", "full"),
        "--cuda-home", pinned_toolchain_paths()[0],
        "--userland", pinned_toolchain_paths()[1],
        "--out", str(plan),
    ]) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
