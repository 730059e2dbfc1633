"""//tests/cpu/kernel_cache:plans_current: every checked-in plan records the current inputs.

The cheap counterpart of `tools/bazel run //kernel_cache:update_plans` (tools/kernel_cache/plans.py
says what `check` can see without the patched trees): no tree, no compiler, no GitHub. Bazel
passes the same arguments as to update_plans (KIMI_KC_PLANS_ARGS: every plan with its stack, each
stack's flashinfer-python wheel, the lock, modules.json, selections.json, the patch folder).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import stack_version
from tools.common.errors import run_cli
from tools.kernel_cache import plans
from tools.kernel_cache.plan import read_plan, render_plan


def _args() -> list[str]:
    value = os.environ.get("KIMI_KC_PLANS_ARGS")
    if not value:
        pytest.fail("KIMI_KC_PLANS_ARGS is unset: run this test through Bazel (it sets the plans' arguments)")
    return shlex.split(value)


def _refs_and_inputs(args: list[str]) -> tuple[list[plans.PlanRef], plans.Inputs]:
    parsed = plans.parser().parse_args(["check", *args])
    refs = [plans.PlanRef(Path(p), s) for p, s in plans._pairs(parsed.plan, "--plan", "PATH=STACK")]
    return refs, plans._inputs(parsed)


def test_every_checked_in_plan_records_the_current_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args()
    refs, _ = _refs_and_inputs(args)
    assert {r.stack for r in refs} >= {"default", "pypi"} and len(refs) >= 6, refs
    assert run_cli(plans.main, ["check", *args]) == 0, capsys.readouterr().err


def _copy_plan(tmp_path: Path, ref: plans.PlanRef, **changes: object) -> plans.PlanRef:
    plan = read_plan(ref.path)
    plan.update(changes)
    path = tmp_path / ref.path.name
    path.write_text(render_plan(plan))
    return plans.PlanRef(path, ref.stack)


def _pypi_kimi_k3(refs: list[plans.PlanRef]) -> plans.PlanRef:
    (ref,) = [r for r in refs if r.path.name == "plan_120f_kimi-k3.pypi.bzl"]
    return ref


def test_a_plan_of_another_flashinfer_or_tree_is_named(tmp_path: Path) -> None:
    refs, inputs = _refs_and_inputs(_args())
    ref = _copy_plan(tmp_path, _pypi_kimi_k3(refs), flashinfer_version="0.0.1", patched_source_digest="0" * 64)
    (line,) = plans.check([ref], inputs)
    assert line.startswith("plan_120f_kimi-k3.pypi.bzl (stack pypi) is stale: ")
    assert f"flashinfer_version 0.0.1, stack pypi's pin flashinfer-python-{stack_version('pypi', 'flashinfer')}" in line
    assert "patched_source_digest 0000000000000000, the patch gate's tree of stack pypi" in line
    assert line.endswith("regenerate it with `tools/bazel run //kernel_cache:update_plans`")
    # The same plan checked as the default stack's: another wheel and manifest, another tree.
    (line,) = plans.check([plans.PlanRef(_pypi_kimi_k3(refs).path, "default")], inputs)
    assert "flashinfer_version" in line and "the patch gate's tree of stack default" in line


def test_a_hand_edit_and_a_toolchain_bump_are_named(tmp_path: Path) -> None:
    refs, inputs = _refs_and_inputs(_args())
    ref = _copy_plan(tmp_path, _pypi_kimi_k3(refs), nvcc_release="12.9")
    ref.path.write_text(ref.path.read_text().replace('"arch": "12.0f"', '"arch":  "12.0f"'))
    (line,) = plans.check([ref], inputs)
    assert "its bytes are not what the plan writer emits for its content" in line
    assert "nvcc_release 12.9, the lock's cuda-13.0 is 13.0" in line


def test_modules_json_and_selections_json_edits_are_named(tmp_path: Path) -> None:
    refs, inputs = _refs_and_inputs(_args())
    ref = _pypi_kimi_k3(refs)
    modules = json.loads(inputs.modules_path.read_text())
    for m in modules["modules"]:
        if m["name"] == "norm":
            m["kwargs"] = {**m.get("kwargs", {}), "extra": 1}
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    selections = json.loads(inputs.selections_path.read_text())
    selections["selections"]["kimi-k3"]["modules"]["fused_moe_120"]["runners"].append(
        "CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>")
    (tmp_path / "selections.json").write_text(json.dumps(selections))
    edited = dataclasses.replace(inputs, modules_path=tmp_path / "modules.json",
                                 decls=plans.load_modules(tmp_path / "modules.json"),
                                 selections_path=tmp_path / "selections.json")
    (line,) = plans.check([ref], edited)
    assert "module norm: generator/kwargs differ from modules.json" in line
    assert "module fused_moe_120: kernel selection kimi-k3 differs from selections.json" in line


def test_a_manifest_that_changes_a_file_changes_the_expected_tree(tmp_path: Path) -> None:
    refs, inputs = _refs_and_inputs(_args())
    ref = _pypi_kimi_k3(refs)
    patch_dir = tmp_path / "flashinfer_patches"
    shutil.copytree(inputs.patch_dir, patch_dir)
    manifest = json.loads((patch_dir / "pypi.manifest.json").read_text())
    manifest["changed_files"] = [{"path": "flashinfer/__init__.py", "sha256_before": "1" * 64,
                                  "sha256_after": "2" * 64, "changed_by": ["file:x.patch"]}]
    (patch_dir / "pypi.manifest.json").write_text(json.dumps(manifest))
    edited = dataclasses.replace(inputs, patch_dir=patch_dir)
    (line,) = plans.check([ref], edited)
    assert "patched_source_digest" in line and "pypi.manifest.json" in line


def test_the_cli_exits_1_naming_each_stale_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args()
    refs, _ = _refs_and_inputs(args)
    stale = _copy_plan(tmp_path, _pypi_kimi_k3(refs), flashinfer_version="0.0.1")
    argv = ["check", *[a for a in args if not a.startswith("--plan=")], f"--plan={stale.path}=pypi"]
    assert run_cli(plans.main, argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plan_120f_kimi-k3.pypi.bzl (stack pypi) is stale: "), err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
