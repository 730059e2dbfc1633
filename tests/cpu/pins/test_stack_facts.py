"""The generated per-stack facts agree with the data they come from.

@pins//:stacks.bzl (tools/pins/private/pins.bzl) is what every BUILD file iterates over instead of
naming stacks; @kernel_cache_plans//:plans.bzl lists the checked-in plans. Both are Starlark, so
this reads them back (ast) and compares them with the lock, with the patch gate's own series
reader, and with the plan files on disk. //tests/cpu/pins:stack_facts_test runs the generators
on a lock with a third stack.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cpu.conftest import REPO_ROOT, env_path, pins_lock
from tools.patch_gate.series import read_series


def starlark_globals(path: Path) -> dict[str, Any]:
    """NAME = <literal> assignments of a generated .bzl (loads and other statements skipped)."""
    values: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                values[node.targets[0].id] = ast.unparse(node.value)
    return values


def patch_dirs() -> dict[str, str]:
    """role -> patch folder, as MODULE.bazel's pins.lock(patch_dirs = {...}) names them."""
    module = (REPO_ROOT / "MODULE.bazel").read_text()
    block = re.search(r"patch_dirs = (\{.*?\})", module, re.S)
    assert block, "MODULE.bazel: pins.lock has no patch_dirs"
    return {role: package.removeprefix("//") for role, package in ast.literal_eval(block.group(1)).items()}


def test_stacks_bzl_holds_the_lock_s_stacks_roles_and_patch_pins() -> None:
    facts = starlark_globals(env_path("KIMI_STACKS_BZL"))
    lock = pins_lock()
    assert facts["STACKS"] == sorted(lock["stacks"])
    assert facts["DEFAULT_STACK"] == "default" and "default" in lock["stacks"]
    for name, stack in lock["stacks"].items():
        roles = {r: v for r, v in stack.items() if isinstance(v, str) and v in lock["pins"]}
        assert facts["ROLE_PINS"][name] == roles, name
        assert facts["PATCH_PINS"][name] == stack.get("patch_pins", []), name


def test_patched_agrees_with_the_patch_gate_s_series_reader() -> None:
    facts = starlark_globals(env_path("KIMI_STACKS_BZL"))
    dirs = patch_dirs()
    assert dirs == {"flashinfer": "flashinfer_patches", "sglang": "sglang_patches"}
    for stack in pins_lock()["stacks"]:
        applies = [role for role, folder in sorted(dirs.items()) if read_series(REPO_ROOT / folder / f"{stack}.series")]
        assert facts["PATCHED"][stack] == applies, stack
    # The two stacks of today, as the image's layers depend on it: default patches FlashInfer.
    assert facts["PATCHED"]["default"] == ["flashinfer", "sglang"] and facts["PATCHED"]["pypi"] == ["sglang"]


def test_plans_bzl_loads_every_plan_file_there_is() -> None:
    plans = env_path("KIMI_PLANS_BZL").read_text()
    loaded = re.findall(r'^load\("@@//kernel_cache:(plan_[^"]+\.bzl)", _plan_\d+ = "KERNEL_CACHE_PLAN"\)$', plans, re.M)
    on_disk = sorted(p.name for p in (REPO_ROOT / "kernel_cache").glob("plan_*.bzl"))
    assert loaded == on_disk and on_disk, (loaded, on_disk)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
