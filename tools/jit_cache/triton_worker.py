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
Or {"driver_module": {...}, "result": path}: Triton's own C module built into the cache
(build_driver_module). The caller sets TRITON_CACHE_DIR. Result: per pass and call, the kernels (`module:function`) Triton
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
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package


def sglang_kda_prefill(heads, sequences, device="cpu", seed=0):
    """One KDA layer's prefill as SGLang's KDA backend runs it with the Triton prefill kernel
    (the SM120 choice: kda_backend.forward_extend): the causal conv1d over the packed qkv
    (`_convolve_prefill`: mixed_qkv [T, 3*H*128] bf16, Kimi-K3's qkv_conv1d weights fp32 [3*H*128, 4]
    without bias, the bf16 conv pool [slots, 3, 3*H*128] seen transposed), then
    `TritonKDAKernel.extend` -> fla.kda.chunk_kda on the split q/k/v, the raw gate `a`
    [1, T, H, 128] bf16, raw beta [1, T, H] bf16, the fp32 state pool, int32 slot indices and
    query_start_loc, fp32 A_log [H] and dt_bias [H*128], lower bound -5 (K3's gate_lower_bound),
    for a batch of new sequences of these lengths. The inputs are drawn on the CPU from `seed`
    and moved to `device` (the GPU proof, tests/gpu/test_triton_gpu.py, runs the same call on a
    GPU); returns the inputs and the outputs (o, and the pools the call writes)."""
    import torch

    from sglang.kernels.ops.attention.fla.kda import chunk_kda
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn

    rng = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    seg = heads * KDA_HEAD
    tokens = sum(sequences)
    starts = [0]
    for n in sequences:
        starts.append(starts[-1] + n)
    slots = len(sequences) + 2
    x = {
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "cache_indices": torch.arange(1, len(sequences) + 1, dtype=torch.int32),
        "mixed_qkv": torch.randn(tokens, 3 * seg, generator=rng).to(bf16),
        "conv_pool": torch.zeros(slots, 3, 3 * seg, dtype=bf16),
        "conv_weight": torch.randn(3 * seg, 4, generator=rng),
        "a": torch.randn(1, tokens, seg, generator=rng).to(bf16).unflatten(-1, (-1, KDA_HEAD)),
        "beta": torch.rand(1, tokens, heads, generator=rng).to(bf16),
        "ssm_states": torch.zeros(slots, heads, KDA_HEAD, KDA_HEAD, dtype=torch.float32),
        "A_log": torch.randn(heads, generator=rng, dtype=torch.float32),
        "dt_bias": torch.randn(seg, generator=rng, dtype=torch.float32),
    }
    x = {k: v.to(device) for k, v in x.items()}
    inputs = {k: v.clone() for k, v in x.items()}
    qkv = causal_conv1d_fn(x["mixed_qkv"].transpose(0, 1), x["conv_weight"], None,
                           activation="silu", conv_states=x["conv_pool"].transpose(-1, -2),
                           has_initial_state=torch.zeros(len(sequences), dtype=torch.bool, device=device),
                           cache_indices=x["cache_indices"], query_start_loc=x["query_start_loc"],
                           seq_lens_cpu=list(sequences)).transpose(0, 1)
    q, k, v = (t.unflatten(-1, (-1, KDA_HEAD)).unsqueeze(0) for t in qkv.split([seg, seg, seg], dim=-1))
    o = chunk_kda(q=q, k=k, v=v, g=x["a"], beta=x["beta"], initial_state=x["ssm_states"],
                  initial_state_indices=x["cache_indices"], use_qk_l2norm_in_kernel=True,
                  cu_seqlens=x["query_start_loc"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  lower_bound=KDA_LOWER_BOUND, beta_is_raw=True)
    return {"inputs": inputs, "qkv": qkv, "o": o, "ssm_states": x["ssm_states"], "conv_pool": x["conv_pool"]}


CALLS = {"sglang_kda_prefill": sglang_kda_prefill}


def kernel_id(src):
    """`module:function` of the @triton.jit function a compile is for (its site in the inventory)."""
    fn = getattr(src, "fn", None)
    module = getattr(fn, "module", None)
    name = getattr(src, "name", str(src))
    return f"{module}:{name}" if module else name


class _HostSysconfig:
    """sysconfig as Triton's build module reads it, answering EXT_SUFFIX as another host's Python
    (the module's file name, which Triton's cache looks up there)."""

    def __init__(self, ext_suffix):
        import sysconfig

        self._sysconfig, self._ext_suffix = sysconfig, ext_suffix

    def get_config_var(self, name):
        return self._ext_suffix if name == "EXT_SUFFIX" else self._sysconfig.get_config_var(name)

    def __getattr__(self, name):
        return getattr(self._sysconfig, name)


def key_as(triton_dir):
    """Make Triton key every entry as another build of the same release would: Triton's own
    triton_key() evaluated over that build's files (`triton_dir`), in place of this one's. Its
    inputs are the compiler, backend and language sources and _C/libtriton.so; between CPython
    builds of one release only libtriton.so differs (tools/jit_cache/README.md). Returns it."""
    import types

    from triton.runtime import autotuner, cache

    own = getattr(key_as, "own", None) or cache.triton_key.__wrapped__  # Triton's, once replaced
    key_as.own = own
    scope = dict(own.__globals__, __file__=os.path.join(triton_dir, "runtime", "cache.py"))
    key = types.FunctionType(own.__code__, scope, own.__name__)()
    cache.triton_key = autotuner.triton_key = lambda: key
    return key


def build_driver_module(spec):
    """Triton's driver module (`cuda_utils`: triton/backends/nvidia/driver.c, which Triton builds
    with the host's C compiler the first time any kernel launches) through Triton's own
    `_compile_so`, so Triton computes the cache key and writes the entry itself. The key is taken
    as the image's Triton takes it: the package's directories at their image path
    (spec["image_triton"]) and TRITON_LIBCUDA_PATH as the entrypoint sets it; only the compile,
    through Triton's `build.impl` hook, reads the files where this build has them, with the
    pinned compiler (CC) and spec["ccflags"] (Python's headers, prefix maps) and a link-time
    libcuda stub (spec["link_dirs"]). Returns {"key", "file", "compiles"}."""
    from triton import knobs
    from triton.runtime import build
    from triton.backends.nvidia import driver as nvidia

    built = os.path.dirname(os.path.dirname(nvidia.dirname))  # .../triton (real path)
    image = spec["image_triton"]

    def as_image(path):
        return image + path[len(built):] if path == built or path.startswith(built + os.sep) else path

    def as_built(path):
        return built + path[len(image):] if path == image or path.startswith(image + os.sep) else path

    compiles = []

    def compile_here(name, src, srcdir, library_dirs, include_dirs, libraries):
        compiles.append(name)
        knobs.build.impl = None
        try:
            return build._build(name, as_built(src), srcdir,
                                [as_built(d) for d in library_dirs] + list(spec["link_dirs"]),
                                [as_built(d) for d in include_dirs], libraries, list(spec["ccflags"]))
        finally:
            knobs.build.impl = compile_here

    knobs.build.impl = compile_here
    if spec.get("ext_suffix"):
        build.sysconfig = _HostSysconfig(spec["ext_suffix"])
    src_path = os.path.join(nvidia.dirname, "driver.c")
    path = build._compile_so(src=pathlib.Path(src_path).read_bytes(), src_path=src_path, name="cuda_utils",
                             library_dirs=[as_image(d) for d in nvidia.library_dirs()],
                             include_dirs=[as_image(d) for d in nvidia.include_dirs],
                             libraries=list(nvidia.libraries), ccflags=None, load_module=False,
                             language="c")
    knobs.build.impl = None
    return {"key": os.path.basename(os.path.dirname(path)), "file": os.path.basename(path),
            "compiles": compiles,
            "library_dirs": [as_image(d) for d in nvidia.library_dirs()],
            "include_dirs": [as_image(d) for d in nvidia.include_dirs]}


def main(request_path):
    request = json.loads(pathlib.Path(request_path).read_text())
    if "triton_key_check" in request:  # key_as() over this Triton's own files must be its triton_key()
        import triton
        from triton.runtime import cache

        own = cache.triton_key()
        result = {"own": own, "own_via_key_as": key_as(os.path.dirname(triton.__file__)),
                  "other": key_as(request["triton_key_check"])}
        pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
        return 0
    if "driver_module" in request:
        result = build_driver_module(request["driver_module"])
        pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
        return 0
    fake_device(tuple(request["capability"]), request["device_name"])
    import torch

    torch.cuda.device = _NoDevice
    torch.cuda._exchange_device = lambda index: 0
    torch.cuda._maybe_exchange_device = lambda index: 0
    from triton import knobs
    from triton.runtime import driver

    if request.get("triton_identity"):
        key_as(request["triton_identity"])
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
