"""The prebuilt kernel cache on a real GPU: loads with FLASHINFER_DISABLE_JIT=1, computes right.

Every check runs on fresh random inputs against a float64 torch reference. The cache must have
been built for this GPU's own architecture (9.0a on Hopper, 12.0f on SM120); FlashInfer is the
stack's (patched) wheel laid out by conftest.py, so nothing here can compile a kernel. A module
that kernel_cache/modules.json declares for the cache's arch and the cache lacks fails the test
(conftest.py require_cached_module); a missing torch or FlashInfer fails it too.
"""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).absolute().parent))
from conftest import (import_or_fail, kernel_cache_meta, require_cached_module,  # noqa: E402
                      require_cached_runner)

torch = import_or_fail("torch")

ARCH_OF_CAPABILITY = {(9, 0): "9.0a", (12, 0): "12.0f", (12, 1): "12.0f"}


def _rel_err(got: "torch.Tensor", ref: "torch.Tensor") -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _report(name: str, err: float) -> None:
    print(f"{name}: relative error vs float64 reference = {err:.3e}")


def test_jit_is_disabled_and_cache_matches_this_gpu() -> None:
    assert os.environ.get("FLASHINFER_DISABLE_JIT") == "1", "GPU tests must run with FLASHINFER_DISABLE_JIT=1"
    meta = kernel_cache_meta()
    want = ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(0))
    assert want, f"no kernel cache arch known for capability {torch.cuda.get_device_capability(0)}"
    assert meta["arch_list"] == want, f"kernel cache built for {meta['arch_list']}, this GPU needs {want}"
    import flashinfer

    print(f"flashinfer {flashinfer.__version__} from {Path(flashinfer.__file__).parent}; "
          f"cache modules: {', '.join(sorted(meta['modules']))}; nvcc {meta.get('toolchain', {}).get('nvcc_version', '?')}")


@pytest.mark.parametrize("tokens,hidden", [(1, 128), (77, 4096), (256, 7168)])
def test_silu_and_mul_from_cache(tokens: int, hidden: int) -> None:
    require_cached_module("silu_and_mul")
    import flashinfer

    gen = torch.Generator(device="cuda").manual_seed(tokens * 131 + hidden)
    x = torch.randn(tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = flashinfer.activation.silu_and_mul(x)
    torch.cuda.synchronize()
    gate, up = x.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    err = _rel_err(out, ref)
    _report(f"silu_and_mul[{tokens}x{hidden}] bf16", err)
    assert err < 1e-2


@pytest.mark.parametrize("tokens,hidden", [(1, 128), (33, 4096), (128, 7168)])
def test_rmsnorm_from_cache(tokens: int, hidden: int) -> None:
    require_cached_module("norm")
    import flashinfer

    gen = torch.Generator(device="cuda").manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    eps = 1e-6
    out = flashinfer.norm.rmsnorm(x, w, eps)
    torch.cuda.synchronize()
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    err = _rel_err(out, ref)
    _report(f"rmsnorm[{tokens}x{hidden}] bf16", err)
    assert err < 1e-2


def test_cutlass_moe_accepts_situ_keywords() -> None:
    """The stack's FlashInfer exposes SiTU in the CUTLASS MoE API (patched 0.6.18, or 0.7.x)."""
    from flashinfer.fused_moe import cutlass_fused_moe
    from flashinfer.fused_moe.core import ActivationType

    params = inspect.signature(cutlass_fused_moe).parameters
    for name in ("situ_beta", "situ_linear_beta"):
        assert name in params, f"cutlass_fused_moe has no {name}: FlashInfer #4460 is not applied"
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, f"{name} must be keyword-only"
    assert int(ActivationType.Situ) == 10


# What _bf16_moe constructs (kernel_cache/selections.json spelling).
BF16_RUNNER = "CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>"


def _moe_module_name() -> str:
    major, _ = torch.cuda.get_device_capability(0)
    return {9: "fused_moe_90", 12: "fused_moe_120"}.get(major, f"fused_moe_{major}0")


def _bf16_moe(activation: str, situ: tuple["torch.Tensor", "torch.Tensor"] | None, experts: int = 4,
              tokens: int = 16, hidden: int = 256, inter: int = 256, top_k: int = 2) -> float:
    """Run cutlass_fused_moe in BF16 and return the relative error against a float64 reference."""
    from flashinfer.fused_moe import cutlass_fused_moe
    from flashinfer.fused_moe.core import ActivationType

    gen = torch.Generator(device="cuda").manual_seed(7 + experts + tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5
    # The kernel's w13 rows are [up; gate] halves (FlashInfer's CUTLASS MoE convention).
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    kwargs = {}
    act = ActivationType.Swiglu
    if situ is not None:
        act = ActivationType.Situ
        kwargs = {"situ_beta": situ[0], "situ_linear_beta": situ[1]}
    out = torch.empty_like(x)
    cutlass_fused_moe(x, ids.to(torch.int), weights.float(), w13, w2, torch.bfloat16,
                      quant_scales=None, output=out, activation_type=act, **kwargs)
    torch.cuda.synchronize()

    ref = torch.zeros(tokens, hidden, dtype=torch.float64, device="cuda")
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            up, gate = h[:inter], h[inter:]
            if situ is None:
                a = torch.nn.functional.silu(gate) * up
            else:
                b, lb = float(situ[0][e]), float(situ[1][e])
                a = (b * torch.tanh(gate / b) * torch.sigmoid(gate)) * (lb * torch.tanh(up / lb))
            ref[t] += float(weights[t, j]) * (w2[e].double() @ a)
    return _rel_err(out, ref)


def test_cutlass_moe_bf16_swiglu_from_cache() -> None:
    require_cached_runner(_moe_module_name(), BF16_RUNNER)
    err = _bf16_moe("swiglu", None)
    _report("cutlass_fused_moe bf16 SwiGLU", err)
    assert err < 3e-2


def test_cutlass_moe_bf16_situ_per_expert_betas_from_cache() -> None:
    require_cached_runner(_moe_module_name(), BF16_RUNNER)
    experts = 4
    # Non-default, per-expert betas small enough that tanh saturates: a kernel that ignored them
    # (or used 4.0 / 25.0) would miss the reference by far more than the tolerance.
    beta = torch.tensor([0.5, 1.0, 2.0, 8.0], device="cuda", dtype=torch.float32)
    linear_beta = torch.tensor([0.25, 0.5, 3.0, 25.0], device="cuda", dtype=torch.float32)
    err = _bf16_moe("situ", (beta, linear_beta), experts=experts)
    _report("cutlass_fused_moe bf16 SiTU per-expert betas", err)
    assert err < 3e-2
    err_default = _bf16_moe("situ", (torch.full_like(beta, 4.0), torch.full_like(linear_beta, 25.0)), experts=experts)
    _report("cutlass_fused_moe bf16 SiTU default betas", err_default)
    assert err_default < 3e-2


def test_cutlass_moe_rejects_wrong_situ_shapes() -> None:
    require_cached_runner(_moe_module_name(), BF16_RUNNER)
    bad = torch.full((3,), 4.0, device="cuda", dtype=torch.float32)  # 4 experts on this rank
    with pytest.raises(Exception, match="situ_beta"):
        _bf16_moe("situ", (bad, torch.full((4,), 25.0, device="cuda")), experts=4)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
