"""SGLang's JIT modules built ahead of time, taken by SGLang's own loader on a real GPU with no
compiler reachable: 0 compiles, outputs within tolerance of a float64 reference (issue #27's proof).

Inputs (set by the bundle's `sh run.sh --sglang-jit`, tools/gpu_suite/host.py):
  KIMI_SGLANG_JIT_CACHE    the cache built for this GPU's arch and keyed for this host
                           (//jit_cache:sglang_jit_9_0a_gpu_host: SGLang's cache layout and
                           kimi-k3-sglang-jit.json), used as SGLANG_JIT_CACHE_DIR read-only
  KIMI_SGLANG_JIT_RUNTIME  the file whose sglang_jit_runtime the cache was keyed for
                           (tools/gpu_suite/gpu_host.json): this host must report the same
and the SGLang tree on sys.path. The process runs with PATH holding no compiler and CUDA_HOME at
the runtime's missing directory (host.py sets both; the first test checks them), and with
SGLANG_CRASH_ON_JIT_COMPILE=1: a compile would raise in SGLang itself, and is counted here too.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).absolute().parent))
from conftest import import_or_fail  # noqa: E402

torch = import_or_fail("torch")

from tools.gpu_suite import sglang_jit_cases as cases  # noqa: E402

MANIFEST = "kimi-k3-sglang-jit.json"


def _input(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this file through the GPU bundle (`sh bundle/run.sh "
                    "--sglang-jit`, docs/GPU_RUN.md), which sets it")
    return Path(value)


@pytest.fixture(scope="module")
def shipped() -> dict[str, Any]:
    cache = _input("KIMI_SGLANG_JIT_CACHE")
    runtime_file = _input("KIMI_SGLANG_JIT_RUNTIME")
    manifest = json.loads((cache / MANIFEST).read_text())
    runtime = json.loads(runtime_file.read_text())["sglang_jit_runtime"]
    if os.environ.get("SGLANG_JIT_CACHE_DIR") != str(cache):
        pytest.fail(f"SGLANG_JIT_CACHE_DIR is {os.environ.get('SGLANG_JIT_CACHE_DIR')!r}, not the "
                    f"shipped cache {cache}")
    return {"cache": cache, "manifest": manifest, "runtime": runtime,
            "counts": cases.count_loader()}


@pytest.mark.arch("sm90")
def test_no_compiler_is_reachable_and_the_keys_are_this_hosts(shipped: dict[str, Any]) -> None:
    from sglang.kernels.jit.utils.compile import toolchain

    runtime, manifest = shipped["runtime"], shipped["manifest"]
    assert os.environ.get("CUDA_HOME") == runtime["cuda_home"]
    reachable = [p for p in (toolchain.device_compiler_path(),) if os.path.exists(p)]
    reachable += [w for w in (shutil.which("nvcc"), shutil.which("c++"), shutil.which("ptxas")) if w]
    assert not reachable, f"compilers reachable in the proof's process: {reachable}"
    assert os.environ.get("SGLANG_CRASH_ON_JIT_COMPILE") == "1"
    seen = cases.keyed_distributions()
    differ = {k: (v, manifest["runtime"]["distributions"][k]) for k, v in seen.items()
              if manifest["runtime"]["distributions"].get(k) != v}
    assert not differ, (f"this host reports {differ} (here, keyed for); set "
                        "tools/gpu_suite/gpu_host.json sglang_jit_runtime.distributions to what "
                        "this host reports and rebuild the bundle")
    assert cases.environment_fingerprint() == manifest["environment_fingerprint"]


@pytest.mark.arch("sm90")
@pytest.mark.parametrize("case", cases.CASES, ids=[c.name for c in cases.CASES])
def test_shipped_module_is_a_hit_and_matches_float64(case: cases.Case, shipped: dict[str, Any]) -> None:
    counts = shipped["counts"]
    compiles_before = len(counts.compiles)
    outputs = case.run(torch.device("cuda"))
    torch.cuda.synchronize()
    assert len(counts.compiles) == compiles_before, f"compiled: {counts.compiles[compiles_before:]}"
    assert case.module in counts.hits, (case.module, counts)
    leaf = {m["module"]: m["leaf"] for m in shipped["manifest"]["modules"]}[case.module]
    assert (shipped["cache"] / leaf).is_dir()
    errors = cases.relative_errors(outputs)
    print(f"{case.name}: relative error " + ", ".join(f"{k} {v:.3e}" for k, v in errors.items()))
    assert all(e <= case.tolerance for e in errors.values()), (errors, case.tolerance)


@pytest.mark.arch("sm90")
def test_nothing_was_compiled(shipped: dict[str, Any]) -> None:
    counts = shipped["counts"]
    assert counts.compiles == [] and counts.misses == [], counts
    assert set(counts.hits) == {m["module"] for m in shipped["manifest"]["modules"]}, counts
