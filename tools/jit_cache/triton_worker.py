"""Triton kernels of SGLang's serving path compiled ahead of time *through Triton's own launch
path*, inside the image's Python (Debian's python3.11 over the image's installed trees), on a
machine with no GPU. Run by tools/bench/triton_first_use.py, never by hand; it imports nothing of
tools/ but sglang_worker.py beside it (it runs under another interpreter than the tools).

Why the launch path and not `triton.compile` by hand: Triton's cache key holds what a launch
derives from the real arguments (signature, constexprs, the divisibility and ==1 specializations
of ints and pointers) and what the autotuner tries; calling SGLang's own function with tensors of
the serving call's dtypes and shapes makes Triton derive all of it itself. Only the device is a
stand-in (StubDriver): it answers as the target GPU (target, capability, device properties), its
"launch" does nothing and its benchmark returns a constant, so an autotuned kernel compiles every
config it keeps. Tensors live on the CPU: Triton reads only their dtype and data pointer, whose
16-byte alignment matches a CUDA allocation's.

Request (argv[1], JSON): {"capability": [12, 0], "device_name": str, "device_properties": {...},
"calls": [{"call": "sglang_kda_prefill", "heads": H, "sequences": [T, ...]}], "result": path}.
The caller sets TRITON_CACHE_DIR. Result: per pass and call, the kernels (`module:function`) Triton
compiled and the ones its cache answered (knobs.compilation.listener), and the seconds taken.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_worker import fake_device  # noqa: E402

KDA_HEAD = 128  # Kimi-K3's KDA head size (K = V = 128)
KDA_LOWER_BOUND = -5.0  # linear_attn_config gate_lower_bound


def stub_driver(capability, properties):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvidia

    class Utils:
        def get_device_properties(self, device):
            return dict(properties)

        def load_binary(self, name, kernel, shared, device):
            return (1, 1, 0, 0, 1024)  # module, function, registers, spills, max threads

        def unload_module(self, *args):
            pass

    class Launcher:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            pass

    class StubDriver(nvidia.CudaDriver):
        def __init__(self):  # no CudaUtils: it builds a C module against libcuda
            self.utils = Utils()
            self.launcher_cls = Launcher
            self.get_device_capability = lambda device=None: tuple(capability)
            self.get_current_stream = lambda device=None: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        def get_current_target(self):
            return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            def bench(fn, quantiles=None, **kwargs):
                fn()
                return [1.0, 1.0, 1.0] if quantiles else 1.0
            return bench

        def get_empty_cache_for_benchmark(self):
            return torch.empty(16, dtype=torch.int)

        def clear_cache(self, cache):
            pass

        @staticmethod
        def is_active():
            return True

    return StubDriver()


class _NoDevice:
    """torch.cuda.device(...) as a no-op: SGLang's FLA wrappers enter the tensors' device."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def import_sglang():
    """The `sglang` package without its __init__ (the frontend API; not on the kernels' path)."""
    spec = importlib.util.find_spec("sglang")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package


def sglang_kda_prefill(heads, sequences):
    """One KDA layer's prefill as SGLang's KDA backend runs it with the Triton prefill kernel
    (the SM120 choice: kda_backend.forward_extend): the causal conv1d over the packed qkv
    (`_convolve_prefill`: mixed_qkv [T, 3*H*128] bf16, Kimi-K3's qkv_conv1d weights fp32 [3*H*128, 4]
    without bias, the bf16 conv pool [slots, 3, 3*H*128] seen transposed), then
    `TritonKDAKernel.extend` -> fla.kda.chunk_kda on the split q/k/v, the raw gate `a`
    [1, T, H, 128] bf16, raw beta [1, T, H] bf16, the fp32 state pool, int32 slot indices and
    query_start_loc, fp32 A_log [H] and dt_bias [H*128], lower bound -5 (K3's gate_lower_bound),
    for a batch of new sequences of these lengths."""
    import torch

    from sglang.kernels.ops.attention.fla.kda import chunk_kda
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn

    bf16 = torch.bfloat16
    seg = heads * KDA_HEAD
    tokens = sum(sequences)
    starts = [0]
    for n in sequences:
        starts.append(starts[-1] + n)
    slots = len(sequences) + 2
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    cache_indices = torch.arange(1, len(sequences) + 1, dtype=torch.int32)
    mixed_qkv = torch.randn(tokens, 3 * seg).to(bf16)
    conv_pool = torch.zeros(slots, 3, 3 * seg, dtype=bf16)
    qkv = causal_conv1d_fn(mixed_qkv.transpose(0, 1), torch.randn(3 * seg, 4), None,
                           activation="silu", conv_states=conv_pool.transpose(-1, -2),
                           has_initial_state=torch.zeros(len(sequences), dtype=torch.bool),
                           cache_indices=cache_indices, query_start_loc=query_start_loc,
                           seq_lens_cpu=list(sequences)).transpose(0, 1)
    q, k, v = (t.unflatten(-1, (-1, KDA_HEAD)).unsqueeze(0) for t in qkv.split([seg, seg, seg], dim=-1))
    a = torch.randn(1, tokens, seg).to(bf16).unflatten(-1, (-1, KDA_HEAD))
    beta = torch.rand(1, tokens, heads).to(bf16)
    ssm_states = torch.zeros(slots, heads, KDA_HEAD, KDA_HEAD, dtype=torch.float32)
    chunk_kda(q=q, k=k, v=v, g=a, beta=beta, initial_state=ssm_states,
              initial_state_indices=cache_indices, use_qk_l2norm_in_kernel=True,
              cu_seqlens=query_start_loc,
              A_log=torch.randn(heads, dtype=torch.float32),
              dt_bias=torch.randn(seg, dtype=torch.float32),
              lower_bound=KDA_LOWER_BOUND, beta_is_raw=True)


CALLS = {"sglang_kda_prefill": sglang_kda_prefill}


def kernel_id(src):
    """`module:function` of the @triton.jit function a compile is for (its site in the inventory)."""
    fn = getattr(src, "fn", None)
    module = getattr(fn, "module", None)
    name = getattr(src, "name", str(src))
    return f"{module}:{name}" if module else name


def main(request_path):
    request = json.loads(pathlib.Path(request_path).read_text())
    fake_device(tuple(request["capability"]), request["device_name"])
    import torch

    torch.cuda.device = _NoDevice
    torch.cuda._exchange_device = lambda index: 0
    torch.cuda._maybe_exchange_device = lambda index: 0
    from triton import knobs
    from triton.runtime import driver

    driver.set_active(stub_driver(request["capability"], request["device_properties"]))
    events = []
    knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: events.append(
        (kernel_id(src), bool(cache_hit)))
    import_sglang()
    result = {"passes": []}
    for _ in range(request.get("passes", 1)):
        rows = []
        for entry in request["calls"]:
            events.clear()
            args = {k: v for k, v in entry.items() if k != "call"}
            t0 = time.monotonic()
            row = {"call": entry["call"], "args": args}
            try:
                CALLS[entry["call"]](**args)
            except Exception as e:  # one call's failure is reported with its call
                row["error"] = f"{type(e).__name__}: {e}".strip().splitlines()[0]
                row["traceback"] = traceback.format_exc(limit=4)
            row["seconds"] = time.monotonic() - t0
            row["compiled"] = sorted(n for n, hit in events if not hit)
            row["hits"] = sorted(n for n, hit in events if hit)
            rows.append(row)
        result["passes"].append(rows)
    pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
