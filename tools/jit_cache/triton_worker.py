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
"calls": [{"call": "sglang_kda_prefill", "heads": H, "tokens": T}], "passes": 2, "result": path}.
The caller sets TRITON_CACHE_DIR. Result: per pass and call, the kernels Triton compiled and the
ones its cache answered (knobs.compilation.listener), and the seconds taken.
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


def sglang_kda_prefill(heads, tokens):
    """The KDA prefill call of SGLang's Triton KDA backend (kernels/kda_triton.py extend ->
    fla.kda.chunk_kda) as kda_backend.forward_extend makes it for one sequence: q/k/v and the raw
    gate `a` [1, T, H, 128] bf16, raw beta [1, T, H] bf16, the fp32 state pool, int32 slot
    indices and query_start_loc, fp32 A_log [H] and dt_bias [H*128], lower bound -5."""
    import torch

    from sglang.kernels.ops.attention.fla.kda import chunk_kda

    bf16 = torch.bfloat16
    shape = (1, tokens, heads, KDA_HEAD)
    q, k, v, g = (torch.randn(shape).to(bf16) for _ in range(4))
    beta = torch.rand(1, tokens, heads).to(bf16)
    ssm_states = torch.zeros(8, heads, KDA_HEAD, KDA_HEAD, dtype=torch.float32)
    chunk_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=ssm_states,
              initial_state_indices=torch.tensor([3], dtype=torch.int32),
              use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32),
              A_log=torch.randn(heads, dtype=torch.float32),
              dt_bias=torch.randn(heads * KDA_HEAD, dtype=torch.float32),
              lower_bound=KDA_LOWER_BOUND, beta_is_raw=True)


CALLS = {"sglang_kda_prefill": sglang_kda_prefill}


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
        (getattr(src, "name", str(src)), bool(cache_hit)))
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
