"""Triton kernels built ahead of time, taken by Triton's own cache on a real GPU with no compiler
reachable: 0 compiles, outputs within tolerance of a float64 reference (issue #27's proof).

Inputs (set by the bundle's `sh run.sh --triton`, tools/gpu_suite/host.py):
  KIMI_TRITON_CACHE   the cache built for this GPU and keyed for this host's Triton
                      (//jit_cache:triton_9_0_gpu_host: Triton's cache layout, Triton's driver
                      module and kimi-k3-triton.json, whose `runtime` says what it was keyed for)
  TRITON_CACHE_DIR    a fresh directory the cache is bound into (triton_aot bind: group files and
                      links naming the read-only shipped files)
and on sys.path first the stack's Triton at the runtime's site_packages (the path its driver
module is keyed on), without ptxas: in its place a stand-in that only prints the version the
cache was keyed with. PATH holds no compiler, CUDA_HOME and TRITON_PTXAS_PATH name a missing
directory (host.py sets them; the first test checks them). Every compile Triton starts is
counted (its compilation listener and its C-module build hook).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).absolute().parent))
from conftest import import_or_fail  # noqa: E402

torch = import_or_fail("torch")

MANIFEST = "kimi-k3-triton.json"
REPO = Path(__file__).absolute().parents[2]


def _input(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this file through the GPU bundle (`sh bundle/run.sh "
                    "--triton`, docs/GPU_RUN.md), which sets it")
    return Path(value)


class Counts:
    """What Triton compiled and what its cache answered, in this process."""

    def __init__(self) -> None:
        from triton import knobs

        self.compiled: list[str] = []
        self.hits: list[str] = []
        self.modules: list[str] = []

        def listen(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
            (self.hits if cache_hit else self.compiled).append(getattr(src, "name", str(src)))

        def refuse(name: str, src: str, *args: Any) -> str:
            self.modules.append(name)
            raise RuntimeError(f"Triton started building its C module {name} from {src}: not in the cache")

        knobs.compilation.listener = listen
        knobs.build.impl = refuse


@pytest.fixture(scope="module")
def shipped() -> dict[str, Any]:
    cache = _input("KIMI_TRITON_CACHE")
    manifest = json.loads((cache / MANIFEST).read_text())
    if manifest.get("runtime") is None:
        pytest.fail(f"{cache}: not keyed for a GPU host (no runtime in {MANIFEST}); pass "
                    "//jit_cache:triton_9_0_gpu_host's output")
    return {"cache": cache, "manifest": manifest, "counts": Counts()}


@pytest.mark.arch("sm90")
def test_no_compiler_is_reachable_and_triton_is_the_keyed_one(shipped: dict[str, Any]) -> None:
    import triton

    runtime = shipped["manifest"]["runtime"]
    assert triton.__version__ == "3.8.0"
    assert Path(triton.__file__).resolve().is_relative_to(Path(runtime["site_packages"])), triton.__file__
    reachable = [w for w in ("nvcc", "ptxas", "cc", "gcc", "clang", "c++") if shutil.which(w)]
    assert not reachable, f"compilers on PATH in the proof's process: {reachable}"
    assert not os.path.exists(os.environ["TRITON_PTXAS_PATH"])
    assert os.environ.get("TRITON_LIBCUDA_PATH") == runtime["libcuda_path"]
    # Triton's own ptxas is the stand-in: it answers the version the cache is keyed with and
    # refuses to compile.
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    version = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True)
    assert version.stdout == shipped["manifest"]["ptxas_version"]
    refused = subprocess.run([str(ptxas), "-arch=sm_90", "x.ptx"], capture_output=True, text=True)
    assert refused.returncode != 0 and "compiles nothing" in refused.stderr
    name = torch.cuda.get_device_name(0)
    assert name == runtime["device"]["device_name"], name
    from triton.runtime import driver

    props = driver.active.utils.get_device_properties(torch.cuda.current_device())
    keyed = runtime["device"]["device_properties"]
    assert {k: props.get(k) for k in keyed} == keyed, props


@pytest.mark.arch("sm90")
def test_the_driver_module_is_the_shipped_one(shipped: dict[str, Any]) -> None:
    """Triton's CudaUtils (built with a C compiler at the first launch) came from the cache."""
    from triton.backends.nvidia.driver import CudaUtils

    [module] = shipped["manifest"]["modules"]
    loaded = Path(CudaUtils().launch.__self__.__file__).resolve()
    assert loaded == (shipped["cache"] / module["key"] / module["file"]).resolve(), loaded
    assert shipped["counts"].modules == []


def kda_reference(x: dict[str, Any], heads: int, sequences: list[int]) -> dict[str, Any]:
    """float64: the causal conv1d (width 4, SiLU, zero initial state) per sequence, then KDA per
    head: q, k L2-normalised, gate g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias)),
    beta = sigmoid(raw beta), S <- diag(exp(g_t)) S; S <- S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = K^-1/2 S^T q_t; the final S^T ([V, K]) in the state pool's slot."""
    from tools.jit_cache.triton_worker import KDA_HEAD, KDA_LOWER_BOUND

    f64 = torch.float64
    seg = heads * KDA_HEAD
    mixed = x["mixed_qkv"].to(f64)
    w = x["conv_weight"].to(f64)
    qkv = torch.zeros_like(mixed)
    starts = x["query_start_loc"].tolist()
    for s, e in zip(starts, starts[1:]):
        seq = torch.cat([torch.zeros(3, mixed.shape[1], dtype=f64, device=mixed.device), mixed[s:e]])
        conv = sum(w[:, j] * seq[j:j + e - s] for j in range(4))
        qkv[s:e] = conv * torch.sigmoid(conv)
    q, k, v = (t.unflatten(-1, (heads, KDA_HEAD)) for t in qkv.split([seg, seg, seg], dim=-1))
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    a = x["a"][0].to(f64) + x["dt_bias"].to(f64).unflatten(0, (heads, KDA_HEAD))
    g = KDA_LOWER_BOUND * torch.sigmoid(torch.exp(x["A_log"].to(f64))[:, None] * a)
    beta = torch.sigmoid(x["beta"][0].to(f64))
    o = torch.zeros(mixed.shape[0], heads, KDA_HEAD, dtype=f64, device=mixed.device)
    states = x["ssm_states"].to(f64).clone()
    for i, (s, e) in enumerate(zip(starts, starts[1:])):
        S = torch.zeros(heads, KDA_HEAD, KDA_HEAD, dtype=f64, device=mixed.device)  # [H, K, V]
        for t in range(s, e):
            S = S * torch.exp(g[t])[:, :, None]
            u = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
            S = S + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], u)
            o[t] = KDA_HEAD ** -0.5 * torch.einsum("hk,hkv->hv", q[t], S)
        states[int(x["cache_indices"][i])] = S.transpose(-1, -2)
    return {"qkv": qkv, "o": o, "ssm_states": states}


def rel_err(got: Any, ref: Any) -> float:
    return float((got.to(torch.float64) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def calls() -> list[dict[str, Any]]:
    cache = os.environ.get("KIMI_TRITON_CACHE")
    if not cache:
        return []
    return json.loads((Path(cache) / MANIFEST).read_text())["calls"]


@pytest.mark.arch("sm90")
@pytest.mark.parametrize("call", calls(), ids=lambda c: f"{c['call']}-heads{c['args']['heads']}")
def test_the_shipped_kernels_are_hits_and_match_float64(call: dict[str, Any], shipped: dict[str, Any]) -> None:
    from tools.jit_cache.triton_worker import import_sglang, sglang_kda_prefill

    import_sglang()  # as the build runs it: the kernels' modules, not SGLang's frontend __init__
    counts = shipped["counts"]
    before = len(counts.compiled), len(counts.hits)
    out = sglang_kda_prefill(**call["args"], device="cuda")
    torch.cuda.synchronize()
    compiled = counts.compiled[before[0]:]
    hits = counts.hits[before[1]:]
    assert not compiled, f"Triton compiled {sorted(set(compiled))}, which the cache lacks"
    assert hits, "no Triton cache hit: the call ran no Triton kernel"
    ref = kda_reference(out["inputs"], call["args"]["heads"], call["args"]["sequences"])
    errors = {name: rel_err(out[name].reshape(ref[name].shape), ref[name]) for name in ("qkv", "o", "ssm_states")}
    print(f"{call['call']} {json.dumps(call['args'])}: {len(hits)} hits, 0 compiles; relative error vs "
          f"float64: " + ", ".join(f"{k} {v:.3e}" for k, v in errors.items()))
    assert errors["qkv"] < 2e-2 and errors["o"] < 3e-2 and errors["ssm_states"] < 3e-2, errors
