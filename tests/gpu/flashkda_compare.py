"""FlashKDA against SGLang's Triton KDA prefill, both called through SGLang, and both against a
float64 recurrence (issue #41: the GPU proof of the optional FlashKDA backend on SM90).

    python3.11 tests/gpu/flashkda_compare.py --out RESULT.json [--flashkda-tests FLASHKDA_DIR]

Run it under the image's python with `flash_kda` importable (kernel_cache/FLASHKDA.md, "GPU
proof"). Imports only the standard library, torch, sglang and flash_kda, so it runs on a GPU host
that has the image's root and nothing of this repository's tools/.

What it calls, in SGLang 0.5.23's own layout (KDAAttnBackend.forward_extend in
sglang/srt/layers/attention/linear/kda_backend.py):

- q, k, v: bf16 [1, T, H, 128] views of the packed post-conv qkv [T, 3*H*128] (not contiguous);
  g: the raw forget gate [1, T, H, 128] bf16; beta: raw logits [1, T, H] bf16 (beta_is_raw=True);
  A_log fp32 [1, 1, H, 1]; dt_bias fp32 [H*128]; lower_bound -5.0 (Kimi-K3's gate_lower_bound);
  ssm_states: the fp32 pool [slots, H, 128, 128] ([slot, head, V, K]), written in place at
  cache_indices (int32); query_start_loc: int32 cu_seqlens; extend_seq_lens_cpu: the lengths.
- FlashKDA: FlashKDAKernel._flashkda_extend (sglang/srt/layers/attention/linear/kernels/
  kda_flashkda.py), the method that reshapes those arguments for flash_kda.fwd. It is called
  directly because FlashKDAKernel.extend sends batches shorter than 64 or longer than 2048 tokens
  to Triton (_should_fall_back); each row records where SGLang would route it, and where that is
  FlashKDA, the row also calls SGLang's entry point itself (KDAKernelDispatcher.extend built for
  `--linear-attn-prefill-backend flashkda`, else FlashKDAKernel.extend) and compares.
- Triton: TritonKDAKernel.extend (kernels/kda_triton.py), the default prefill backend, which
  calls sglang.kernels.ops.attention.fla.kda.chunk_kda.

Exit status: 0 when every case is within tolerance, 1 naming each case that is not, 2 when the
comparison could not run (no CUDA GPU, flash_kda or sglang missing).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

HEAD_DIM = 128  # Kimi-K3's KDA head size: K = V = 128, the only size FlashKDA supports
LOWER_BOUND = -5.0  # Kimi-K3's linear_attn_config gate_lower_bound: the "safe gate" FlashKDA needs
HEADS = (3, 6, 12)  # KDA heads per rank at the tensor-parallel sizes Kimi-K3 runs
LENGTHS = (64, 2048, 8192)
# One varlen batch per head count: every length within SGLang's FlashKDA window [64, 2048]
# (kda_flashkda.py _FLASHKDA_CHUNK_SIZE, _FLASHKDA_MAX_SEQ_LEN) so SGLang routes it to FlashKDA,
# and most of them not multiples of the 64-token chunk, so partial chunks are exercised.
VARLEN_LENGTHS = (300, 64, 2048, 577)
INITIAL_STATES = ("zeros", "random")
# A random initial state of about the size a prefilled state reaches (entries of S map unit keys
# to values of order 1, spread over 128 channels).
RANDOM_STATE_STD = 0.1
L2NORM_EPS = 1e-6  # SGLang's l2norm_fwd and FlashKDA both divide by sqrt(sum(x^2) + 1e-6)

# The tolerance of a comparison with the float64 reference, by the dtype of the compared tensor,
# on two numbers: rel_rmse = rms(x - ref) / rms(ref) (FlashKDA's own get_err_ratio) and
# max_rel = max|x - ref| / max|ref|. Both kernels take bf16 operands and round their matmul
# inputs to bf16 (FlashKDA also runs its WY inverse in fp16): the bound is bf16's unit roundoff
# u = 2^-8 ~ 0.0039, whichever dtype the result is stored in.
# - bfloat16 (the outputs): one final rounding alone gives rel_rmse ~ u/sqrt(3) ~ 0.0023; the
#   kernels round q, k, decayed keys and the intra-chunk products before it, each adding a
#   comparable independent term, so allow ~5u. FlashKDA's own test holds its output to 0.005-0.006
#   of an fp64 recurrence on smaller random inputs; 0.02 leaves room for 8192 tokens and Kimi's
#   12 heads while still failing a wrong gate, scale or state layout (each gives errors of order 1).
#   max_rel: one element may carry several ulps of its own magnitude; 0.1 of the largest is ~25u.
# - float32 (the final states): stored fp32, but built from the same bf16 operands, and FlashKDA
#   holds the state in bf16 between chunks (its tests/torch_ref.py: the fp32 state is "converted
#   to bf16 for compute"), re-rounding it once per 16-token chunk; the decay (at most exp(-5) a
#   step, at least 0 for most channels) keeps those roundings from adding up without bound, so
#   the same 5u, with room for the longer accumulation.
TOLERANCES: dict[str, dict[str, float]] = {
    "bfloat16": {"rel_rmse": 2e-2, "max_rel": 1e-1},
    "float32": {"rel_rmse": 2e-2, "max_rel": 1e-1},
}
# FlashKDA against Triton: both are within the tolerance of the reference, so by the triangle
# inequality their difference is within twice it.
PAIR_FACTOR = 2.0

# FlashKDA's forward test at the flashkda pin (third_party/pins.lock.json), as git blob ids, so a
# result says whether the tree it ran was the pinned one, unmodified.
FLASHKDA_PIN_COMMIT = "1ce47ea3bb22c84eb9cc665028399cf35e8ffb0b"
FLASHKDA_FORWARD_TEST = "tests/test_fwd.py"
FLASHKDA_TEST_BLOBS = {
    "tests/conftest.py": "8aeb5114fbf1c98b6af930148cf7bd69cbc36f2e",
    "tests/test_fwd.py": "144beddcdcd7bd0f0d557132972df379846fe9a5",
    "tests/torch_ref.py": "9be8e825a25ad065674e74ad73f58c0587d70f4f",
}


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    lengths: tuple[int, ...]
    initial_state: str  # one of INITIAL_STATES

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def varlen(self) -> bool:
        return len(self.lengths) > 1


def default_cases(heads=HEADS, lengths=LENGTHS, varlen_lengths=VARLEN_LENGTHS) -> list[Case]:
    cases = []
    for h in heads:
        for length in lengths:
            cases += [Case(f"h{h}_t{length}_{s}", h, (length,), s) for s in INITIAL_STATES]
        if varlen_lengths:
            cases += [Case(f"h{h}_varlen{len(varlen_lengths)}_{s}", h, tuple(varlen_lengths), s)
                      for s in INITIAL_STATES]
    return cases


def case_seed(base: int, case: Case) -> int:
    # Per case, not per position in the list: a case draws the same inputs whatever else runs.
    return (base * 1_000_003 + zlib.crc32(case.name.encode())) % (2**63)


# ----------------------------------------------------------------------------------------------
# Inputs, laid out as SGLang's KDA backend hands them to its prefill kernels
# ----------------------------------------------------------------------------------------------

@dataclass
class KdaInputs:
    q: torch.Tensor  # [1, T, H, K] bf16, a view of qkv
    k: torch.Tensor
    v: torch.Tensor  # [1, T, H, V] bf16, a view of qkv
    g: torch.Tensor  # [1, T, H, K] bf16, the raw forget gate
    beta: torch.Tensor  # [1, T, H] bf16, raw logits
    A_log: torch.Tensor  # [1, 1, H, 1] fp32
    dt_bias: torch.Tensor  # [H*K] fp32
    pool: torch.Tensor  # [slots, H, V, K] fp32: the initial pool, never passed to a kernel
    cache_indices: torch.Tensor  # [N] int32
    query_start_loc: torch.Tensor  # [N+1] int32
    lengths: tuple[int, ...]


def make_inputs(case: Case, seed: int, device: str | torch.device) -> KdaInputs:
    """Seeded on the CPU (the same draws on any GPU), then moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    heads, dim, tokens = case.heads, HEAD_DIM, case.tokens
    seg = heads * dim
    n = len(case.lengths)
    # The causal conv1d's output with SiLU (what q/k/v are when the kernels see them).
    qkv = torch.nn.functional.silu(torch.randn(tokens, 3 * seg, generator=gen)).to(bf16)
    a = torch.randn(tokens, seg, generator=gen).to(bf16)  # f_b_proj's output: the raw gate
    b = torch.randn(tokens, heads, generator=gen).to(bf16)  # b_proj's output: beta's logits
    # A_log in [0, 1) and dt_bias ~ N(0, 1), as FlashKDA's own test draws them: with the gate
    # N(0, 1), lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) then spans nearly all of
    # [-5, 0], so some channels forget within a step and others keep state over thousands.
    A_log = torch.rand(heads, generator=gen, dtype=torch.float32)
    dt_bias = torch.randn(seg, generator=gen, dtype=torch.float32)
    # Slot 0 and the last slot belong to no sequence of the batch: a kernel must leave them alone.
    slots = n + 2
    pool = torch.randn(slots, heads, dim, dim, generator=gen, dtype=torch.float32) * RANDOM_STATE_STD
    cache_indices = torch.arange(1, n + 1, dtype=torch.int32)
    if case.initial_state == "zeros":
        pool[1:n + 1] = 0
    starts = [0]
    for length in case.lengths:
        starts.append(starts[-1] + length)

    qkv, a, b = qkv.to(device), a.to(device), b.to(device)
    q, k, v = (t.unflatten(-1, (-1, dim)).unsqueeze(0) for t in qkv.split([seg, seg, seg], dim=-1))
    return KdaInputs(
        q=q, k=k, v=v,
        g=a.unflatten(-1, (-1, dim)).unsqueeze(0),
        beta=b.unsqueeze(0),
        A_log=A_log.view(1, 1, heads, 1).to(device),
        dt_bias=dt_bias.to(device),
        pool=pool.to(device),
        cache_indices=cache_indices.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
        lengths=tuple(case.lengths),
    )


# ----------------------------------------------------------------------------------------------
# The float64 reference
# ----------------------------------------------------------------------------------------------

def safe_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias)), per token, head and key channel, in
    float64: the log of the per-step decay, in [lower_bound, 0]. The formula of SGLang's safe gate
    (kda.py kda_gate_chunk_cumsum_vector_kernel, USE_LOWER_BOUND) and of FlashKDA's torch_ref.
    a: [..., H, K]; A_log: H elements; dt_bias: H*K elements."""
    heads, dim = a.shape[-2], a.shape[-1]
    decay_rate = A_log.reshape(heads, 1).to(torch.float64).exp()
    bias = dt_bias.reshape(heads, dim).to(torch.float64)
    return lower_bound * torch.sigmoid(decay_rate * (a.to(torch.float64) + bias))


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def reference_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                  initial_state: torch.Tensor, lengths: tuple[int, ...] | list[int],
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA prefill, token by token, in float64, on whatever device the tensors are on.

    q, k, a: [T, H, K]; v: [T, H, V]; b: [T, H] (beta's logits); initial_state: [N, H, V, K]
    (SGLang's pool layout: S maps a key to a value, S @ k); lengths: the N sequences' lengths,
    packed along T. Returns (o [T, H, V], final states [N, H, V, K]), both float64.

    Per head, with q and k L2-normalized and q scaled by K^-0.5 (l2norm eps inside the sqrt):
        S_t = S_{t-1} diag(exp(g_t))                       decay each key channel
        S_t = S_t + beta_t (v_t - S_t k_t) k_t^T           delta rule, beta_t = sigmoid(b_t)
        o_t = S_t q_t
    with g_t from safe_gate. The recurrence is that of SGLang's own test reference,
    sglang.test.kits.attention_unittest.attention_methods.kda_attention._pure_torch_kda_reference
    (its gate, _pure_torch_kda_gating, is the unbounded one; Kimi-K3's is the safe gate above).
    """
    f64 = torch.float64
    dim = q.shape[-1]
    scale = dim ** -0.5 if scale is None else scale
    qn = l2_normalize(q.to(f64)) * scale
    kn = l2_normalize(k.to(f64))
    v = v.to(f64)
    decay = safe_gate(a, A_log, dt_bias, lower_bound).exp()
    beta = torch.sigmoid(b.to(f64))
    out = torch.empty(v.shape, dtype=f64, device=v.device)
    final = torch.empty(initial_state.shape, dtype=f64, device=v.device)
    start = 0
    for n, length in enumerate(lengths):
        state = initial_state[n].to(f64).clone()  # [H, V, K]
        for t in range(start, start + length):
            state.mul_(decay[t].unsqueeze(1))
            residual = v[t] - torch.bmm(state, kn[t].unsqueeze(-1)).squeeze(-1)  # [H, V]
            state.baddbmm_((beta[t].unsqueeze(-1) * residual).unsqueeze(-1), kn[t].unsqueeze(1))
            out[t] = torch.bmm(state, qn[t].unsqueeze(-1)).squeeze(-1)
        final[n] = state
        start += length
    return out, final


def reference_for(inputs: KdaInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_kda on exactly what the kernels were given (bf16 values, read exactly)."""
    return reference_kda(inputs.q[0], inputs.k[0], inputs.v[0], inputs.g[0], inputs.beta[0],
                         inputs.A_log, inputs.dt_bias, LOWER_BOUND,
                         inputs.pool[inputs.cache_indices.long()], inputs.lengths)


# ----------------------------------------------------------------------------------------------
# Errors, tolerances, the table and the result file
# ----------------------------------------------------------------------------------------------

def error_stats(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """max_abs, max_rel (max_abs / max|expected|) and rel_rmse (rms(diff) / rms(expected)), in
    float64. A NaN or inf in `actual` gives NaN or inf, which no tolerance accepts."""
    x = actual.detach().to(torch.float64)
    ref = expected.detach().to(torch.float64).to(x.device)
    diff = x - ref
    max_abs = diff.abs().max().item()
    rmse = diff.square().mean().sqrt().item()
    ref_max = ref.abs().max().item()
    ref_rms = ref.square().mean().sqrt().item()

    def ratio(num: float, den: float) -> float:
        if den > 0:
            return num / den
        return 0.0 if num == 0 else math.inf

    return {"max_abs": max_abs, "max_rel": ratio(max_abs, ref_max), "rel_rmse": ratio(rmse, ref_rms)}


# (the comparison's key in a row, the factor on the tolerance)
COMPARISONS = (("flashkda_vs_ref", 1.0), ("triton_vs_ref", 1.0), ("flashkda_vs_triton", PAIR_FACTOR))
# (what, the dtype whose tolerance applies): the outputs are bf16, the final states fp32
QUANTITIES = (("output", "bfloat16"), ("state", "float32"))


def row_failures(row: dict[str, Any]) -> list[str]:
    """One line for each number of `row` over its tolerance, each naming the case."""
    failures = []
    for comparison, factor in COMPARISONS:
        for quantity, dtype in QUANTITIES:
            stats = row["errors"][comparison][quantity]
            for metric, limit in TOLERANCES[dtype].items():
                value = stats[metric]
                if not value <= limit * factor:  # NaN compares false: a NaN fails
                    failures.append(f"{row['case']}: {comparison} {quantity} {metric} {value:.3g} > "
                                    f"{limit * factor:.3g} ({dtype} tolerance)")
    for backend in ("flashkda", "triton"):
        if not row[backend].get("other_slots_untouched", True):
            failures.append(f"{row['case']}: {backend} wrote pool slots outside cache_indices")
    # SGLang's entry point runs the backend it routes to; bits may differ (atomics), values not.
    entry = row["sglang_entry"]["output_vs_routed_backend"]["rel_rmse"]
    if not entry <= TOLERANCES["bfloat16"]["rel_rmse"]:
        failures.append(f"{row['case']}: SGLang's entry point differs from {row['sglang_routes_to']} "
                        f"called directly (output rel_rmse {entry:.3g})")
    return failures


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _err(value: float) -> str:
    return f"{value:.2e}"


TABLE_COLUMNS = ("case", "heads", "length", "sglang->", "flashkda ms", "triton ms", "fk 1st ms",
                 "tr 1st ms", "out fk/ref", "out tr/ref", "out fk/tr", "st fk/ref", "st tr/ref", "st fk/tr")


def format_table(rows: list[dict[str, Any]]) -> str:
    """Median ms of the timed runs, the first call's wall ms, and rel_rmse of outputs and states."""
    lines = [TABLE_COLUMNS]
    for r in rows:
        e = r["errors"]
        lines.append((
            r["case"], str(r["heads"]),
            str(r["lengths"][0]) if len(r["lengths"]) == 1 else "+".join(map(str, r["lengths"])),
            r["sglang_routes_to"],
            _ms(r["flashkda"]["median_ms"]), _ms(r["triton"]["median_ms"]),
            _ms(r["flashkda"]["first_call_ms"]), _ms(r["triton"]["first_call_ms"]),
            _err(e["flashkda_vs_ref"]["output"]["rel_rmse"]), _err(e["triton_vs_ref"]["output"]["rel_rmse"]),
            _err(e["flashkda_vs_triton"]["output"]["rel_rmse"]),
            _err(e["flashkda_vs_ref"]["state"]["rel_rmse"]), _err(e["triton_vs_ref"]["state"]["rel_rmse"]),
            _err(e["flashkda_vs_triton"]["state"]["rel_rmse"]),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_COLUMNS))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def json_safe(value: Any) -> Any:
    """NaN and inf are not JSON: they become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def result_json(result: dict[str, Any]) -> str:
    """Sorted keys, 2-space indent, ASCII, one trailing newline: one result, one text."""
    return json.dumps(json_safe(result), sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


# ----------------------------------------------------------------------------------------------
# FlashKDA's own forward test
# ----------------------------------------------------------------------------------------------

def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def junit_outcomes(path: Path) -> dict[str, Any]:
    """Counts by outcome (passed, failed, error, skipped) and each test's outcome with the first
    line of its message, from a pytest JUnit XML report."""
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0] if message else ""
                break
        tests[name] = {"outcome": outcome, "message": message}
    counts = Counter(t["outcome"] for t in tests.values())
    return {"counts": {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped")},
            "tests": tests}


def run_flashkda_tests(src: Path, timeout: float) -> dict[str, Any]:
    """FlashKDA's forward test (tests/test_fwd.py) from the source tree `src`, as it is: pytest in
    a subprocess of this python, from a scratch directory (its plots land there, not in `src`),
    writing no bytecode into `src`."""
    test = src / FLASHKDA_FORWARD_TEST
    result: dict[str, Any] = {"dir": str(src), "test": FLASHKDA_FORWARD_TEST, "ran": False}
    blobs = {rel: git_blob_id((src / rel).read_bytes()) for rel in FLASHKDA_TEST_BLOBS if (src / rel).is_file()}
    result["blobs"] = blobs
    result["pinned_commit"] = FLASHKDA_PIN_COMMIT
    result["unmodified"] = blobs == FLASHKDA_TEST_BLOBS
    if not test.is_file():
        result["why"] = f"{test}: no such file (pass the root of the FlashKDA source tree)"
        return result
    if importlib.util.find_spec("pytest") is None:
        result["why"] = f"pytest is not importable by {sys.executable}: FlashKDA's forward test could not run"
        return result
    with tempfile.TemporaryDirectory(prefix="flashkda-tests-") as scratch:
        junit = Path(scratch) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
               "-o", "junit_family=xunit1", f"--junitxml={junit}", str(test)]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") if isinstance(e.stdout, bytes) else (e.stdout or "").encode()
            result.update(ran=True, timed_out=True, why=f"pytest ran past {timeout:.0f} s",
                          output_tail=out.decode(errors="replace")[-4000:])
            return result
        result.update(ran=True, command=cmd, exit_code=proc.returncode,
                      wall_s=round(time.monotonic() - started, 1),
                      output_tail=(proc.stdout + proc.stderr)[-4000:])
        if junit.is_file():
            result.update(junit_outcomes(junit))
        else:
            result["why"] = f"pytest wrote no JUnit report (exit {proc.returncode})"
    return result


# ----------------------------------------------------------------------------------------------
# SGLang and FlashKDA on the GPU
# ----------------------------------------------------------------------------------------------

def import_sglang() -> str:
    """Import the `sglang` package; where its frontend (sglang/__init__.py: the language API,
    not on the kernels' path) fails to import, stand in an empty package so the kernels' modules
    still import. Returns how it was imported."""
    try:
        importlib.import_module("sglang")
        return "sglang"
    except Exception as e:  # whatever the frontend's imports raise
        why = f"{type(e).__name__}: {e}"
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package
    return f"kernels only (the frontend failed: {why})"


def distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def flash_kda_build() -> dict[str, Any] | None:
    """kimi_k3_build.json of the flash_kda wheel this project builds (pin commit, arch, torch)."""
    for name in ("flash_kda", "flash-kda"):
        try:
            text = importlib.metadata.distribution(name).read_text("kimi_k3_build.json")
        except importlib.metadata.PackageNotFoundError:
            continue
        return json.loads(text) if text else None
    return None


def environment() -> dict[str, Any]:
    major, minor = torch.cuda.get_device_capability(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": f"sm{major}{minor}",
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "sglang": distribution_version("sglang"),
        "triton": distribution_version("triton"),
        "flash_kda": distribution_version("flash_kda", "flash-kda"),
        "flash_kda_build": flash_kda_build(),
    }


@dataclass
class SglangKda:
    flashkda: Any  # FlashKDAKernel()
    triton: Any  # TritonKDAKernel()
    entry: Callable[..., Any]  # what SGLang calls for a prefill with the flashkda backend
    entry_name: str
    should_fall_back: Callable[..., bool]
    info: dict[str, Any]


def load_sglang_kda() -> SglangKda:
    how = import_sglang()
    from sglang.srt.layers.attention.linear.kernels import kda_flashkda
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

    flashkda = kda_flashkda.FlashKDAKernel()
    info: dict[str, Any] = {
        "import": how,
        "flashkda_window": [kda_flashkda._FLASHKDA_CHUNK_SIZE, kda_flashkda._FLASHKDA_MAX_SEQ_LEN],
    }
    entry, entry_name = flashkda.extend, "sglang.srt.layers.attention.linear.kernels.kda_flashkda:FlashKDAKernel.extend"
    # The dispatcher `--linear-attn-prefill-backend flashkda` builds (decode and verify stay Triton);
    # its module imports the model runner, so a host short of a server dependency falls back to
    # the kernel class it would call.
    try:
        from sglang.srt.layers.attention.linear.kda_backend import KDAKernelDispatcher
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend as Backend

        dispatcher = KDAKernelDispatcher(Backend.TRITON, Backend.FLASHKDA, Backend.TRITON)
        info["dispatcher_extend_kernel"] = type(dispatcher.extend_kernel).__name__
        entry = dispatcher.extend
        entry_name = "sglang.srt.layers.attention.linear.kda_backend:KDAKernelDispatcher.extend"
    except Exception as e:  # recorded: the comparison itself does not need the dispatcher
        info["dispatcher_error"] = f"{type(e).__name__}: {e}"
    info["entry"] = entry_name
    return SglangKda(flashkda=flashkda, triton=TritonKDAKernel(), entry=entry, entry_name=entry_name,
                     should_fall_back=kda_flashkda.FlashKDAKernel._should_fall_back, info=info)


def _only_output(result: Any) -> torch.Tensor:
    # FlashKDAKernel.extend returns (o, None); TritonKDAKernel.extend returns o.
    return result[0] if isinstance(result, tuple) else result


def measure(call: Callable[[torch.Tensor], torch.Tensor], pool_init: torch.Tensor,
            warmup: int, iters: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The first call timed alone (wall clock, synchronized: Triton compiles and autotunes there,
    on the host), then `warmup` untimed and `iters` timed calls (CUDA events around the call,
    the pool reset before each, outside the events). Returns the first call's output and pool
    (those are compared: a server's first prefill is one too) and the timings."""
    pool = pool_init.clone()
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = call(pool)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - started) * 1e3
    first_out, first_pool = out.clone(), pool.clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + iters):
        pool.copy_(pool_init)
        start.record()
        out = call(pool)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    timing = {
        "first_call_ms": first_ms,
        "median_ms": statistics.median(times) if times else None,
        "min_ms": min(times) if times else None,
        "warmup": warmup,
        "iters": iters,
        # Same inputs, same bits? (A kernel with atomics or an autotuner that runs a config over
        # the in-place pool at the first call would differ.)
        "steady_equals_first": bool(torch.equal(out, first_out) and torch.equal(pool, first_pool)),
    }
    return first_out, first_pool, timing


def run_case(case: Case, kda: SglangKda, seed: int, warmup: int, iters: int) -> dict[str, Any]:
    x = make_inputs(case, seed, "cuda")
    rows = x.cache_indices.long()
    others = torch.ones(x.pool.shape[0], dtype=torch.bool, device=x.pool.device)
    others[rows] = False
    common = dict(cache_indices=x.cache_indices, query_start_loc=x.query_start_loc, A_log=x.A_log,
                  dt_bias=x.dt_bias, lower_bound=LOWER_BOUND, beta_is_raw=True)

    def flashkda(pool: torch.Tensor) -> torch.Tensor:
        return kda.flashkda._flashkda_extend(x.q, x.k, x.v, x.g, x.beta, ssm_states=pool, **common)

    def triton(pool: torch.Tensor) -> torch.Tensor:
        return _only_output(kda.triton.extend(x.q, x.k, x.v, x.g, x.beta, ssm_states=pool,
                                              return_intermediate_states=False, **common))

    ref_out, ref_state = reference_for(x)
    fk_out, fk_pool, fk_timing = measure(flashkda, x.pool, warmup, iters)
    tr_out, tr_pool, tr_timing = measure(triton, x.pool, warmup, iters)
    fk_timing["other_slots_untouched"] = bool(torch.equal(fk_pool[others], x.pool[others]))
    tr_timing["other_slots_untouched"] = bool(torch.equal(tr_pool[others], x.pool[others]))

    routes_to = "triton" if kda.should_fall_back(LOWER_BOUND, False, x.query_start_loc,
                                                 list(case.lengths)) else "flashkda"
    # SGLang's own entry point on the same batch: the bits it gives, and what it returns.
    entry_pool = x.pool.clone()
    entry_result = kda.entry(x.q, x.k, x.v, x.g, x.beta, ssm_states=entry_pool,
                             extend_seq_lens_cpu=list(case.lengths), is_spec_decode=False,
                             return_intermediate_states=False, **common)
    entry_out = _only_output(entry_result)
    routed_out, routed_pool = (fk_out, fk_pool) if routes_to == "flashkda" else (tr_out, tr_pool)
    entry = {
        "entry": kda.entry_name,
        "returns": (f"tuple of {len(entry_result)}" if isinstance(entry_result, tuple) else type(entry_result).__name__),
        "equals_routed_backend": bool(torch.equal(entry_out, routed_out) and torch.equal(entry_pool, routed_pool)),
        "output_vs_routed_backend": error_stats(entry_out, routed_out),
    }
    torch.cuda.synchronize()

    def both(out: torch.Tensor, pool: torch.Tensor, ref_o: torch.Tensor, ref_s: torch.Tensor) -> dict:
        return {"output": error_stats(out[0], ref_o), "state": error_stats(pool[rows], ref_s)}

    return {
        "case": case.name, "heads": case.heads, "lengths": list(case.lengths), "tokens": case.tokens,
        "varlen": case.varlen, "initial_state": case.initial_state, "seed": seed,
        "sglang_routes_to": routes_to,
        "sglang_entry": entry,
        "flashkda": fk_timing,
        "triton": tr_timing,
        "errors": {
            "flashkda_vs_ref": both(fk_out, fk_pool, ref_out, ref_state),
            "triton_vs_ref": both(tr_out, tr_pool, ref_out, ref_state),
            "flashkda_vs_triton": {"output": error_stats(fk_out, tr_out),
                                   "state": error_stats(fk_pool[rows], tr_pool[rows])},
        },
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="the result file (JSON)")
    ap.add_argument("--heads", type=_ints, default=HEADS, help="heads per rank, comma separated")
    ap.add_argument("--lengths", type=_ints, default=LENGTHS, help="single-sequence prompt lengths")
    ap.add_argument("--varlen-lengths", type=_ints, default=VARLEN_LENGTHS,
                    help="the varlen batch's lengths ('' for none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20, help="timed runs per backend and case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flashkda-tests", type=Path, metavar="DIR",
                    help="also run FlashKDA's forward test from this source tree, unmodified")
    ap.add_argument("--flashkda-tests-timeout", type=float, default=1800.0, metavar="SECONDS")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"no CUDA GPU visible to torch {torch.__version__}: the comparison needs one", file=sys.stderr)
        return 2
    try:
        import flash_kda  # noqa: F401  (SGLang imports it at the first FlashKDA call)
    except ImportError as e:
        print(f"flash_kda does not import ({e}): put the 9.0a wheel's contents on PYTHONPATH "
              "(kernel_cache/FLASHKDA.md, GPU proof)", file=sys.stderr)
        return 2
    try:
        kda = load_sglang_kda()
    except ImportError as e:
        print(f"SGLang's KDA kernels do not import: {e}", file=sys.stderr)
        return 2
    env = environment()
    print(json.dumps(env, sort_keys=True))
    print(f"sglang: {json.dumps(kda.info, sort_keys=True)}")

    cases = default_cases(args.heads, args.lengths, args.varlen_lengths)
    rows = []
    with torch.inference_mode():
        for case in cases:
            started = time.monotonic()
            row = run_case(case, kda, case_seed(args.seed, case), args.warmup, args.iters)
            rows.append(row)
            print(f"{case.name}: {time.monotonic() - started:.1f} s", flush=True)
    print()
    print(format_table(rows))
    failures = [f for row in rows for f in row_failures(row)]

    result: dict[str, Any] = {
        "issue": 41,
        "environment": env,
        "sglang_kda": kda.info,
        "lower_bound": LOWER_BOUND,
        "head_dim": HEAD_DIM,
        "tolerances": TOLERANCES,
        "pair_factor": PAIR_FACTOR,
        "rows": rows,
        "failures": failures,
    }
    if args.flashkda_tests:
        torch.cuda.empty_cache()
        tests = run_flashkda_tests(args.flashkda_tests.absolute(), args.flashkda_tests_timeout)
        result["flashkda_tests"] = tests
        if tests.get("counts"):
            c = tests["counts"]
            print(f"FlashKDA's {FLASHKDA_FORWARD_TEST}: {c['passed']} passed, {c['failed']} failed, "
                  f"{c['error']} errors, {c['skipped']} skipped (recorded; not part of the exit status)")
        else:
            print(f"FlashKDA's {FLASHKDA_FORWARD_TEST}: not run: {tests.get('why')}")
    args.out.write_text(result_json(result))
    print(f"wrote {args.out}")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"all {len(rows)} cases within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
