"""The SGLang JIT modules of jit_cache/sglang_modules.json called on a GPU through SGLang's own entry
points (the functions Kimi-K3's layers call), each with a float64 reference written here from the
kernel's documented formula. Shared by tests/gpu/test_sglang_jit_gpu.py (0 compiles, outputs within
tolerance) and tools/gpu_suite/first_call.py (first-call times with and without the shipped cache).

SGLang is imported without running `sglang/__init__.py` (the frontend language API and the
transformers patches, whose imports are not on the kernels' path and not in the bundle): the
package object is made from its directory, then `sglang.kernels.ops...` imports as usual.

A compile is counted where SGLang's loader runs its ninja build; a hit where its prebuilt lookup
returns a leaf (both wrapped for counting only, the calls go through).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types
from typing import Any, Callable

# SiTU constants Kimi-K3's config gives (sglang/srt/layers/activation.py SiTUAndMul defaults).
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0
KDA_HEAD = 128
KDA_CONV_TAPS = 3  # kernel width 4: three cached tokens
KDA_LOWER_BOUND = -5.0  # Kimi-K3's linear_attn_config gate_lower_bound


def import_sglang() -> types.ModuleType:
    """The `sglang` package without its __init__ (see the module docstring)."""
    if "sglang" in sys.modules:
        return sys.modules["sglang"]
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not importable: unpack the bundle's SGLang wheel onto sys.path")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = None
    sys.modules["sglang"] = package
    return package


@dataclasses.dataclass
class LoaderCounts:
    compiles: list[str] = dataclasses.field(default_factory=list)
    hits: list[str] = dataclasses.field(default_factory=list)
    misses: list[str] = dataclasses.field(default_factory=list)


def count_loader() -> LoaderCounts:
    """Wrap SGLang's JIT loader's build and prebuilt lookup to count them."""
    import_sglang()
    loader = importlib.import_module("sglang.kernels.jit.utils.compile.loader")
    ninja = importlib.import_module("sglang.kernels.jit.utils.compile.ninja")
    counts = LoaderCounts()
    build, find = ninja.build, loader._find_prebuilt

    def counted_build(*, spec: Any, **kwargs: Any) -> Any:
        counts.compiles.append(spec.module_name)
        return build(spec=spec, **kwargs)

    def counted_find(*, spec: Any, scope: Any) -> Any:
        leaf = find(spec=spec, scope=scope)
        (counts.hits if leaf is not None else counts.misses).append(spec.module_name)
        return leaf

    ninja.build, loader._find_prebuilt = counted_build, counted_find
    return counts


def environment_fingerprint() -> str:
    import_sglang()
    return importlib.import_module("sglang.kernels.jit.utils.compile.cache")._environment_fingerprint()


def keyed_distributions() -> dict[str, str]:
    """{distribution: version or "absent"} as SGLang's build key reads them here."""
    from importlib.metadata import PackageNotFoundError, version

    import_sglang()
    cache = importlib.import_module("sglang.kernels.jit.utils.compile.cache")
    seen = {}
    for name in cache._VERSIONED_PACKAGES:
        try:
            seen[name] = version(name)
        except (PackageNotFoundError, ValueError):
            seen[name] = "absent"
    return seen


Outputs = dict[str, tuple[Any, Any]]  # {what: (got, float64 reference)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    module: str  # the JIT module's name as SGLang builds it (the manifest's "module")
    # device -> (call, finish): call() is SGLang's entry point on prepared inputs (what a first
    # call times), finish(result) pairs its outputs with the reference computed beforehand.
    setup: Callable[[Any], tuple[Callable[[], Any], Callable[[Any], Outputs]]]
    tolerance: float  # on max|got - ref| / max|ref| per output

    def run(self, device: Any) -> Outputs:
        call, finish = self.setup(device)
        return finish(call())


def _rel(got: Any, ref: Any) -> float:
    import torch

    diff = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    return diff / scale if torch.isfinite(got.double()).all() else float("inf")


def relative_errors(outputs: dict[str, tuple[Any, Any]]) -> dict[str, float]:
    return {what: _rel(got, ref) for what, (got, ref) in outputs.items()}


def _situ(device: Any, tokens: int = 77, hidden: int = 2048) -> tuple[Callable[[], Any], Callable[[Any], Outputs]]:
    import torch

    import_sglang()
    op = importlib.import_module("sglang.kernels.ops.activation.kimi_k3_situ_and_mul")
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(tokens, 2 * hidden, generator=gen) * 3).to(torch.bfloat16).to(device)
    x64 = x.double()
    gate, up = x64[:, :hidden], x64[:, hidden:]
    ref = (SITU_BETA * torch.tanh(gate / SITU_BETA) * torch.sigmoid(gate)
           * SITU_LINEAR_BETA * torch.tanh(up / SITU_LINEAR_BETA))
    return (lambda: op.situ_and_mul(x, None, SITU_BETA, SITU_LINEAR_BETA)), (lambda out: {"out": (out, ref)})


def _mla_output_gate(device: Any, tokens: int = 33, width: int = 64 * 128) -> tuple[Callable[[], Any], Callable[[Any], Outputs]]:
    import torch

    import_sglang()
    op = importlib.import_module("sglang.kernels.ops.elementwise.mla_output_gate")
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, width, generator=gen).to(torch.bfloat16).to(device)
    gate = (torch.randn(tokens, width, generator=gen) * 2).to(torch.bfloat16).to(device)
    assert op.covered(x, gate)
    ref = x.double() * torch.sigmoid(gate.double())
    return (lambda: op.kimi_k3_mla_output_gate(x, gate)), (lambda out: {"out": (out, ref)})


def kda_reference(mixed_qkv: Any, a: Any, b: Any, conv_states: Any, w_q_t: Any, w_k_t: Any, w_v_t: Any,
                  conv_bias: Any, a_log: Any, dt_bias: Any, onorm_g: Any, onorm_weight: Any,
                  ssm_states: Any, cache_indices: Any, scale: float, onorm_eps: float,
                  lower_bound: float | None) -> tuple[Any, Any, Any]:
    """One KDA decode step in float64 (csrc/attention/kda_fused_decode.cuh's documented steps):
    causal conv1d update + SiLU, L2-normed q (times scale) and k, the decay gate, the delta rule
    on the [V, K] state, the gated RMSNorm. Returns (out [B, H*128], conv_states', ssm_states')."""
    import torch

    tokens = mixed_qkv.shape[0]
    heads = a_log.shape[0]
    seg = heads * KDA_HEAD
    conv = conv_states.double().clone()
    state = ssm_states.double().clone()
    out = torch.zeros(tokens, seg, dtype=torch.float64, device=mixed_qkv.device)
    taps = torch.cat([w_q_t, w_k_t, w_v_t], dim=1).double()  # [4, 3*seg]
    for i in range(tokens):
        slot = int(cache_indices[i])
        if slot < 0:
            continue  # a padded CUDA-graph slot: output zero, pools untouched
        x = mixed_qkv[i].double()
        window = torch.cat([conv[slot], x[None]], dim=0)  # [4, 3*seg], oldest first
        act = torch.nn.functional.silu((window * taps).sum(0) + conv_bias.double())
        conv[slot] = window[1:]
        q, k, v = act[:seg].view(heads, KDA_HEAD), act[seg:2 * seg].view(heads, KDA_HEAD), act[2 * seg:].view(heads, KDA_HEAD)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = a[i].double().view(heads, KDA_HEAD) + dt_bias.double().view(heads, KDA_HEAD)
        exp_a = torch.exp(a_log.double())[:, None]
        if lower_bound is not None:
            decay = torch.exp(lower_bound * torch.sigmoid(exp_a * g))
        else:
            decay = torch.exp(-exp_a * torch.nn.functional.softplus(g))
        beta = torch.sigmoid(b[i].double())[:, None]  # [H, 1]
        h = state[slot] * decay[:, None, :]  # [H, V, K] * decay over K
        v_new = (v - (h * k[:, None, :]).sum(-1)) * beta  # [H, V]
        h = h + v_new[:, :, None] * k[:, None, :]
        state[slot] = h
        o = (h * q[:, None, :]).sum(-1)  # [H, V]
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + onorm_eps)
        o = o * onorm_weight.double()[None, :] * torch.sigmoid(onorm_g[i].double().view(heads, KDA_HEAD))
        out[i] = o.reshape(-1)
    return out, conv, state


def _kda(device: Any, lower_bound: float | None, heads: int = 12, tokens: int = 4,
         slots: int = 6) -> tuple[Callable[[], Any], Callable[[Any], Outputs]]:
    import torch

    import_sglang()
    op = importlib.import_module("sglang.kernels.ops.attention.kda_fused_decode")
    gen = torch.Generator(device="cpu").manual_seed(2)
    seg = heads * KDA_HEAD

    def rnd(*shape: int, s: float = 1.0, dtype: Any = torch.float32) -> Any:
        return (torch.randn(*shape, generator=gen) * s).to(dtype).to(device)

    bf16 = torch.bfloat16
    mixed_qkv = rnd(tokens, 3 * seg, dtype=bf16)
    a = rnd(tokens, seg, dtype=bf16)
    b = rnd(tokens, heads, dtype=bf16)
    conv_states = rnd(slots, KDA_CONV_TAPS, 3 * seg, dtype=bf16)
    w_q_t, w_k_t, w_v_t = (rnd(4, seg, s=0.5) for _ in range(3))
    conv_bias = rnd(3 * seg, s=0.1)
    a_log = rnd(heads, s=0.5)
    dt_bias = rnd(seg, s=0.5)
    onorm_g = rnd(tokens, seg, dtype=bf16)
    onorm_weight = rnd(KDA_HEAD, s=0.2) + 1.0
    ssm_states = rnd(slots, heads, KDA_HEAD, KDA_HEAD, s=0.1)
    cache_indices = torch.tensor([3, 0, -1, 5][:tokens], dtype=torch.int32, device=device)
    args = (mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, a_log, dt_bias, onorm_g,
            onorm_weight, ssm_states, cache_indices)
    assert op.covered(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g)
    scale, eps = KDA_HEAD ** -0.5, 1e-5
    # The reference first: the kernel updates both pools in place.
    ref_out, ref_conv, ref_state = kda_reference(*args, scale=scale, onorm_eps=eps, lower_bound=lower_bound)

    def call() -> Any:
        return op.kda_fused_decode(*args, scale=scale, onorm_eps=eps, lower_bound=lower_bound)

    def finish(out: Any) -> Outputs:
        return {"out": (out.view(tokens, seg), ref_out), "conv_states": (conv_states, ref_conv),
                "ssm_states": (ssm_states, ref_state)}

    return call, finish


CASES = (
    Case("situ_and_mul bf16 [77x4096]", "sgl_kernel_jit_kimi_k3_situ_and_mul_bf16_t_bf16_t_true",
         _situ, 1.6e-2),
    Case("mla_output_gate bf16 [33x8192]", "sgl_kernel_jit_kimi_k3_mla_output_gate_256_256_true",
         _mla_output_gate, 1.6e-2),
    Case("kda_fused_decode H=12 lower bound -5", "sgl_kernel_jit_kda_fused_decode_true",
         lambda device: _kda(device, KDA_LOWER_BOUND), 2e-2),
    Case("kda_fused_decode H=12 softplus gate", "sgl_kernel_jit_kda_fused_decode_true",
         lambda device: _kda(device, None), 2e-2),
)
