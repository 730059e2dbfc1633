"""SiTU through FlashInfer's CUTLASS fused MoE on a real GPU, Kimi-K3 shaped, MXFP4 weights.

What the sglang_patches series feeds the kernel, rebuilt here from first principles: a Kimi-K3
checkpoint stores each expert's w13 as contiguous [gate; up] halves (no bias) with E8M0 block
scales; the kernel wants [up; gate] halves padded to 128, and SiTU with per-expert fp32
`situ_beta` / `situ_linear_beta` (keyword-only, FlashInfer #4460 or flashinfer-python >= 0.7).
The output is compared with a float32 reference computed straight from the checkpoint layout.

- SM90 (H200): bf16 activations x MXFP4 weights (`use_w4_group_scaling=True`, weights and scales
  interleaved by `interleave_moe_{weights,scales}_for_sm90_mixed_gemm`), as SGLang's SM90 path.
- SM120: MXFP8 activations x MXFP4 weights (`use_mxfp8_act_scaling=True`, scales through
  `block_scale_interleave`), as SGLang's SM120 path. Skipped elsewhere, with the reason.

Needs the CUTLASS fused-MoE module for the GPU's arch built ahead of time (fused_moe_90 by JIT is
too slow to wait for at the first call); the cache lacking a module kernel_cache/modules.json declares
for its arch fails the test (conftest.py require_cached_module). Without a GPU, or without an
importable torch / FlashInfer, every test fails (conftest.py policy; KIMI_K3_ALLOW_NO_GPU=1 turns
that into skips). CI (.ci/run) runs only the CPU suite, never this file.
"""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).absolute().parent))
from conftest import (import_or_fail, installed_cache_meta, require_cached_module,  # noqa: E402
                      require_cached_runner)

torch = import_or_fail("torch")

SF_BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DEFAULT_SITU_BETA, DEFAULT_SITU_LINEAR_BETA = 4.0, 25.0


@dataclass(frozen=True)
class MoeShape:
    experts: int
    intermediate: int  # N, unpadded
    hidden: int  # K, unpadded
    tokens: int
    top_k: int


# Kimi-shaped and tiny: the second needs N padding (192 -> 256), like a TP shard of 3072/16.
SHAPES = (MoeShape(8, 256, 512, 32, 4), MoeShape(8, 192, 512, 32, 4))


def _cuda() -> Any:
    # conftest.py's autouse policy has already failed (or, with KIMI_K3_ALLOW_NO_GPU=1, skipped)
    # the test when no CUDA GPU is visible.
    return torch.device("cuda")


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _flashinfer_with_situ() -> Any:
    """Import FlashInfer and fail (not skip) when it is missing or its CUTLASS MoE lacks SiTU
    (#4460)."""
    import flashinfer
    from flashinfer import fused_moe
    from flashinfer.fused_moe.core import ActivationType

    params = inspect.signature(fused_moe.cutlass_fused_moe).parameters
    has_keywords = all(
        name in params and params[name].kind is inspect.Parameter.KEYWORD_ONLY
        for name in ("situ_beta", "situ_linear_beta")
    )
    if not (has_keywords and hasattr(ActivationType, "Situ")):
        pytest.fail(
            f"flashinfer {flashinfer.__version__} has no CUTLASS SiTU (FlashInfer #4460): "
            "install the stack's patched flashinfer-python or >= 0.7"
        )
    return flashinfer


@dataclass
class KimiExperts:
    """A Kimi-K3 MXFP4 checkpoint slice: w13 rows are [gate (w1); up (w3)]."""

    w13: Any  # uint8 [E, 2N, K/2]
    w13_scale: Any  # uint8 E8M0 [E, 2N, K/32]
    w2: Any  # uint8 [E, K, N/2]
    w2_scale: Any  # uint8 E8M0 [E, K, N/32]


def make_experts(shape: MoeShape, device: Any, seed: int) -> KimiExperts:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e, n, k = shape.experts, shape.intermediate, shape.hidden

    def packed(*size: int) -> Any:
        return torch.randint(0, 256, size, generator=gen, dtype=torch.uint8).to(device)

    def scales(*size: int, low: int, high: int) -> Any:
        return torch.randint(low, high, size, generator=gen, dtype=torch.uint8).to(device)

    # Exponents chosen so GEMM1 outputs reach a few units: both tanh clips matter.
    return KimiExperts(
        w13=packed(e, 2 * n, k // 2),
        w13_scale=scales(e, 2 * n, k // SF_BLOCK, low=122, high=125),
        w2=packed(e, k, n // 2),
        w2_scale=scales(e, k, n // SF_BLOCK, low=118, high=121),
    )


def dequant_mxfp4(packed: Any, scale: Any) -> Any:
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    values = lut[nibbles & 0x7] * torch.where(nibbles >= 8, -1.0, 1.0)
    return values * torch.exp2(scale.float() - 127.0).repeat_interleave(SF_BLOCK, dim=-1)


def situ(gate: Any, up: Any, beta: Any, linear_beta: Any) -> Any:
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        linear_beta * torch.tanh(up / linear_beta)
    )


def reference_moe(
    experts: KimiExperts, x: Any, ids: Any, weights: Any, beta: Any, linear_beta: Any, n: int
) -> Any:
    """float32 SiTU MoE from the checkpoint layout; beta / linear_beta are per expert."""
    w13 = dequant_mxfp4(experts.w13, experts.w13_scale)
    w2 = dequant_mxfp4(experts.w2, experts.w2_scale)
    xf = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = xf[token] @ w13[e].T
        act = situ(h[:, :n], h[:, n:], float(beta[e]), float(linear_beta[e]))
        # The kernel rounds the activation to the GEMM2 input dtype (bf16) before GEMM2.
        act = act.to(torch.bfloat16).float()
        out.index_add_(0, token, weights[token, slot, None] * (act @ w2[e].T))
    return out


def kernel_w13(rows: Any, n: int, n_pad: int, cols_pad: int) -> Any:
    """[gate; up] -> the kernel's [up (padded); gate (padded)] halves, columns padded."""
    e, _, cols = rows.shape
    out = torch.zeros(e, 2 * n_pad, cols_pad, dtype=rows.dtype, device=rows.device)
    out[:, :n, :cols] = rows[:, n:]
    out[:, n_pad : n_pad + n, :cols] = rows[:, :n]
    return out


def kernel_w2(rows: Any, k_pad: int, cols_pad: int) -> Any:
    e, k, cols = rows.shape
    out = torch.zeros(e, k_pad, cols_pad, dtype=rows.dtype, device=rows.device)
    out[:, :k, :cols] = rows
    return out


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def routing(shape: MoeShape, device: Any, seed: int) -> tuple[Any, Any]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), shape.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).to(device), weights.float().to(device)


def per_expert_betas(shape: MoeShape, device: Any) -> tuple[Any, Any]:
    # Different per expert and far from the 4.0 / 25.0 defaults, so ignored tensors show.
    e = torch.arange(shape.experts, dtype=torch.float32)
    return (1.0 + 0.5 * e).to(device), (2.0 + 1.5 * e).to(device)


def rel_error(got: Any, want: Any) -> float:
    return float((got.float() - want).norm() / want.norm())


@dataclass
class Case:
    shape: MoeShape
    experts: KimiExperts
    x: Any
    ids: Any
    weights: Any
    beta: Any
    linear_beta: Any


def make_case(shape: MoeShape, device: Any) -> Case:
    experts = make_experts(shape, device, seed=1)
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(torch.bfloat16).to(device)
    ids, weights = routing(shape, device, seed=3)
    beta, linear_beta = per_expert_betas(shape, device)
    return Case(shape, experts, x, ids, weights, beta, linear_beta)


def check_against_references(case: Case, run: Any, label: str, tolerance: float) -> None:
    """Run with the per-expert betas and compare; also prove the betas and Situ took effect."""
    n = case.shape.intermediate
    want = reference_moe(case.experts, case.x, case.ids, case.weights, case.beta, case.linear_beta, n)
    defaults = torch.full_like(case.beta, DEFAULT_SITU_BETA), torch.full_like(
        case.beta, DEFAULT_SITU_LINEAR_BETA
    )
    want_defaults = reference_moe(case.experts, case.x, case.ids, case.weights, *defaults, n)
    got = run(case.beta, case.linear_beta)
    got_defaults = run(None, None)  # the kernel's compile-time defaults: 4.0 / 25.0
    err = rel_error(got, want)
    err_defaults = rel_error(got_defaults, want_defaults)
    err_ignored = rel_error(got, want_defaults)
    print(
        f"\n  {label} on {torch.cuda.get_device_name()} (sm{''.join(map(str, _capability()))}) "
        f"{case.shape}: rel. error {err:.3e} (per-expert betas), {err_defaults:.3e} (defaults), "
        f"{err_ignored:.3e} (output vs default-beta reference)"
    )
    assert torch.isfinite(got).all()
    assert err < tolerance, f"{label}: SiTU output off the float32 reference by {err:.3e}"
    assert err_defaults < tolerance, f"{label}: default-beta SiTU off by {err_defaults:.3e}"
    assert err_ignored > 5 * err, f"{label}: per-expert betas made no difference ({err_ignored:.3e})"


def _w4a16_runner(shape: MoeShape, device: Any) -> tuple[Case, Any]:
    """The case and run(beta, linear_beta, profile_ids=None) of the SM90 W4A16 path:
    bf16 activations x MXFP4 weights (isWFP4A16Quant), weights and scales interleaved for
    the mixed-input GEMM."""
    _flashinfer_with_situ()
    from flashinfer import fused_moe
    from flashinfer.fused_moe.core import ActivationType

    case = make_case(shape, device)
    n_pad, k_pad = _round_up(shape.intermediate, 128), _round_up(shape.hidden, 128)
    ex = case.experts
    w13 = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(
        kernel_w13(ex.w13, shape.intermediate, n_pad, k_pad // 2), "fp4"
    )
    w2 = fused_moe.interleave_moe_weights_for_sm90_mixed_gemm(kernel_w2(ex.w2, k_pad, n_pad // 2), "fp4")
    s13 = fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(
        kernel_w13(ex.w13_scale, shape.intermediate, n_pad, k_pad // SF_BLOCK), group_size=SF_BLOCK
    )
    s2 = fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(
        kernel_w2(ex.w2_scale, k_pad, n_pad // SF_BLOCK), group_size=SF_BLOCK
    )
    x = torch.nn.functional.pad(case.x, (0, k_pad - shape.hidden))

    def run(beta: Optional[Any], linear_beta: Optional[Any],
            profile_ids: Optional[list[int]] = None) -> Any:
        out = torch.zeros(shape.tokens, k_pad, dtype=torch.bfloat16, device=device)
        fused_moe.cutlass_fused_moe(
            x,
            case.ids,
            case.weights,
            w13,
            w2,
            torch.bfloat16,
            quant_scales=[s13.view(torch.int32), s2.view(torch.int32)],
            use_w4_group_scaling=True,
            activation_type=ActivationType.Situ,
            output=out,
            situ_beta=beta,
            situ_linear_beta=linear_beta,
            profile_ids=profile_ids,
        )
        torch.cuda.synchronize()
        return out[:, : shape.hidden]

    return case, run


def _require_sm90_w4a16() -> None:
    if _capability()[0] == 9:
        # W4A16 (isWFP4A16Quant): bf16 activations x MXFP4 weights.
        require_cached_runner("fused_moe_90", "CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>")
    if _capability()[0] != 9:
        pytest.skip(f"SM90 W4A16 MXFP4 path; this GPU is sm{''.join(map(str, _capability()))}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s.experts}_N{s.intermediate}_K{s.hidden}")
def test_situ_mxfp4_w4a16_sm90(shape: MoeShape) -> None:
    device = _cuda()
    _require_sm90_w4a16()
    case, run = _w4a16_runner(shape, device)
    # bf16 activations: only the bf16 GEMM1 output / activation roundings differ.
    check_against_references(case, run, "SM90 bf16 x MXFP4", tolerance=3e-2)


def test_w4a16_unselected_tile_fails_by_name() -> None:
    """A cache whose selection keeps only some W4A16 tiles (gpu-test-sm90) defines the others'
    launchers as stubs: a tactic that picks one raises RuntimeError (TVM FFI error kind
    NotImplementedError, for which tvm-ffi registers no Python class) naming the kernel, its tile
    and the selection, and runs no other kernel. GEMM1 tactic 1 is CTA 64x16x128 with
    cluster 2x1x1 (get_candidate_configs_sm90: each weight-only tile at clusters 1x1x1, 2x1x1,
    1x2x1, 2x2x1, all swap_ab for the mixed-input GEMM), outside that selection."""
    device = _cuda()
    _require_sm90_w4a16()
    sel = (((installed_cache_meta() or {}).get("modules") or {}).get("fused_moe_90") or {}).get(
        "kernel_selection") or {}
    if not sel.get("stubbed_tiles"):
        pytest.skip("this cache compiles every W4A16 tile (its selection has no tile set)")
    _, run = _w4a16_runner(SHAPES[0], device)
    with pytest.raises(Exception, match=r"\(CTA 64x16x128, cluster 2x1x1\) is not compiled into "
                                        r"fused_moe_90: its tile is outside kernel selection "
                                        + re.escape(sel.get("name", ""))) as raised:
        run(None, None, profile_ids=[1, -1])
    # Exactly RuntimeError, as the docs say (not a subclass): the stub's TVM FFI kind is
    # NotImplementedError, which tvm-ffi maps to no Python class of its own.
    assert type(raised.value) is RuntimeError, type(raised.value)
    kind = getattr(getattr(raised.value, "__tvm_ffi_error__", None), "kind", None)
    assert kind == "NotImplementedError", kind


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s.experts}_N{s.intermediate}_K{s.hidden}")
def test_situ_mxfp8_mxfp4_sm120(shape: MoeShape) -> None:
    device = _cuda()
    if _capability()[0] == 12:
        require_cached_runner("fused_moe_120", "CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>")
        require_cached_module("mxfp8_quantization_sm100")  # flashinfer.mxfp8_quantize below
    if _capability()[0] != 12:
        pytest.skip(
            f"SM120-only MXFP8 x MXFP4 CUTLASS path; this GPU is sm{''.join(map(str, _capability()))}"
        )
    flashinfer = _flashinfer_with_situ()
    from flashinfer import fused_moe
    from flashinfer.fused_moe.core import ActivationType

    case = make_case(shape, device)
    n_pad, k_pad = _round_up(shape.intermediate, 128), _round_up(shape.hidden, 128)
    ex = case.experts
    w13 = kernel_w13(ex.w13, shape.intermediate, n_pad, k_pad // 2)
    w2 = kernel_w2(ex.w2, k_pad, n_pad // 2)
    s13_plain = kernel_w13(ex.w13_scale, shape.intermediate, n_pad, k_pad // SF_BLOCK)
    s2_plain = kernel_w2(ex.w2_scale, k_pad, n_pad // SF_BLOCK)
    s13 = flashinfer.block_scale_interleave(s13_plain).reshape_as(s13_plain)
    s2 = flashinfer.block_scale_interleave(s2_plain).reshape_as(s2_plain)
    global_scale = torch.ones(shape.experts, dtype=torch.float32, device=device)
    x = torch.nn.functional.pad(case.x, (0, k_pad - shape.hidden))
    x_q, x_sf = flashinfer.mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=32)

    def run(beta: Optional[Any], linear_beta: Optional[Any]) -> Any:
        out = torch.zeros(shape.tokens, k_pad, dtype=torch.bfloat16, device=device)
        fused_moe.cutlass_fused_moe(
            x_q,
            case.ids,
            case.weights,
            w13.view(torch.int64),
            w2.view(torch.int64),
            torch.bfloat16,
            quant_scales=[s13.view(torch.int32), global_scale, s2.view(torch.int32), global_scale],
            input_sf=x_sf,
            use_mxfp8_act_scaling=True,
            activation_type=ActivationType.Situ,
            output=out,
            situ_beta=beta,
            situ_linear_beta=linear_beta,
        )
        torch.cuda.synchronize()
        return out[:, : shape.hidden]

    # MXFP8 (e4m3, 3 mantissa bits) quantizes both GEMM inputs: a looser bound.
    check_against_references(case, run, "SM120 MXFP8 x MXFP4", tolerance=8e-2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
