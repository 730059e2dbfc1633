"""Run the SiTU regression checks against one unpacked SGLang tree (a subprocess per tree).

Usage: python3 harness.py --tree DIR --out RESULT.json [--real-flashinfer FLASHINFER_DIR]

DIR is an unpacked sglang wheel (DIR/sglang/srt/...), patched or not. Only the two modules
under test are imported for real (mxfp4.py and the FlashInfer CUTLASS MoE runner); every other
`sglang.*` module is a stub, and FlashInfer is a fake built here that records what reaches
`cutlass_fused_moe`. Each check records ok/detail instead of raising, so the caller can assert
"fails unpatched, passes patched" per check. A fresh interpreter per tree keeps the two copies
of `sglang` apart.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import traceback
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

MXFP4_MODULE = "sglang.srt.layers.quantization.mxfp4"
RUNNER_MODULE = "sglang.srt.layers.moe.moe_runner.flashinfer_cutlass"
REAL_MODULES = {
    MXFP4_MODULE: "sglang/srt/layers/quantization/mxfp4.py",
    RUNNER_MODULE: "sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py",
}
SF_BLOCK = 32  # MXFP4 / MXFP8 scale block
KIMI_SITU_BETA, KIMI_SITU_LINEAR_BETA = 3.5, 20.0  # non-default on purpose (defaults 4.0 / 25.0)


# --------------------------------------------------------------------------- stubs for sglang


class _Inert:
    """Stand-in for anything the checks never exercise: callable, chainable and falsy.

    Falsy so module-level probes such as `_is_hip = is_hip()` pick the plain CUDA branches.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> "_Inert":
        return self

    def __getattr__(self, name: str) -> "_Inert":
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __bool__(self) -> bool:
        return False

    def __iter__(self):
        return iter(())


INERT = _Inert()


class _Backend:
    """A MoE runner / a2a backend enum value: `is_<name>()` is true only for the enabled names."""

    def __init__(self, *enabled: str) -> None:
        self._enabled = set(enabled)

    def __getattr__(self, name: str) -> Callable[[], bool]:
        if not name.startswith("is_"):
            raise AttributeError(name)
        return lambda: name[3:] in self._enabled


class _Envs:
    """sglang.srt.environ.envs: every flag reads as False."""

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(get=lambda: False)


class MoeQuantInfo:
    """Plain base class: the real one is a dataclass marker without fields."""


@dataclasses.dataclass
class StandardCombineInput:
    hidden_states: torch.Tensor


@dataclasses.dataclass
class RunnerConfig:
    """The MoeRunnerConfig fields the code under test reads."""

    activation: str = "silu"
    is_gated: bool = True
    gemm1_alpha: Optional[float] = None
    gemm1_beta: Optional[float] = None
    gemm1_clamp_limit: Optional[float] = None
    swiglu_limit: Optional[float] = None
    gate_up_interleaved: bool = True
    routed_scaling_factor: Optional[float] = None
    apply_router_weight_on_input: bool = False
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    moe_ep_size: int = 1
    moe_ep_rank: int = 0


class _FusedMoEMethodBase:
    def __init__(self) -> None:
        pass


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


PLATFORM = SimpleNamespace(is_sm90=False, is_sm100=False, is_sm120=True)

OVERRIDES: dict[str, dict[str, Any]] = {
    "sglang.srt.runtime_context": {
        "get_platform": lambda: PLATFORM,
        "get_exec": lambda: SimpleNamespace(
            moe=SimpleNamespace(flashinfer_mxfp4_moe_precision="default")
        ),
        "get_parallel": lambda: SimpleNamespace(tp_group=None),
        "get_disagg": lambda: SimpleNamespace(disaggregation_mode="decode"),
        "get_schedule": lambda: SimpleNamespace(max_prefill_tokens=8192),
        "max_prefill_buffer_tokens": lambda: None,
    },
    "sglang.srt.layers.moe": {
        "get_moe_runner_backend": lambda: _Backend("flashinfer_mxfp4"),
        "get_moe_a2a_backend": lambda: _Backend(),
    },
    "sglang.srt.layers.moe.utils": {
        "get_moe_runner_backend": lambda: _Backend("flashinfer_mxfp4"),
        "get_moe_a2a_backend": lambda: _Backend(),
    },
    "sglang.srt.layers.quantization.base_config": {"FusedMoEMethodBase": _FusedMoEMethodBase},
    "sglang.srt.utils": {
        "is_flashinfer_available": lambda: True,
        "round_up": _round_up,
        "set_weight_attrs": lambda *args, **kwargs: None,
    },
    "sglang.srt.utils.common": {"next_power_of_2": _next_power_of_2, "is_sm120": lambda: True},
    "sglang.srt.distributed.device_communicators.pynccl_allocator": {
        "use_symmetric_memory": lambda *args, **kwargs: contextlib.nullcontext(),
    },
    "sglang.srt.layers.dp_attention": {"deployment_attn_dp_size": lambda: 1},
    "sglang.srt.environ": {"envs": _Envs()},
    "sglang.srt.layers.moe.moe_runner.base": {
        "MoeQuantInfo": MoeQuantInfo,
        "MoeRunnerConfig": RunnerConfig,
        "register_fused_func": lambda *keys: (lambda func: func),
    },
    "sglang.srt.layers.moe.token_dispatcher.standard": {
        "StandardCombineInput": StandardCombineInput,
    },
    "sglang.srt.layers.moe.topk": {
        "TopKOutputChecker": SimpleNamespace(format_is_bypassed=lambda topk_output: False),
    },
}


class _StubModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so any submodule resolves to a stub too
        self.__dict__.update(OVERRIDES.get(name, {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        # CamelCase names are used as base classes and in isinstance checks: give real classes.
        value: Any = type(name, (), {}) if name[:1].isupper() else INERT
        setattr(self, name, value)
        return value


class _SglangFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Real files for the modules under test, stubs for the rest of `sglang`."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname in REAL_MODULES:
            return importlib.util.spec_from_file_location(fullname, self.tree / REAL_MODULES[fullname])
        if fullname == "sglang" or fullname.startswith("sglang."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# --------------------------------------------------------------------------- fake FlashInfer


class ActivationType(enum.IntEnum):
    """FlashInfer's enum (flashinfer/tllm_enums.py): 0.6.18 already has Situ for trtllm-gen."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


ActivationTypeWithoutSitu = enum.IntEnum(
    "ActivationType", [(m.name, m.value) for m in ActivationType if m.name != "Situ"]
)

CALLS: list[dict[str, Any]] = []
INTERLEAVE_INPUTS: list[torch.Tensor] = []
MXFP8_INPUTS: list[torch.Tensor] = []


def _record(kwargs: dict[str, Any]) -> torch.Tensor:
    CALLS.append(kwargs)
    kwargs["output"].zero_()  # deterministic bytes for the call summaries
    return kwargs["output"]


def cutlass_fused_moe_with_situ(
    input, token_selected_experts, token_final_scales, fc1_expert_weights,
    fc2_expert_weights, output_dtype, quant_scales, fc1_expert_biases=None,
    fc2_expert_biases=None, input_sf=None, swiglu_alpha=None, swiglu_beta=None,
    swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, cluster_size=1,
    cluster_rank=0, output=None, enable_alltoall=False, use_deepseek_fp8_block_scale=False,
    use_w4_group_scaling=False, use_mxfp8_act_scaling=False, min_latency_mode=False,
    use_packed_weights=False, use_wfp4afp8_humming=False, tune_max_num_tokens=8192,
    enable_pdl=None, activation_type=ActivationType.Swiglu, swizzled_input_sf=True,
    use_fused_finalize=True, profile_ids=None, workspace_buffer=None, *,
    situ_beta=None, situ_linear_beta=None,
):  # fmt: skip
    """Signature of FlashInfer >= 0.7 / 0.6.18 + #4460: SiTU scales are keyword-only."""
    return _record(dict(locals()))


def cutlass_fused_moe_without_situ(
    input, token_selected_experts, token_final_scales, fc1_expert_weights,
    fc2_expert_weights, output_dtype, quant_scales, fc1_expert_biases=None,
    fc2_expert_biases=None, input_sf=None, swiglu_alpha=None, swiglu_beta=None,
    swiglu_limit=None, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, cluster_size=1,
    cluster_rank=0, output=None, enable_alltoall=False, use_deepseek_fp8_block_scale=False,
    use_w4_group_scaling=False, use_mxfp8_act_scaling=False, min_latency_mode=False,
    use_packed_weights=False, use_wfp4afp8_humming=False, tune_max_num_tokens=8192,
    enable_pdl=None, activation_type=ActivationType.Swiglu, swizzled_input_sf=True,
    use_fused_finalize=True, profile_ids=None, workspace_buffer=None,
):  # fmt: skip
    """Signature of FlashInfer 0.6.18 without #4460."""
    return _record(dict(locals()))


def mxfp8_quantize(x: torch.Tensor, is_sf_swizzled_layout: bool = True, alignment: int = 32):
    # FlashInfer's quantizer CHECK_CONTIGUOUS-es its input (tensorrt_llm/thop/fp8Quantize.cpp).
    if not x.is_contiguous():
        raise RuntimeError("mxfp8_quantize: input must be contiguous")
    MXFP8_INPUTS.append(x)
    # The "quantized" rows stay in the input dtype so the emulator below can reuse them.
    return x.clone(), torch.full((x.numel() // SF_BLOCK,), 127, dtype=torch.uint8)


def block_scale_interleave(scale: torch.Tensor) -> torch.Tensor:
    # Identity stand-in for the 128x4 swizzle: the checks compare what SGLang feeds it.
    INTERLEAVE_INPUTS.append(scale.clone())
    return scale.clone().reshape(-1)


def _identity_weights(weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return weights.clone()


def install_fake_flashinfer() -> None:
    flashinfer = types.ModuleType("flashinfer")
    fused_moe = types.ModuleType("flashinfer.fused_moe")
    core = types.ModuleType("flashinfer.fused_moe.core")
    flashinfer.__path__ = []
    fused_moe.__path__ = []
    flashinfer.fused_moe = fused_moe
    fused_moe.core = core
    flashinfer.mxfp8_quantize = mxfp8_quantize
    flashinfer.block_scale_interleave = block_scale_interleave
    flashinfer.nvfp4_block_scale_interleave = block_scale_interleave
    core.get_w2_permute_indices_with_cache = INERT
    fused_moe.interleave_moe_weights_for_sm90_mixed_gemm = _identity_weights
    fused_moe.interleave_moe_scales_for_sm90_mixed_gemm = _identity_weights
    sys.modules.update(
        {"flashinfer": flashinfer, "flashinfer.fused_moe": fused_moe, "flashinfer.fused_moe.core": core}
    )
    use_flashinfer_api("situ")


def use_flashinfer_api(kind: str) -> None:
    """`situ`: has #4460; `old`: 0.6.18 signature; `noenum`: signature but no enum member."""
    fused_moe = sys.modules["flashinfer.fused_moe"]
    core = sys.modules["flashinfer.fused_moe.core"]
    fused_moe.cutlass_fused_moe = (
        cutlass_fused_moe_without_situ if kind == "old" else cutlass_fused_moe_with_situ
    )
    core.ActivationType = ActivationTypeWithoutSitu if kind == "noenum" else ActivationType


# --------------------------------------------------------------------------- model fixtures

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class Shape:
    experts: int
    intermediate: int  # N per partition, unpadded
    hidden: int  # K, unpadded


# Kimi-like, scaled down: one needs no padding, one pads both N and K, one pads N only.
KIMI_SHAPES = (Shape(3, 256, 256), Shape(4, 192, 320), Shape(2, 96, 128))


@dataclasses.dataclass
class Checkpoint:
    w13: torch.Tensor  # uint8 [E, 2N, K/2]
    w13_scale: torch.Tensor  # uint8 E8M0 [E, 2N, K/32]
    w2: torch.Tensor  # uint8 [E, K, N/2]
    w2_scale: torch.Tensor  # uint8 [E, K, N/32]
    w13_bias: Optional[torch.Tensor]  # bf16 [E, 2N]
    w2_bias: Optional[torch.Tensor]  # bf16 [E, K]


def make_checkpoint(shape: Shape, with_bias: bool, seed: int) -> Checkpoint:
    gen = torch.Generator().manual_seed(seed)
    e, n, k = shape.experts, shape.intermediate, shape.hidden

    def scales(*size: int) -> torch.Tensor:
        # Exponents near 2^0 keep the float64 reference well conditioned.
        return torch.randint(122, 130, size, generator=gen, dtype=torch.uint8)

    def bias(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(torch.bfloat16)

    return Checkpoint(
        w13=torch.randint(0, 256, (e, 2 * n, k // 2), generator=gen, dtype=torch.uint8),
        w13_scale=scales(e, 2 * n, k // SF_BLOCK),
        w2=torch.randint(0, 256, (e, k, n // 2), generator=gen, dtype=torch.uint8),
        w2_scale=scales(e, k, n // SF_BLOCK),
        w13_bias=bias(e, 2 * n) if with_bias else None,
        w2_bias=bias(e, k) if with_bias else None,
    )


def kimi_config() -> RunnerConfig:
    # KimiK3MoE passes activation_situ_beta / _linear_beta as gemm1_alpha / gemm1_clamp_limit.
    return RunnerConfig(
        activation="situ",
        gemm1_alpha=KIMI_SITU_BETA,
        gemm1_clamp_limit=KIMI_SITU_LINEAR_BETA,
        gate_up_interleaved=False,
    )


def gptoss_config() -> RunnerConfig:
    return RunnerConfig(activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0)


def build_layer(mxfp4: Any, shape: Shape, config: RunnerConfig, ckpt: Checkpoint):
    """create_weights + a naive-copy load (what FusedMoE's MXFP4 fast path does)."""
    method = mxfp4.Mxfp4MoEMethod(prefix="model.layers.1.mlp.experts")
    layer = torch.nn.Module()
    layer.num_experts = layer.num_local_experts = shape.experts
    layer.hidden_size = shape.hidden
    layer.intermediate_size_per_partition = shape.intermediate
    layer.moe_tp_size, layer.moe_tp_rank, layer.moe_ep_size, layer.moe_ep_rank = 1, 0, 1, 0
    layer.moe_runner_config = config
    method.create_weights(
        layer,
        num_experts=shape.experts,
        hidden_size=shape.hidden,
        intermediate_size_per_partition=shape.intermediate,
        params_dtype=torch.bfloat16,
        with_bias=ckpt.w13_bias is not None,
    )
    layer.w13_weight.data.copy_(ckpt.w13)
    layer.w13_weight_scale.data.copy_(ckpt.w13_scale)
    layer.w2_weight.data.copy_(ckpt.w2)
    layer.w2_weight_scale.data.copy_(ckpt.w2_scale)
    if ckpt.w13_bias is not None:
        layer.w13_weight_bias.data.copy_(ckpt.w13_bias)
        layer.w2_weight_bias.data.copy_(ckpt.w2_bias)
    method.moe_runner_config = config  # create_moe_runner's job

    runner = mxfp4_runner_module()

    class _Runner:
        def run(self, dispatch_output: Any, quant_info: Any) -> Any:
            return runner.fused_experts_none_to_flashinfer_mxfp4(dispatch_output, quant_info, config)

    method.runner = _Runner()
    return method, layer


def mxfp4_runner_module() -> Any:
    return sys.modules[RUNNER_MODULE]


def dispatch(x: torch.Tensor, experts: int, top_k: int, seed: int) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(x.shape[0])])
    weights = torch.rand(x.shape[0], top_k, generator=gen, dtype=torch.float32)
    topk = SimpleNamespace(topk_ids=ids.to(torch.int32), topk_weights=weights)
    return SimpleNamespace(hidden_states=x, topk_output=topk)


def hidden_states(tokens: int, hidden: int, seed: int, contiguous: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    # A column slice of a wider GEMM output, like KimiK3MoE's fused-front split.
    wide = torch.randn(tokens, hidden + 64, generator=gen).to(torch.bfloat16)
    return wide[:, 64:]


# --------------------------------------------------------------------------- references


def padded(shape: Shape) -> tuple[int, int]:
    return _round_up(shape.intermediate, 128), _round_up(shape.hidden, 128)


def reference_kernel_w13(rows: torch.Tensor, shape: Shape, interleaved: bool, cols: int) -> torch.Tensor:
    """The kernel's fc1 layout, built row by row: [up (padded to N_pad); gate (padded)]."""
    n = shape.intermediate
    n_pad, _ = padded(shape)
    out = torch.zeros(rows.shape[0], 2 * n_pad, cols, dtype=rows.dtype)
    for e in range(rows.shape[0]):
        for i in range(n):
            gate_row, up_row = (2 * i, 2 * i + 1) if interleaved else (i, n + i)
            out[e, i, : rows.shape[2]] = rows[e, up_row]
            out[e, n_pad + i, : rows.shape[2]] = rows[e, gate_row]
    return out


def reference_kernel_w2(rows: torch.Tensor, shape: Shape, cols: int) -> torch.Tensor:
    _, k_pad = padded(shape)
    out = torch.zeros(rows.shape[0], k_pad, cols, dtype=rows.dtype)
    out[:, : rows.shape[1], : rows.shape[2]] = rows
    return out


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 [.., R, C/2] e2m1 pairs (low nibble first) + uint8 E8M0 [.., R, C/32] -> float64."""
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    nibbles = torch.stack([low, high], dim=-1).flatten(-2)
    values = E2M1_VALUES[nibbles & 0x7] * torch.where(nibbles >= 8, -1.0, 1.0).double()
    factors = torch.pow(2.0, scale.double() - 127.0).repeat_interleave(SF_BLOCK, dim=-1)
    return values * factors


def situ(gate: torch.Tensor, up: torch.Tensor, beta: Any, linear_beta: Any) -> torch.Tensor:
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        linear_beta * torch.tanh(up / linear_beta)
    )


def kimi_reference_moe(ckpt: Checkpoint, x: torch.Tensor, topk: SimpleNamespace, n: int) -> torch.Tensor:
    """Kimi-K3 experts straight from the checkpoint layout: w13 = [w1 (gate); w3 (up)]."""
    w13 = dequant_mxfp4(ckpt.w13, ckpt.w13_scale)
    w2 = dequant_mxfp4(ckpt.w2, ckpt.w2_scale)
    xs = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(topk.topk_ids.shape[1]):
            e = int(topk.topk_ids[t, slot])
            gate, up = w13[e, :n] @ xs[t], w13[e, n:] @ xs[t]
            act = situ(gate, up, KIMI_SITU_BETA, KIMI_SITU_LINEAR_BETA)
            out[t] += float(topk.topk_weights[t, slot]) * (w2[e] @ act)
    return out


def emulate_cutlass_call(call: dict[str, Any], activation_enum: Any) -> torch.Tensor:
    """What FlashInfer's CUTLASS MXFP4 MoE computes from the recorded arguments.

    fc1 rows are [linear (up); gate] halves (cutlass_fused_moe_kernels.cuh reads the gate at
    offset inter_size); the scales are the pre-swizzle tensors (the fake swizzle is identity).
    """
    w13 = call["fc1_expert_weights"].view(torch.uint8)
    w2 = call["fc2_expert_weights"].view(torch.uint8)
    s13 = call["quant_scales"][0].view(torch.uint8).reshape(w13.shape[0], w13.shape[1], -1)
    s2 = call["quant_scales"][2].view(torch.uint8).reshape(w2.shape[0], w2.shape[1], -1)
    w13f, w2f = dequant_mxfp4(w13, s13), dequant_mxfp4(w2, s2)
    n_pad = w13f.shape[1] // 2
    x = call["input"].double()
    ids, weights = call["token_selected_experts"], call["token_final_scales"]
    is_situ = int(call["activation_type"]) == int(getattr(activation_enum, "Situ", -1))
    out = torch.zeros(x.shape[0], w2f.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = w13f[e] @ x[t]
            if call["fc1_expert_biases"] is not None:
                h = h + call["fc1_expert_biases"][e].double()
            up, gate = h[:n_pad], h[n_pad:]
            if is_situ:
                act = situ(gate, up, float(call["situ_beta"][e]), float(call["situ_linear_beta"][e]))
            else:  # plain SwiGLU; enough to show a SiTU model computed the wrong thing
                act = gate * torch.sigmoid(gate) * up
            out[t] += float(weights[t, slot]) * (w2f[e] @ act)
    return out


# --------------------------------------------------------------------------- checks


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def fresh_records() -> None:
    CALLS.clear()
    INTERLEAVE_INPUTS.clear()
    MXFP8_INPUTS.clear()


def check_sm120_kimi_layout(mxfp4: Any) -> str:
    for index, shape in enumerate(KIMI_SHAPES):
        fresh_records()
        ckpt = make_checkpoint(shape, with_bias=False, seed=index)
        method, layer = build_layer(mxfp4, shape, kimi_config(), ckpt)
        method.process_weights_after_loading(layer)
        n_pad, k_pad = padded(shape)
        want_w13 = reference_kernel_w13(ckpt.w13, shape, interleaved=False, cols=k_pad // 2)
        want_s13 = reference_kernel_w13(ckpt.w13_scale, shape, interleaved=False, cols=k_pad // SF_BLOCK)
        want_w2 = reference_kernel_w2(ckpt.w2, shape, cols=n_pad // 2)
        want_s2 = reference_kernel_w2(ckpt.w2_scale, shape, cols=n_pad // SF_BLOCK)
        tag = f"{shape}"
        expect(torch.equal(layer.w13_weight.data, want_w13), f"{tag}: w13 is not [up; gate] padded")
        expect(torch.equal(layer.w2_weight.data, want_w2), f"{tag}: w2 is not padded to {want_w2.shape}")
        expect(len(INTERLEAVE_INPUTS) == 2, f"{tag}: block_scale_interleave ran {len(INTERLEAVE_INPUTS)}x")
        expect(torch.equal(INTERLEAVE_INPUTS[0], want_s13), f"{tag}: w13 E8M0 scales not [up; gate] padded")
        expect(torch.equal(INTERLEAVE_INPUTS[1], want_s2), f"{tag}: w2 E8M0 scales not padded")
        expect(layer.w13_weight_bias is None and layer.w2_weight_bias is None, f"{tag}: Kimi got biases")
    return f"{len(KIMI_SHAPES)} shapes match the reference layout, no biases"


def run_kimi_forward(mxfp4: Any, shape: Shape, contiguous: bool = True):
    fresh_records()
    ckpt = make_checkpoint(shape, with_bias=False, seed=7)
    method, layer = build_layer(mxfp4, shape, kimi_config(), ckpt)
    method.process_weights_after_loading(layer)
    x = hidden_states(5, shape.hidden, seed=8, contiguous=contiguous)
    disp = dispatch(x, shape.experts, top_k=2, seed=9)
    out = method.apply(layer, disp).hidden_states
    expect(len(CALLS) == 1, f"cutlass_fused_moe called {len(CALLS)}x")
    return ckpt, x, disp, out, CALLS[0]


def check_sm120_kimi_kernel_args(mxfp4: Any) -> str:
    shape = KIMI_SHAPES[1]
    _, x, _, out, call = run_kimi_forward(mxfp4, shape)
    e = shape.experts
    n_pad, k_pad = padded(shape)
    act = call["activation_type"]
    expect(act == ActivationType.Situ and int(act) == 10, f"activation_type is {act!r}, not Situ (10)")
    for name, value in (("situ_beta", KIMI_SITU_BETA), ("situ_linear_beta", KIMI_SITU_LINEAR_BETA)):
        t = call[name]
        expect(isinstance(t, torch.Tensor), f"{name} is {type(t).__name__}, not a tensor")
        expect(t.dtype == torch.float32, f"{name} dtype {t.dtype}")
        expect(tuple(t.shape) == (e,), f"{name} shape {tuple(t.shape)} != ({e},)")
        expect(t.is_contiguous() and t.device == x.device, f"{name} not contiguous on {x.device}")
        expect(torch.all(t == value).item(), f"{name} = {t.tolist()}, config says {value}")
    for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit", "fc1_expert_biases", "fc2_expert_biases"):
        expect(call[name] is None, f"{name} passed to a SiTU call")
    w1, w2 = call["fc1_expert_weights"], call["fc2_expert_weights"]
    expect(w1.dtype == torch.int64 and w1.is_contiguous(), f"fc1 weights {w1.dtype}")
    expect(tuple(w1.shape) == (e, 2 * n_pad, k_pad // 2 // 8), f"fc1 weights shape {tuple(w1.shape)}")
    expect(tuple(w2.shape) == (e, k_pad, n_pad // 2 // 8), f"fc2 weights shape {tuple(w2.shape)}")
    scales = call["quant_scales"]
    expect(len(scales) == 4 and scales[0].dtype == torch.int32, "quant_scales not [w13 sf, g, w2 sf, g]")
    expect(call["use_mxfp8_act_scaling"] is True and call["use_w4_group_scaling"] is False, "not MXFP8xMXFP4")
    expect(call["input_sf"] is not None and call["input"].shape == (x.shape[0], k_pad), "input not MXFP8")
    expect(tuple(out.shape) == tuple(x.shape), f"output {tuple(out.shape)} != {tuple(x.shape)}")
    return "Situ + fp32 [E] keyword-only betas from the config, no SwiGLU params, no biases"


def check_sm120_kimi_semantics(mxfp4: Any) -> str:
    worst = 0.0
    for shape in KIMI_SHAPES:
        ckpt, x, disp, _, call = run_kimi_forward(mxfp4, shape)
        want = kimi_reference_moe(ckpt, x, disp.topk_output, shape.intermediate)
        got = emulate_cutlass_call(call, ActivationType)[:, : shape.hidden]
        rel = float((got - want).norm() / want.norm())
        worst = max(worst, rel)
        expect(rel < 1e-9, f"{shape}: kernel would compute rel. error {rel:.3e} vs the SiTU reference")
    return f"emulated kernel == checkpoint SiTU reference, worst rel. error {worst:.1e}"


def check_noncontiguous_hidden_states(mxfp4: Any) -> str:
    shape = Shape(2, 128, 256)  # K already aligned: no pad copy hides the strided view
    fresh_records()
    ckpt = make_checkpoint(shape, with_bias=True, seed=3)
    method, layer = build_layer(mxfp4, shape, gptoss_config(), ckpt)
    method.process_weights_after_loading(layer)
    x = hidden_states(4, shape.hidden, seed=4, contiguous=False)
    expect(not x.is_contiguous(), "fixture should be strided")
    method.apply(layer, dispatch(x, shape.experts, top_k=2, seed=5))
    expect(len(MXFP8_INPUTS) == 1 and torch.equal(MXFP8_INPUTS[0], x), "quantizer saw other rows")
    return "strided hidden states reach mxfp8_quantize as a dense copy"


def _expect_4460_error(mxfp4: Any, api: str) -> str:
    use_flashinfer_api(api)
    try:
        run_kimi_forward(mxfp4, KIMI_SHAPES[0])
    except CheckFailed:
        raise
    except Exception as error:  # the patched code raises RuntimeError; any type names it
        expect("#4460" in str(error), f"error does not name FlashInfer #4460: {error}")
        return f"{type(error).__name__}: {error}"
    finally:
        use_flashinfer_api("situ")
    activation = CALLS[0]["activation_type"] if CALLS else None
    raise CheckFailed(f"no error; the SiTU model ran with activation {activation!r}")


def check_missing_4460_old_signature(mxfp4: Any) -> str:
    return _expect_4460_error(mxfp4, "old")


def check_missing_4460_no_enum(mxfp4: Any) -> str:
    return _expect_4460_error(mxfp4, "noenum")


def check_situ_without_params_refused(mxfp4: Any) -> str:
    """A SiTU layer whose quant info lacks the betas must not run as SwiGLU."""
    runner = mxfp4_runner_module()
    fresh_records()
    shape = KIMI_SHAPES[0]
    n_pad, k_pad = padded(shape)
    e = shape.experts
    quant_info = runner.FlashInferCutlassMxfp4MoeQuantInfo(
        w13_weight=torch.zeros(e, 2 * n_pad, k_pad // 2, dtype=torch.uint8),
        w2_weight=torch.zeros(e, k_pad, n_pad // 2, dtype=torch.uint8),
        w13_weight_scale=torch.zeros(e, 2 * n_pad, k_pad // SF_BLOCK, dtype=torch.uint8),
        w2_weight_scale=torch.zeros(e, k_pad, n_pad // SF_BLOCK, dtype=torch.uint8),
        mxfp4_weight_global_scale=torch.ones(e),
    )
    x = hidden_states(3, shape.hidden, seed=1)
    try:
        runner.fused_experts_none_to_flashinfer_mxfp4(dispatch(x, e, 2, seed=2), quant_info, kimi_config())
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    raise CheckFailed(f"ran with activation {CALLS[0]['activation_type']!r}")


def check_sm90_kimi_situ(mxfp4: Any) -> str:
    PLATFORM.is_sm90, PLATFORM.is_sm120 = True, False
    try:
        shape = KIMI_SHAPES[1]
        _, _, _, _, call = run_kimi_forward(mxfp4, shape)
    finally:
        PLATFORM.is_sm90, PLATFORM.is_sm120 = False, True
    expect(call["use_w4_group_scaling"] is True, "SM90 should run W4A16 group scaling")
    expect(call["activation_type"] == ActivationType.Situ, f"activation_type {call['activation_type']!r}")
    expect(call["situ_beta"] is not None and torch.all(call["situ_beta"] == KIMI_SITU_BETA).item(), "situ_beta")
    expect(call["swiglu_alpha"] is None and call["swiglu_limit"] is None, "SwiGLU params on a SiTU call")
    return "SM90 W4A16 path passes Situ with the config's betas"


def check_gptoss_sm120_layout(mxfp4: Any) -> str:
    shape = Shape(3, 192, 320)
    fresh_records()
    ckpt = make_checkpoint(shape, with_bias=True, seed=11)
    method, layer = build_layer(mxfp4, shape, gptoss_config(), ckpt)
    method.process_weights_after_loading(layer)
    n_pad, k_pad = padded(shape)
    want_w13 = reference_kernel_w13(ckpt.w13, shape, interleaved=True, cols=k_pad // 2)
    want_s13 = reference_kernel_w13(ckpt.w13_scale, shape, interleaved=True, cols=k_pad // SF_BLOCK)
    want_b13 = reference_kernel_w13(ckpt.w13_bias.unsqueeze(-1), shape, interleaved=True, cols=1)[..., 0]
    expect(torch.equal(layer.w13_weight.data, want_w13), "w13 not de-interleaved to [up; gate]")
    expect(torch.equal(INTERLEAVE_INPUTS[0], want_s13), "w13 scales not de-interleaved")
    expect(torch.equal(layer.w13_weight_bias.data, want_b13), "w13 bias not de-interleaved")
    expect(torch.equal(layer.w2_weight_bias.data[:, : shape.hidden], ckpt.w2_bias), "w2 bias")
    for name, value in (("swiglu_alpha", 1.702), ("swiglu_beta", 1.0), ("swiglu_limit", 7.0)):
        expect(torch.allclose(getattr(layer, name).data, torch.full((3,), value)), f"{name} changed")
    return "GPT-OSS interleaved layout, biases and SwiGLU params as before"


# --------------------------------------------------------------------------- call summaries


def summarize(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        digest = hashlib.sha256(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return {"dtype": str(value.dtype), "shape": list(value.shape), "sha256": digest.hexdigest()[:16]}
    if isinstance(value, (list, tuple)):
        return [summarize(v) for v in value]
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def gptoss_call_summary(mxfp4: Any, api: str) -> dict[str, Any]:
    """Every argument of the GPT-OSS SM120 call, to diff unpatched against patched."""
    use_flashinfer_api(api)
    try:
        shape = Shape(3, 192, 320)
        fresh_records()
        ckpt = make_checkpoint(shape, with_bias=True, seed=21)
        method, layer = build_layer(mxfp4, shape, gptoss_config(), ckpt)
        method.process_weights_after_loading(layer)
        out = method.apply(layer, dispatch(hidden_states(6, shape.hidden, seed=22), 3, 2, seed=23))
        summary = {k: summarize(v) for k, v in CALLS[0].items()}
        summary["<returned>"] = summarize(out.hidden_states)
        return summary
    finally:
        use_flashinfer_api("situ")


def swiglu_step_call_summary(mxfp4: Any) -> dict[str, Any]:
    """A SwigluStep caller (Bailing-style quant info) straight through the runner."""
    runner = mxfp4_runner_module()
    fresh_records()
    shape = Shape(2, 128, 256)
    ckpt = make_checkpoint(shape, with_bias=False, seed=31)
    quant_info = runner.FlashInferCutlassMxfp4MoeQuantInfo(
        w13_weight=ckpt.w13,
        w2_weight=ckpt.w2,
        w13_weight_scale=ckpt.w13_scale,
        w2_weight_scale=ckpt.w2_scale,
        mxfp4_weight_global_scale=torch.ones(2),
        use_swiglu_step=True,
    )
    x = hidden_states(3, shape.hidden, seed=32)
    runner.fused_experts_none_to_flashinfer_mxfp4(dispatch(x, 2, 1, seed=33), quant_info, RunnerConfig())
    return {k: summarize(v) for k, v in CALLS[0].items()}


FIX_CHECKS: dict[str, Callable[[Any], str]] = {
    "sm120_kimi_layout": check_sm120_kimi_layout,
    "sm120_kimi_kernel_args": check_sm120_kimi_kernel_args,
    "sm120_kimi_semantics": check_sm120_kimi_semantics,
    "noncontiguous_hidden_states": check_noncontiguous_hidden_states,
    "missing_4460_old_signature": check_missing_4460_old_signature,
    "missing_4460_no_enum": check_missing_4460_no_enum,
    "situ_without_params_refused": check_situ_without_params_refused,
    "sm90_kimi_situ": check_sm90_kimi_situ,
}
INVARIANT_CHECKS: dict[str, Callable[[Any], str]] = {
    "gptoss_sm120_layout": check_gptoss_sm120_layout,
}


def run_check(func: Callable[[Any], Any], mxfp4: Any) -> dict[str, Any]:
    try:
        return {"ok": True, "detail": func(mxfp4)}
    except CheckFailed as failure:
        return {"ok": False, "detail": str(failure)}
    except Exception as error:  # an unpatched tree may crash anywhere: that is a failed check
        tail = traceback.format_exc().strip().splitlines()[-3:]
        return {"ok": False, "detail": f"{type(error).__name__}: {error} | {' / '.join(tail)}"}


def probe_real_flashinfer(flashinfer_dir: Path) -> dict[str, Any]:
    """Run the patched capability check against a real FlashInfer (its Python files suffice)."""
    sys.path.insert(0, str(flashinfer_dir))
    flashinfer = importlib.import_module("flashinfer")
    runner = importlib.import_module(RUNNER_MODULE)
    result: dict[str, Any] = {"version": flashinfer.__version__}
    try:
        runner.require_flashinfer_cutlass_situ()
        result.update(supported=True, detail="accepted")
    except Exception as error:
        result.update(supported=False, detail=f"{type(error).__name__}: {error}")
    return result


def write_json(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
    tmp.rename(path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="unpacked sglang wheel")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument(
        "--real-flashinfer", type=Path, help="only probe this unpacked FlashInfer's SiTU API"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    sys.meta_path.insert(0, _SglangFinder(args.tree.resolve()))
    if args.real_flashinfer:
        write_json(args.out, probe_real_flashinfer(args.real_flashinfer.resolve()))
        return 0
    install_fake_flashinfer()
    mxfp4 = importlib.import_module(MXFP4_MODULE)
    importlib.import_module(RUNNER_MODULE)
    result: dict[str, Any] = {
        "fix": {name: run_check(func, mxfp4) for name, func in FIX_CHECKS.items()},
        "invariant": {name: run_check(func, mxfp4) for name, func in INVARIANT_CHECKS.items()},
        "calls": {},
    }
    for name, producer in (
        ("gptoss_flashinfer_with_situ", lambda: gptoss_call_summary(mxfp4, "situ")),
        ("gptoss_flashinfer_0618", lambda: gptoss_call_summary(mxfp4, "old")),
        ("swiglu_step", lambda: swiglu_step_call_summary(mxfp4)),
    ):
        try:
            result["calls"][name] = producer()
        except Exception as error:
            result["calls"][name] = {"<error>": f"{type(error).__name__}: {error}"}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
