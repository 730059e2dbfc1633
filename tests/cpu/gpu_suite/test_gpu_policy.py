"""CPU tests of the GPU suite's policy (tests/gpu/conftest.py, tools/gpu_suite/site.py), no GPU needed.

A broken GPU host (torch missing or failing to import) must fail the GPU suite, not skip it; a
FlashInfer module that kernel_cache/modules.json declares for the cache's arch and the cache
lacks must fail the test that needs it; only a module outside that cache (other arch, or left
out by a --//kernel_cache:only build) is skipped. The suite runs here in a pytest subprocess
against stand-ins: a torch that fails to import, or one that reports an SM120 GPU, and a
FlashInfer wheel holding only a package with a kernel cache.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu_suite import site as gpu_site
from tools.gpu_suite.run import summarize

ROOT = Path(__file__).absolute().parents[3]
GPU_TESTS = ROOT / "tests" / "gpu"
MODULES = ROOT / "kernel_cache" / "modules.json"

BROKEN_TORCH = 'raise ImportError("simulated broken torch: libcudart.so.13 not found")\n'
SM120_TORCH = '''"""Stand-in torch reporting one SM120 GPU (conftest.py only asks torch.cuda)."""
class cuda:
    is_available = staticmethod(lambda: True)
    get_device_capability = staticmethod(lambda i=0: (12, 0))
    get_device_name = staticmethod(lambda i=0: "Stand-in SM120")
'''
PROBE = '''import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).absolute().parent))
from conftest import require_cached_module

def test_silu_and_mul():
    require_cached_module("silu_and_mul")

def test_fused_moe_120():
    require_cached_module("fused_moe_120")

def test_fused_moe_90():
    require_cached_module("fused_moe_90")
'''


def _meta(arch: str, modules: list[str]) -> dict:
    return {"arch_list": arch, "modules": {m: {"path": f"{m}/{m}.so"} for m in modules}}


def test_module_verdicts_follow_modules_json() -> None:
    meta = _meta("12.0f", ["silu_and_mul", "norm"])
    assert gpu_site.module_verdict("silu_and_mul", meta, MODULES) == ("run", "")
    verdict, why = gpu_site.module_verdict("fused_moe_120", meta, MODULES)
    assert verdict == "fail"
    assert "fused_moe_120: the 12.0f kernel cache lacks it" in why and "modules.json" in why
    # Declared for 9.0a only: not part of a 12.0f cache.
    verdict, why = gpu_site.module_verdict("fused_moe_90", meta, MODULES)
    assert verdict == "skip" and "not part of the 12.0f kernel cache" in why
    verdict, why = gpu_site.module_verdict("fused_moe_120", _meta("9.0a", []), MODULES)
    assert verdict == "skip"
    verdict, why = gpu_site.module_verdict("fused_moe_90", _meta("9.0a", ["norm"]), MODULES)
    assert verdict == "fail"
    # A subset build leaves modules out legitimately, and only those.
    only = gpu_site.parse_only("silu_and_mul,norm\n")
    assert only == ["norm", "silu_and_mul"]
    verdict, why = gpu_site.module_verdict("fused_moe_120", meta, MODULES, only)
    assert verdict == "skip" and "--//kernel_cache:only=norm,silu_and_mul" in why
    assert gpu_site.module_verdict("sampling", _meta("12.0f", ["norm"]), MODULES,
                                   ["norm", "sampling"])[0] == "fail"
    verdict, why = gpu_site.module_verdict("norm", None, MODULES)
    assert verdict == "fail" and "no kernel cache installed" in why


def test_every_module_the_gpu_tests_need_is_declared() -> None:
    """A misspelt module name would be 'not part of the cache' and skip forever."""
    declared = {m["name"] for m in json.loads(MODULES.read_text())["modules"]}
    needed = set()
    for f in GPU_TESTS.glob("test_*.py"):
        needed |= set(re.findall(r'require_cached_module\("([\w.]+)"\)', f.read_text()))
    # _moe_module_name() picks fused_moe_<major>0 by GPU.
    assert needed and needed <= declared, needed - declared
    assert {"fused_moe_90", "fused_moe_120"} <= declared


def test_runner_verdicts_follow_the_cache_selection() -> None:
    meta = _meta("12.0f", ["fused_moe_120"])
    bf16 = "CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>"
    assert gpu_site.runner_verdict("fused_moe_120", bf16, meta) == ("run", "")  # full: every runner
    meta["modules"]["fused_moe_120"]["kernel_selection"] = {
        "name": "kimi-k3", "runners": ["CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>"]}
    verdict, why = gpu_site.runner_verdict("fused_moe_120", bf16, meta)
    assert verdict == "skip" and f"{bf16} is outside kernel selection kimi-k3" in why, why
    assert gpu_site.runner_verdict(
        "fused_moe_120", "CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>", meta)[0] == "run"


def test_gpu_tests_runners_are_in_the_selections_of_their_host() -> None:
    """The Hopper test host's default selection (gpu-test-sm90) has every runner the SM90 tests
    construct, so none of them skips there; the SM120 test's runner is kimi-k3's."""
    sels = json.loads((ROOT / "kernel_cache" / "selections.json").read_text())["selections"]
    needed = set()
    for f in GPU_TESTS.glob("test_*.py"):
        text = f.read_text()
        needed |= set(re.findall(r'require_cached_runner\("(\w+)", "([^"]+)"\)', text))
        needed |= {(m, r) for m in ("fused_moe_90", "fused_moe_120")
                   for r in re.findall(r'^BF16_RUNNER = "([^"]+)"', text, re.M)}
    for module, selection in (("fused_moe_90", "gpu-test-sm90"), ("fused_moe_120", "kimi-k3")):
        runners = sels[selection]["modules"][module]["runners"]
        want = {r for m, r in needed if m == module}
        assert want, module
        if selection == "gpu-test-sm90":
            assert want <= set(runners), want - set(runners)
        else:  # SM120: the MXFP8 x MXFP4 test runs; the bf16 ones skip by the selection
            assert "CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>" in want & set(runners)


def _suite_copy(tmp: Path) -> Path:
    """tests/gpu with tools/ and kernel_cache/modules.json beside it, like the repo."""
    (tmp / "kernel_cache").mkdir(parents=True)
    shutil.copyfile(MODULES, tmp / "kernel_cache" / "modules.json")
    os.symlink(ROOT / "tools", tmp / "tools")
    gpu = tmp / "tests" / "gpu"
    gpu.mkdir(parents=True)
    for f in GPU_TESTS.glob("*.py"):
        shutil.copyfile(f, gpu / f.name)
    return gpu


def _fake_package(where: Path, name: str, init: str) -> None:
    (where / name).mkdir(parents=True)
    (where / name / "__init__.py").write_text(init)


def _run_suite(tmp: Path, args: list[str], torch_init: str,
               env: dict[str, str] | None = None) -> tuple[int, dict[str, tuple[str, str]], str]:
    fake = tmp / "fake-site"
    shutil.rmtree(fake, ignore_errors=True)
    _fake_package(fake, "torch", torch_init)
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("KIMI_", "FLASHINFER_", "PYTEST_")) and k != "XML_OUTPUT_FILE"}
    clean["PYTHONPATH"] = os.pathsep.join([str(fake)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    clean.update(env or {})
    junit = tmp / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
         "-o", "junit_family=xunit1", f"--junitxml={junit}", *args],
        cwd=tmp, env=clean, capture_output=True, text=True, timeout=300)
    rows, _ = summarize(junit)
    return proc.returncode, {r[0]: (r[1], r[3]) for r in rows}, proc.stdout + proc.stderr


def test_gpu_suite_fails_when_torch_does_not_import(tmp_path: Path) -> None:
    gpu = _suite_copy(tmp_path)
    files = sorted(str(f) for f in gpu.glob("test_*.py"))
    assert len(files) == 5
    rc, outcomes, out = _run_suite(tmp_path, files, BROKEN_TORCH)
    assert rc != 0, out
    assert outcomes and all(o == "failed" for o, _ in outcomes.values()), outcomes
    assert "simulated broken torch" in out
    # Only an explicit KIMI_K3_ALLOW_NO_GPU=1 turns that into skips.
    rc, outcomes, out = _run_suite(tmp_path, files, BROKEN_TORCH, {"KIMI_K3_ALLOW_NO_GPU": "1"})
    assert rc in (0, 5), out  # 5: pytest found no test to run (every module skipped)
    assert outcomes and all(o == "skipped" for o, _ in outcomes.values()), outcomes


def test_gpu_suite_fails_on_a_declared_module_missing_from_the_cache(tmp_path: Path) -> None:
    gpu = _suite_copy(tmp_path)
    (gpu / "test_probe.py").write_text(PROBE)
    wheel = tmp_path / "flashinfer_python-0+fake-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("flashinfer/__init__.py", "__version__ = '0+fake'\n")
    cache = tmp_path / "cache" / gpu_site.AOT
    (cache / "silu_and_mul").mkdir(parents=True)
    (cache / "silu_and_mul" / "silu_and_mul.so").write_bytes(b"")
    (cache / "kernel_cache.json").write_text(json.dumps(_meta("12.0f", ["silu_and_mul"])))
    env = {"KIMI_GPU_WHEELS": str(wheel), "KIMI_GPU_KERNEL_CACHE": str(tmp_path / "cache")}

    rc, outcomes, out = _run_suite(tmp_path, [str(gpu / "test_probe.py")], SM120_TORCH, env)
    assert rc != 0, out
    assert outcomes["test_probe::test_silu_and_mul"][0] == "passed", outcomes
    moe120 = outcomes["test_probe::test_fused_moe_120"]
    assert moe120[0] == "failed" and "12.0f kernel cache lacks it" in out, outcomes
    assert outcomes["test_probe::test_fused_moe_90"][0] == "skipped", outcomes

    # The cache was built with --//kernel_cache:only=silu_and_mul (Bazel passes the file).
    only_file = tmp_path / "only.txt"
    only_file.write_text("silu_and_mul\n")
    rc, outcomes, out = _run_suite(tmp_path, [str(gpu / "test_probe.py")], SM120_TORCH,
                                   env | {"KIMI_GPU_KERNEL_CACHE_ONLY_FILE": str(only_file)})
    assert rc == 0, out
    assert outcomes["test_probe::test_fused_moe_120"][0] == "skipped", outcomes
    assert "--//kernel_cache:only=silu_and_mul" in outcomes["test_probe::test_fused_moe_120"][1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_gpu_suite_refuses_a_tvm_ffi_the_cache_was_not_compiled_against(tmp_path: Path) -> None:
    """What is tested is what ships: a kernel cache compiled against the stack's apache-tvm-ffi
    0.1.11 is run with that version, never with whatever tvm-ffi a GPU host happens to have."""
    from tools.common.errors import UserError
    from tools.gpu_suite.run import check_tvm_ffi_matches_cache
    aot = tmp_path / "kc" / "flashinfer" / "data" / "aot"
    aot.mkdir(parents=True)
    (aot / "kernel_cache.json").write_text(json.dumps({"toolchain": {"tvm_ffi_version": "0.1.11"}}))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl").touch()
    with pytest.raises(UserError, match=r"apache_tvm_ffi 0\.1\.15\.post2: the kernel cache .* "
                                         r"against apache-tvm-ffi 0\.1\.11"):
        check_tvm_ffi_matches_cache(tmp_path / "kc", [wheels])
    (wheels / "apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl").unlink()
    (wheels / "apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_2_28_x86_64.whl").touch()
    check_tvm_ffi_matches_cache(tmp_path / "kc", [wheels])
