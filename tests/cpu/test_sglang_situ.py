"""Kimi-K3 MXFP4 MoE on FlashInfer CUTLASS with SiTU: the sglang_patches series, regression-tested.

For each stack the real SGLang wheel is unpacked twice; one copy gets the stack's series applied
with `git apply` (upstream `python/sglang/...` paths mapped onto the wheel's `sglang/...` with
-p2). The same checks (tests/cpu/sglang_situ/harness.py) then run against both copies in fresh
interpreters, and every fix check must fail on the unpatched copy and pass on the patched one,
while the SwiGLU / SwigluStep callers must produce identical kernel calls on both.

The patched capability check also runs against each stack's real FlashInfer wheel (its Python
API is all it reads): 0.6.18 without #4460 must be refused with a message naming #4460, 0.7.2
(SiTU upstream) accepted.

Inputs: KIMI_TEST_SGLANG_WHEEL (sglang 0.5.21, default stack), KIMI_TEST_SGLANG_PYPI_WHEEL
(sglang 0.5.23, pypi stack), KIMI_TEST_FLASHINFER_WHEEL (flashinfer-python 0.6.18) and
KIMI_TEST_FLASHINFER_PYPI_WHEEL (0.7.2). An unset variable fails the test; it never skips.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.cpu.conftest import artifact

# absolute(), not resolve(): under Bazel the runfiles tree (with its declared data) is the root.
ROOT = Path(__file__).absolute().parents[2]
PATCH_DIR = ROOT / "sglang_patches"
HARNESS = Path(__file__).absolute().parent / "sglang_situ" / "harness.py"
# Files the series may touch: SGLang's default MoE backend (server_args) must stay as it is.
PATCHED_FILES = {
    "sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py",
    "sglang/srt/layers/quantization/mxfp4.py",
}


@dataclass(frozen=True)
class Stack:
    name: str
    wheel_env: str
    series: str
    version: str
    flashinfer_env: str


STACKS = {
    "default": Stack(
        "default", "KIMI_TEST_SGLANG_WHEEL", "default.series", "0.5.21", "KIMI_TEST_FLASHINFER_WHEEL"
    ),
    "pypi": Stack(
        "pypi", "KIMI_TEST_SGLANG_PYPI_WHEEL", "pypi.series", "0.5.23", "KIMI_TEST_FLASHINFER_PYPI_WHEEL"
    ),
}
# env var -> (version, whether its cutlass_fused_moe has SiTU)
FLASHINFER_WHEELS = {
    "KIMI_TEST_FLASHINFER_WHEEL": ("0.6.18", False),
    "KIMI_TEST_FLASHINFER_PYPI_WHEEL": ("0.7.2", True),
}


def _load_harness() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_situ_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


HARNESS_MODULE = _load_harness()
FIX_CHECKS = sorted(HARNESS_MODULE.FIX_CHECKS)
INVARIANT_CHECKS = sorted(HARNESS_MODULE.INVARIANT_CHECKS)


def unpack_python_sources(wheel: Path, dest: Path, package: str, version: str) -> None:
    """Extract the wheel's <package>/*.py (all the checks import) and check its version."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        pattern = rf"{package}_?[a-z]*-[^/]+\.dist-info/METADATA"
        metadata = next(n for n in names if re.fullmatch(pattern, n))
        found = re.search(r"^Version: (\S+)$", archive.read(metadata).decode(), re.M)
        assert found and found.group(1) == version, f"{wheel.name} is not {package} {version}"
        for name in names:
            if name.startswith(f"{package}/") and name.endswith(".py"):
                archive.extract(name, dest)


def read_series(series: Path) -> list[Path]:
    patches = []
    for number, raw in enumerate(series.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, value = line.partition(":")
        assert kind == "file" and value, f"{series.name}:{number}: expected file:<patch>, got {raw!r}"
        patches.append(series.parent / value)
    return patches


def git_apply(tree: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # -p2 drops "a/python/": the wheel holds sglang/ at its root. The ceiling keeps git from
    # treating an enclosing repository's root as the base of the patch paths.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    return subprocess.run(
        ["git", "apply", "-p2", *extra, str(patch)],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )


def tree_digest(tree: Path) -> dict[str, str]:
    return {
        str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tree.rglob("*.py"))
    }


def run_harness(tree: Path, out: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--tree", str(tree), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, f"harness crashed on {tree}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@dataclass
class StackRun:
    stack: Stack
    unpatched_tree: Path
    patched_tree: Path
    unpatched: dict[str, Any]
    patched: dict[str, Any]


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StackRun:
    stack = STACKS[request.param]
    work = tmp_path_factory.mktemp(f"sglang-{stack.version}")
    unpatched, patched = work / "unpatched", work / "patched"
    wheel = artifact(stack.wheel_env)
    unpack_python_sources(wheel, unpatched, "sglang", stack.version)
    shutil.copytree(unpatched, patched)
    for patch in read_series(PATCH_DIR / stack.series):
        checked = git_apply(patched, patch, "--check")
        assert checked.returncode == 0, f"{patch.name} does not apply to sglang {stack.version}: {checked.stderr}"
        applied = git_apply(patched, patch)
        assert applied.returncode == 0, applied.stderr
    return StackRun(
        stack,
        unpatched,
        patched,
        run_harness(unpatched, work / "unpatched.json"),
        run_harness(patched, work / "patched.json"),
    )


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(line)


def test_series_changes_only_the_moe_files(stack_run: StackRun) -> None:
    before, after = tree_digest(stack_run.unpatched_tree), tree_digest(stack_run.patched_tree)
    assert before.keys() == after.keys(), "the series added or removed files"
    changed = {name for name in before if before[name] != after[name]}
    # server_args.py and moe/utils.py untouched: the default MoE backend is unchanged.
    assert changed == PATCHED_FILES


def test_series_is_not_already_upstream(stack_run: StackRun) -> None:
    # A patch that reverse-applies cleanly to the pristine wheel would already be upstream.
    for patch in read_series(PATCH_DIR / stack_run.stack.series):
        assert git_apply(stack_run.unpatched_tree, patch, "--check", "--reverse").returncode != 0


@pytest.mark.parametrize("check", FIX_CHECKS)
def test_fix_fails_unpatched_and_passes_patched(
    stack_run: StackRun, check: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = stack_run.unpatched["fix"][check], stack_run.patched["fix"][check]
    tag = f"sglang {stack_run.stack.version} {check}"
    report(capsys, f"\n  {tag}: unpatched {'PASS' if before['ok'] else 'FAIL'} ({before['detail'][:160]})")
    report(capsys, f"  {tag}: patched   {'PASS' if after['ok'] else 'FAIL'} ({after['detail'][:160]})")
    assert not before["ok"], f"{tag} already passes without the patch: the check proves nothing"
    assert after["ok"], f"{tag} fails with the patch: {after['detail']}"


@pytest.mark.parametrize("check", INVARIANT_CHECKS)
def test_gptoss_behaviour_holds_on_both_trees(stack_run: StackRun, check: str) -> None:
    for label, result in (("unpatched", stack_run.unpatched), ("patched", stack_run.patched)):
        assert result["invariant"][check]["ok"], f"{label}: {result['invariant'][check]['detail']}"


@pytest.mark.parametrize("call", ["gptoss_flashinfer_with_situ", "gptoss_flashinfer_0618", "swiglu_step"])
def test_swiglu_kernel_calls_unchanged(stack_run: StackRun, call: str) -> None:
    before, after = stack_run.unpatched["calls"][call], stack_run.patched["calls"][call]
    assert "<error>" not in before and "<error>" not in after, (before, after)
    assert after == before, "the patch changed a SwiGLU / SwigluStep cutlass_fused_moe call"
    assert after["activation_type"] in ("ActivationType.Swiglu", "ActivationType.SwigluStep")


def test_missing_situ_api_error_names_flashinfer_4460(stack_run: StackRun) -> None:
    for check in ("missing_4460_old_signature", "missing_4460_no_enum"):
        detail = stack_run.patched["fix"][check]["detail"]
        assert "FlashInfer #4460" in detail and "RuntimeError" in detail, detail


def test_capability_check_on_real_flashinfer(
    stack_run: StackRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each stack against the FlashInfer wheel it ships (the default stack's before #4460).
    variable = stack_run.stack.flashinfer_env
    version, has_situ = FLASHINFER_WHEELS[variable]
    unpack_python_sources(artifact(variable), tmp_path, "flashinfer", version)
    probe = run_harness(stack_run.patched_tree, tmp_path / "probe.json", "--real-flashinfer", str(tmp_path))
    report(capsys, f"\n  sglang {stack_run.stack.version} + flashinfer {probe['version']}: {probe['detail'][:120]}")
    assert probe["version"] == version
    assert probe["supported"] is has_situ, probe["detail"]
    if not has_situ:
        assert "FlashInfer #4460" in probe["detail"], probe["detail"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
