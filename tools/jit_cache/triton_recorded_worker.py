"""Triton kernels rebuilt from a recording (tools/jit_cache/triton_recorded.py), inside the image's
Python (Debian's python3.11 over the image's installed trees), on a machine with no GPU. Run by
triton_recorded.py, never by hand; it imports nothing of tools/ but the workers beside it (it
runs under another interpreter than the tools).

For each recorded `triton` entry: the kernel's module is imported, its JITFunction found (Triton's
own registry of `module:qualname`, else the attribute with its Autotuner/Heuristics `.fn` chain
unwrapped) and the recorded specialization replayed with Triton's own `JITFunction.preload`
against a stand-in device answering as the recorded target, so Triton computes the cache key and
compiles the kernel into TRITON_CACHE_DIR itself. Each key part is recomputed from what Triton
compiled, so a key that differs from the recorded one is reported by the part that differs.
For each `triton-autotune` entry: the key of Triton's autotune disk cache (as
Autotuner.check_disk_cache computes it) and the kernel's file name; the caller writes the file.

Request (argv[1], JSON): {"target": {"backend", "arch", "warp_size"}, "device": {"capability",
"device_name", "device_properties"}, "sglang": bool (torch.cuda answers as the device and the
`sglang` package is imported without its __init__, as triton_worker.py does), "triton": [entry],
"autotune": [entry], "triton_identity": path or null (key_as), "result": path}. The caller sets
TRITON_CACHE_DIR and the recording's cache-invalidating environment. Result: {"triton_key",
"triton": [{"key", "parts", "differs"} or {"error"}], "autotune": [{"cache_key", "file", "why"}
or {"error"}]}.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import pathlib
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def stand_in_driver(target, device):
    """Triton's CUDA driver answering as the recorded target: no libcuda, its launch does nothing,
    its benchmark is refused (a rebuild from a recording never benchmarks)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvidia

    properties = dict(device["device_properties"])
    capability = tuple(device["capability"])

    class Utils:
        def get_device_properties(self, index):
            return dict(properties)

        def load_binary(self, name, kernel, shared, index):
            return (1, 1, 0, 0, 1024)  # module, function, registers, spills, max threads

        def unload_module(self, *args):
            pass

    class Launcher:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            pass

    class StandInDriver(nvidia.CudaDriver):
        def __init__(self):  # no CudaUtils: it builds a C module against libcuda
            self.utils = Utils()
            self.launcher_cls = Launcher

        def get_current_target(self):
            return GPUTarget(target["backend"], target["arch"], target["warp_size"])

        def get_device_capability(self, index=None):
            return capability

        def get_current_device(self):
            return 0

        def set_current_device(self, index):
            pass

        def get_current_stream(self, index=None):
            return 0

        def get_benchmarker(self):
            def refuse(*args, **kwargs):
                raise RuntimeError("a benchmark ran during a rebuild from a recording")
            return refuse

        @staticmethod
        def is_active():
            return True

    return StandInDriver()


def find_kernel(kernel):
    """(the object `module:qualname` names, its JITFunction): the attribute path of the qualname
    in the imported module, else Triton's registry of JITFunctions (kernels made in a function)."""
    from triton.runtime.jit import JITFunction, _triton_jit_function_registry

    module_name, _, qualname = kernel.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    fn = obj
    while fn is not None and not isinstance(fn, JITFunction):
        fn = getattr(fn, "fn", None)
    if fn is None:
        fn = _triton_jit_function_registry.get(kernel)
    if fn is None:
        raise LookupError(f"{module_name} has no Triton kernel {qualname} after import")
    return obj, fn


def _local_extern_libs(options):
    """The recorded options with each extern library (libdevice) that is not on this machine taken
    from this Triton's own lib directory: Triton hashes the file's bytes, not its path."""
    from triton.backends.nvidia import driver as nvidia

    libdir = pathlib.Path(nvidia.dirname) / "lib"
    libs = []
    for name, path in options.get("extern_libs") or []:
        if not os.path.exists(path):
            local = libdir / os.path.basename(path)
            if not local.is_file():
                raise FileNotFoundError(f"extern library {name} ({path}) is not in this Triton ({libdir})")
            path = str(local)
        libs.append([name, path])
    return dict(options, extern_libs=libs) if "extern_libs" in options else options


def _encode(value):
    """A constexpr's value as the recording holds it (tools/jit_cache/first_use_hooks.py to_json):
    tuples as lists, a kernel as {"jit_function": "module:qualname"}, anything else not JSON (a
    dtype) by its str."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if type(value).__name__ == "JITFunction":
        return {"jit_function": f"{value.module}:{value.fn.__qualname__}"}
    return str(value)


def _normal(value):
    return json.loads(json.dumps(value, default=str))


def _launch_options(key):
    """The options the recorded launch passed (num_warps, num_stages, ...): the dict at the end of
    the specialization's in-memory key (str(specialization) + str(options))."""
    for i in range(len(key) - 1, -1, -1):
        if key[i] == "{":
            try:
                value = ast.literal_eval(key[i:])
            except (ValueError, SyntaxError):
                continue
            return value if isinstance(value, dict) else {}
    return {}


def key_parts(fn, src, options, backend):
    """Each part of Triton's cache key of this compile, recomputed (runtime/cache.py
    get_cache_key, compiler.py ASTSource.hash), and the key they give."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime import cache

    parsed = backend.parse_options(dict(options or {}, **src.parse_options()))
    env = str(sorted(get_cache_invalidating_env_vars().items()))
    names = fn.arg_names
    parts = {
        "triton": cache.triton_key(),
        "source": src.hash(),
        "fn": fn.cache_key,
        "signature": str([v for _, v in sorted(src.signature.items())]),
        "constexprs": {names[p[0]] + "".join(f"[{i}]" for i in p[1:]): _encode(v)
                       for p, v in sorted(src.constants.items())},
        "attrs": str(src.attrs),
        "backend": backend.hash(),
        "options": parsed.hash(),
        "env": env,
    }
    joined = f"{parts['triton']}-{parts['source']}-{parts['backend']}-{parts['options']}-{env}"
    return parts, hashlib.sha256(joined.encode()).hexdigest(), parsed


def _short(value, n=40):
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= n else text[:n] + "..."


def _option_diffs(a_options, b_options):
    """{name: (a, b)} of the options that differ; extern libraries by name and file name (their
    paths differ by machine, Triton hashes their bytes)."""
    diffs = {}
    for name in sorted(set(a_options) | set(b_options)):
        a, b = a_options.get(name, "<absent>"), b_options.get(name, "<absent>")
        if name == "extern_libs":
            a = [[n, os.path.basename(p)] for n, p in a or []] if a != "<absent>" else a
            b = [[n, os.path.basename(p)] for n, p in b or []] if b != "<absent>" else b
        if _normal(a) != _normal(b):
            diffs[name] = (_normal(a), _normal(b))
    return diffs


def option_differences(recorded_hash, built_hash, spec, backend):
    """The options by name: Triton derives a launch's options from what the launch passed
    (num_warps, ..., in the specialization's key) and the target's defaults (parse_options). When
    that derivation gives the recorded hash, the recorded specialization's options were changed;
    else this build's Triton derives other options from the same launch than the recording's."""
    launch = _launch_options(spec.get("key", ""))
    spec_options = spec.get("options") or {}
    derived = backend.parse_options(dict(launch))
    if derived.hash() == recorded_hash:
        named = [f"option {n}: the recorded launch gives {json.dumps(a)}, the recorded specialization says {json.dumps(b)}"
                 for n, (a, b) in _option_diffs(derived.__dict__, spec_options).items()]
    else:
        named = [f"option {n}: recorded {json.dumps(a)}, this build's Triton derives {json.dumps(b)} from the same launch"
                 for n, (a, b) in _option_diffs(spec_options, derived.__dict__).items()]
    return named or [f"the options hash while every option matches (recorded {_short(recorded_hash, 16)}, this "
                     f"build's {_short(built_hash, 16)}): a library the options name (extern_libs) differs"]


def differences(recorded, built, spec, backend):
    """What differs between the recorded key parts and the rebuilt ones, most telling first, each
    a phrase naming the part and both values."""
    out = []
    if recorded.get("triton") != built["triton"]:
        out.append(f"Triton itself (triton_key: recorded {_short(recorded.get('triton'))}, this build's "
                   f"{_short(built['triton'])}): the recording ran another Triton build")
    if recorded.get("fn") != built["fn"]:
        out.append(f"the kernel's source or a function it calls (fn.cache_key: recorded "
                   f"{_short(recorded.get('fn'), 16)}, this build's {_short(built['fn'], 16)})")
    rec_c = _normal(recorded.get("constexprs") or {})
    built_c = _normal(built["constexprs"])
    for name in sorted(set(rec_c) | set(built_c)):
        if rec_c.get(name, "<absent>") != built_c.get(name, "<absent>"):
            out.append(f"constexpr {name}: {json.dumps(rec_c.get(name, '<absent>'))} in the recorded key, "
                       f"{json.dumps(built_c.get(name, '<absent>'))} in the recorded specialization")
    if recorded.get("signature") != built["signature"]:
        out.append(f"the signature (recorded {recorded.get('signature')}, replayed {built['signature']})")
    if recorded.get("attrs") != built["attrs"]:
        out.append(f"the attrs (recorded {recorded.get('attrs')}, replayed {built['attrs']})")
    if recorded.get("source") != built["source"] and not out:
        out.append("the source hash (ASTSource.hash) while fn, signature, constexprs and attrs match")
    if recorded.get("backend") != built["backend"]:
        out.append(f"the backend (ptxas version and arch: recorded {recorded.get('backend')!r}, this "
                   f"build's {built['backend']!r})")
    if recorded.get("options") != built["options"]:
        out.extend(option_differences(recorded.get("options"), built["options"], spec, backend))
    if recorded.get("env") != built["env"]:
        out.append(f"the environment Triton keys on (recorded {recorded.get('env')}, this build's {built['env']})")
    return out


def rebuild_triton(entry):
    """Replay one recorded specialization through JITFunction.preload; Triton compiles it (or its
    cache answers) under its own key."""
    _, fn = find_kernel(entry["kernel"])
    spec = dict(entry["specialization"])
    spec["options"] = _local_extern_libs(spec.get("options") or {})
    fn.device_caches[0]  # noqa: B018 -- creates the binder, which sets fn.compile
    captured = {}
    triton_compile = fn.compile

    def capturing_compile(src, target=None, options=None, _env_vars=None):
        captured.update(src=src, options=options)
        return triton_compile(src, target=target, options=options, _env_vars=_env_vars)

    fn.compile = capturing_compile
    try:
        kernel = fn.preload(json.dumps(spec))
    finally:
        fn.compile = triton_compile
    backend = fn.device_caches[0][3]
    parts, joined, parsed = key_parts(fn, captured["src"], captured["options"], backend)
    if joined != kernel.hash:
        raise RuntimeError(f"Triton's key {kernel.hash[:12]}... is not made of the parts this worker "
                           "recomputes: Triton changed how it keys (update triton_recorded_worker.key_parts)")
    differs = [] if kernel.hash == entry["key"] else differences(entry.get("key_parts") or {}, parts, spec, backend)
    return {"key": kernel.hash, "parts": parts, "differs": differs}


def _as_tuple(value):
    """The tuning key as Triton's autotuner holds it (a tuple; the recording's JSON has lists)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def autotune_key(entry, target):
    """The key and file name Triton's autotuner looks its disk cache up under for this kernel,
    tuning key and config list (runtime/autotuner.py check_disk_cache), and why it would not."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime import autotuner, cache

    obj, fn = find_kernel(entry["kernel"])
    tuner = obj
    while tuner is not None and not isinstance(tuner, autotuner.Autotuner):
        tuner = getattr(tuner, "fn", None)
    why = None
    if tuner is None:
        why = "the kernel is not autotuned where its module defines it"
    elif any(c.pre_hook for c in tuner.configs):
        why = "a config has a pre_hook (Triton never caches those)"
    elif not entry["tuning_key"]:
        why = "the tuning key is empty (Triton does not cache it)"
    parts = [
        cache.triton_key(),
        make_backend(GPUTarget(target["backend"], target["arch"], target["warp_size"])).hash(),
        fn.cache_key,
        str(sorted(get_cache_invalidating_env_vars().items())),
        str(_as_tuple(entry["tuning_key"])),
    ] + list(entry["configs"])
    return {"cache_key": hashlib.sha256("-".join(parts).encode()).hexdigest(),
            "file": f"{fn.__name__[:150]}.autotune.json", "why": why}


def prepare_sglang(device):
    """torch.cuda answering as the device and the `sglang` package without its __init__, as
    triton_worker.py runs SGLang's kernels (their modules query the device at import)."""
    from sglang_worker import fake_device
    from triton_worker import _NoDevice, import_sglang

    fake_device(tuple(device["capability"]), device["device_name"])
    import torch

    torch.cuda.device = _NoDevice
    torch.cuda._exchange_device = lambda index: 0
    torch.cuda._maybe_exchange_device = lambda index: 0
    import_sglang()
    stand_in_native_ops()


def stand_in_native_ops():
    """sgl_kernel as a stand-in where its CUDA library cannot load (it links libcuda.so.1, the
    driver's, and a build host has none). Modules holding recorded kernels import it for their
    CUDA ops (layernorm's rmsnorm, imported by attn_residual); the replay launches none of them,
    and what Triton keys (the kernel's source, its callees, constexprs, signature, options) never
    holds an sgl_kernel value, which the recorded key, compared for every entry, confirms."""
    import types

    try:
        import sgl_kernel  # noqa: F401
        return
    except ImportError:
        pass

    class NativeOpsStandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)

            def op(*args, **kwargs):
                raise RuntimeError(f"sgl_kernel.{name}: a stand-in of the replay (its CUDA library needs a driver)")
            return op

    for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
        del sys.modules[name]  # what the failed import left half-initialised
    sys.modules["sgl_kernel"] = NativeOpsStandIn("sgl_kernel")


def _each(entries, fn):
    rows = []
    for entry in entries:
        try:
            rows.append(fn(entry))
        except Exception as e:  # one entry's failure is reported with its entry
            rows.append({"error": f"{type(e).__name__}: {e}".strip().splitlines()[0],
                         "traceback": traceback.format_exc(limit=-8)})  # the frames nearest the error
    return rows


def main(request_path):
    request = json.loads(pathlib.Path(request_path).read_text())
    if request.get("sglang"):
        prepare_sglang(request["device"])
    from triton.runtime import cache, driver

    if request.get("triton_identity"):
        from triton_worker import key_as

        key_as(request["triton_identity"])
    driver.set_active(stand_in_driver(request["target"], request["device"]))
    result = {
        "triton_key": cache.triton_key(),
        "triton": _each(request["triton"], rebuild_triton),
        "autotune": _each(request["autotune"], lambda e: autotune_key(e, request["target"])),
    }
    pathlib.Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
