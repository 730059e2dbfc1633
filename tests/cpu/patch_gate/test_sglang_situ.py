"""Kimi-K3 MXFP4 MoE on FlashInfer CUTLASS with SiTU: the sglang_patches series, regression-tested.

For each stack the real SGLang wheel goes through the patch gate itself (tools/patch_gate
`apply`: the stack's series, sglang_patches/wheel_layout.json, the lock's pin, and the committed
<stack>.manifest.json, so drift fails here too), and is also unpacked unpatched with the gate's
own unpacker. The same checks (tests/cpu/sglang_situ/harness.py) then run against both trees in
fresh interpreters, and every fix check must fail on the unpatched tree and pass on the gate's
tree, while the SwiGLU / SwigluStep callers must produce identical kernel calls on both.

The patched capability check also runs against each stack's real FlashInfer wheel (its Python
API is all it reads): the default stack's (without #4460) must be refused with a message naming
#4460, the pypi stack's (SiTU upstream) accepted.

Inputs: KIMI_TEST_SGLANG_WHEEL (the default stack's sglang), KIMI_TEST_SGLANG_PYPI_WHEEL (the
pypi stack's), KIMI_TEST_FLASHINFER_WHEEL and KIMI_TEST_FLASHINFER_PYPI_WHEEL (their
flashinfer-python; versions and pins come from third_party/pins.lock.json). An unset variable
fails the test; it never skips.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.cpu.conftest import artifact, stack_pin, stack_version
from tools.common.errors import run_cli
from tools.patch_gate import wheel as wheel_repack
from tools.patch_gate.cli import main as gate_main
from tools.patch_gate.result import STATE_APPLIES

# absolute(), not resolve(): under Bazel the runfiles tree (with its declared data) is the root.
ROOT = Path(__file__).absolute().parents[3]
PATCH_DIR = ROOT / "sglang_patches"
LOCK = ROOT / "third_party" / "pins.lock.json"
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
    pin: str


def _stack(name: str, wheel_env: str, flashinfer_env: str) -> Stack:
    return Stack(name, wheel_env, f"{name}.series", stack_version(name, "sglang"), flashinfer_env,
                 stack_pin(name, "sglang"))


STACKS = {
    "default": _stack("default", "KIMI_TEST_SGLANG_WHEEL", "KIMI_TEST_FLASHINFER_WHEEL"),
    "pypi": _stack("pypi", "KIMI_TEST_SGLANG_PYPI_WHEEL", "KIMI_TEST_FLASHINFER_PYPI_WHEEL"),
}
# env var -> (version, whether its cutlass_fused_moe has SiTU)
FLASHINFER_WHEELS = {
    "KIMI_TEST_FLASHINFER_WHEEL": (stack_version("default", "flashinfer"), False),
    "KIMI_TEST_FLASHINFER_PYPI_WHEEL": (stack_version("pypi", "flashinfer"), True),
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


def gate_apply(stack: Stack, wheel: Path, out: Path, manifest: Path) -> dict[str, Any]:
    """The stack's series through the patch gate, as the Bazel gate action runs it; returns the manifest."""
    args = [
        "apply", "--series", PATCH_DIR / stack.series, "--target", wheel, "--layout", PATCH_DIR / "wheel_layout.json",
        "--lock", LOCK, "--target-pin", stack.pin, "--expected-manifest", PATCH_DIR / f"{stack.name}.manifest.json",
        "--out-dir", out, "--manifest", manifest,
    ]
    rc = run_cli(gate_main, [str(a) for a in args])
    assert rc == 0, f"the patch gate refused sglang_patches/{stack.series} on sglang {stack.version} (exit {rc}; see stderr)"
    return json.loads(manifest.read_text())


def tree_digest(tree: Path) -> dict[str, str]:
    return {
        p.relative_to(tree).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tree.rglob("*")) if p.is_file()
    }


def run_harness(tree: Path, out: Path, *extra: str) -> dict[str, Any]:
    # FlashInfer's import writes its JIT log under FLASHINFER_WORKSPACE_BASE (default: HOME, which
    # the sandbox keeps read-only): the test's own directory instead.
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(out.parent)}
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--tree", str(tree), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )
    assert proc.returncode == 0, f"harness crashed on {tree}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@dataclass
class StackRun:
    stack: Stack
    unpatched_tree: Path
    patched_tree: Path
    manifest: dict[str, Any]
    # sha256 per file, taken before the harness imports anything (imports write __pycache__).
    unpatched_digest: dict[str, str]
    patched_digest: dict[str, str]
    unpatched: dict[str, Any]
    patched: dict[str, Any]


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StackRun:
    stack = STACKS[request.param]
    work = tmp_path_factory.mktemp(f"sglang-{stack.version}")
    unpatched, patched = work / "unpatched", work / "patched"
    wheel = artifact(stack.wheel_env)
    unpatched.mkdir()
    wheel_repack.unpack_wheel(wheel, unpatched)
    version = wheel_repack.find_dist_info(unpatched).version
    assert version == stack.version, f"{wheel.name} is sglang {version}, not {stack.version}"
    manifest = gate_apply(stack, wheel, patched, work / "manifest.json")
    return StackRun(
        stack,
        unpatched,
        patched,
        manifest,
        tree_digest(unpatched),
        tree_digest(patched),
        run_harness(unpatched, work / "unpatched.json"),
        run_harness(patched, work / "patched.json"),
    )


def report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(line)


def test_series_changes_only_the_moe_files(stack_run: StackRun) -> None:
    before, after = stack_run.unpatched_digest, stack_run.patched_digest
    assert before.keys() == after.keys(), "the series added or removed files"
    changed = {name for name in before if before[name] != after[name]}
    # server_args.py and moe/utils.py untouched: the default MoE backend is unchanged.
    assert changed == PATCHED_FILES
    assert {c["path"] for c in stack_run.manifest["changed_files"]} == PATCHED_FILES


def test_series_is_not_already_upstream(stack_run: StackRun) -> None:
    # The gate checked each patch forward and in reverse: `already upstream` would mean the fix landed.
    states = {p["entry"]: p["state"] for p in stack_run.manifest["patches"]}
    assert states and set(states.values()) == {STATE_APPLIES}, states


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
