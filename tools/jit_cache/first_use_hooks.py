"""Records every first-use compile of one Python process of an SGLang server, and in verify mode
fails the process, naming the kernel, on any compile or cache miss after the server is ready.

Runs inside the image's python3.11 and on a GPU host, in every process the server spawns:
`tools/jit_cache/first_use_site/sitecustomize.py` (a directory put first on PYTHONPATH) loads it
at interpreter start. Standard library only at import, and it imports nothing of tools/: the
process it runs in is SGLang's, not the tools'. Nothing is imported or patched at start: a
post-import hook (a sys.meta_path finder) patches each library right after the server itself
imports it, so import order and startup are unchanged.

Configured by the environment:
  KIMI_K3_FIRST_USE_RECORD=DIR   each process writes DIR/<pid>.json (tools/jit_cache/recording.py
                                 reads and merges them): after each new entry at most every
                                 FLUSH_SECONDS, at ready, on a violation and at exit, each time
                                 whole (temp file + rename), so a killed server leaves its records.
  KIMI_K3_FIRST_USE_VERIFY=1     after ready, a compile or cache miss raises FirstUseCompileError
                                 naming kind, kernel and key, prints one line to stderr, and the
                                 process exits with VERIFY_EXIT_CODE even if the caller catches it.

Hook points (read in the pinned wheels of the pypi stack: Triton 3.8.0, SGLang 0.5.23,
flashinfer-python 0.7.2, nvidia-cutlass-dsl 4.8.0, torch 2.14.1):
  triton       knobs.runtime.jit_cache_hook (the specialization, before compile; returns None:
               a truthy return skips compile and launch), compiler.get_cache_key (the key's
               parts, by module attribute: compile() calls it by name), knobs.compilation.listener
               (every triton.compile: the disk key, hit or compiled), knobs.autotuning.listener
               (a benchmark ran or the autotune disk cache hit), Autotuner.prune_configs (the
               configs the autotune disk key holds) and Autotuner.__init__ (the live autotuners,
               whose `cache` is read at exit).
  ready        sglang.srt.utils.triton_load_watch.mark_serving_started and
               Scheduler.run_event_loop (SGLang's own "serving started": after model load,
               CUDA-graph capture and FlashInfer autotune, before the HTTP warmup request). A
               process that never becomes ready itself (no Scheduler constructed in it: the HTTP
               server, the detokenizer, compile workers) takes ready from the marker file the
               first ready process writes.
  sglang-jit   compile.cache.compute_build_key (module, build key, caller), loader._find_prebuilt
               (hit or miss), compile.ninja.build (a build ran).
  cute-dsl     CompileCallable._compile (cute.compile, cute.compile[...], cute.experimental.compile)
               and SGLang's JITPersistentCache._try_load_from_storage (the persistent key).
  flashinfer   JitSpec.build_and_load and the spec class's build (a build; loading an AOT or
               cached module is not a compile).
  inductor     FxGraphCache.prepare_key (the FX graph key) and compile_fx.fx_codegen_and_compile.
"""
from __future__ import annotations

import atexit
import base64
import hashlib
import importlib.abc
import json
import os
import sys
import tempfile
import threading
import time
import weakref

RECORD_ENV = "KIMI_K3_FIRST_USE_RECORD"
VERIFY_ENV = "KIMI_K3_FIRST_USE_VERIFY"
# The pid of the first recorded process of a run, inherited by every process it spawns: the ready
# marker's name, and what tells two runs' records apart in one directory.
ROOT_ENV = "KIMI_K3_FIRST_USE_ROOT"
SCHEMA_VERSION = 1
FLUSH_SECONDS = 2.0
VERIFY_EXIT_CODE = 3
BEFORE_READY, AFTER_READY = "before_ready", "after_ready"
# Environment variables a recording keeps (besides those that enter Triton's key): the ones that
# change what serving compiles or where it finds it. The recorder's own are left out (a directory
# differs per run); a value whose name looks like a secret is never written.
ENV_PREFIXES = ("KIMI_", "SGLANG_", "TRITON_", "FLASHINFER_", "CUTE_", "CUTLASS_")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "PRIVATE")


class FirstUseCompileError(RuntimeError):
    """A compile or cache miss after the server was ready, in verify mode."""


def to_json(value):
    """A Python value as JSON the recording can hold: tuples as lists, a dtype or any object
    that is not JSON by its str, an object's keys as strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if type(value).__name__ == "JITFunction":  # a kernel passed as a constexpr
        return {"jit_function": f"{value.module}:{value.fn.__qualname__}"}
    return str(value)


def triton_dir_key(hex_digest):
    """The directory Triton keeps an entry in under TRITON_CACHE_DIR: its sha256, base32
    (triton/runtime/cache.py get_cache_manager)."""
    return base64.b32encode(bytes.fromhex(hex_digest)).decode("ascii").rstrip("=")


class Recorder:
    """One process's entries, its phase, and its violations; written whole to DIR/<pid>.json."""

    def __init__(self, record_dir, verify):
        self.record_dir, self.verify = record_dir, verify
        self.lock = threading.RLock()
        self.local = threading.local()
        self.reset_process()
        self.drop_own_marker()  # a stale one, of an earlier process tree whose root had this pid

    def drop_own_marker(self):
        """The root process removes a ready marker kept in the temp directory (no record
        directory): another process tree whose root gets this pid later must not start ready."""
        if self.record_dir is None and self.root == str(self.pid):
            try:
                os.unlink(self.ready_marker())
            except OSError:
                pass

    def reset_process(self):
        """State of a fresh process (also after fork: the child records only its own compiles)."""
        self.pid = os.getpid()
        self.root = os.environ.get(ROOT_ENV) or str(self.pid)
        self.entries, self.index = [], {}
        self.violations = []
        self.ready = False
        self.expects_own_ready = False  # a Scheduler was constructed here: it marks ready itself
        self.dirty, self.last_flush, self.timer = False, 0.0, None
        self.autotuners = []  # weak references to every Autotuner made in this process
        self.pending_parts = {}  # id(ASTSource) -> (key_parts, specialization), until the listener

    # -- phase ---------------------------------------------------------------------------------
    def ready_marker(self):
        base = self.record_dir or tempfile.gettempdir()
        return os.path.join(base, f"kimi-k3-first-use-ready.{self.root}")

    def phase(self):
        if not self.ready and not self.expects_own_ready and os.path.exists(self.ready_marker()):
            self.ready = True  # ready taken from the first process that became ready
        return AFTER_READY if self.ready else BEFORE_READY

    def mark_ready(self):
        with self.lock:
            if self.ready and self.expects_own_ready:
                return
            self.ready = self.expects_own_ready = True
            try:
                with open(self.ready_marker(), "a", encoding="ascii"):
                    pass
            except OSError as e:
                print(f"kimi-k3 first-use: cannot write the ready marker {self.ready_marker()} ({e})",
                      file=sys.stderr)
            self.flush()

    # -- entries -------------------------------------------------------------------------------
    def add(self, identity, entry, merge=None):
        """Record `entry` under `identity`; a second one merges into the first (`merge(old, new)`)."""
        with self.lock:
            old = self.index.get(identity)
            if old is None:
                self.index[identity] = entry
                self.entries.append(entry)
            elif merge is not None:
                merge(old, entry)
            else:
                return
            self.dirty = True
            self.flush_soon()

    def violation(self, kind, name, key, what):
        """Verify mode: a compile or miss after ready. Recorded, flushed, one stderr line, raised."""
        message = (f"kimi-k3 first-use verify: {kind} {name} {what} after the server was ready "
                   f"(key {key}); build it ahead of time or add it to the warm-up "
                   f"(jit_cache/README.md \"Recording what serving compiles\")")
        with self.lock:
            self.violations.append(message)
            self.dirty = True
            self.flush()
        print(message, file=sys.stderr, flush=True)
        raise FirstUseCompileError(message)

    def check(self, kind, name, key, compiled, what="compiled"):
        if compiled and self.verify and self.phase() == AFTER_READY:
            self.violation(kind, name, key, what)

    # -- writing -------------------------------------------------------------------------------
    def flush_soon(self):
        if not self.record_dir:
            return
        now = time.monotonic()
        if now - self.last_flush >= FLUSH_SECONDS:
            self.flush()
        elif self.timer is None:
            self.timer = threading.Timer(FLUSH_SECONDS, self.flush)
            self.timer.daemon = True
            self.timer.start()

    def document(self):
        return {"schema_version": SCHEMA_VERSION, "pid": self.pid, "root": self.root,
                "argv": [str(a) for a in sys.argv], "ready": self.ready,
                "expects_own_ready": self.expects_own_ready, "triton_key": self.triton_key(),
                "env": recorded_env(), "violations": list(self.violations),
                "entries": [dict(e) for e in self.entries]}

    def triton_key(self):
        """triton_key() of this process's Triton, once Triton is imported (never imported here)."""
        if "triton.runtime.cache" not in sys.modules:
            return None
        try:
            return sys.modules["triton.runtime.cache"].triton_key()
        except Exception as e:  # a broken Triton must not lose the record
            return f"unavailable: {type(e).__name__}: {e}"

    def flush(self):
        with self.lock:
            self.timer = None
            if not self.record_dir or os.getpid() != self.pid:
                return
            self.last_flush = time.monotonic()
            self.dirty = False
            path = os.path.join(self.record_dir, f"{self.pid}.json")
            tmp = os.path.join(self.record_dir, f".{self.pid}.json.tmp")
            try:
                os.makedirs(self.record_dir, exist_ok=True)
                with open(tmp, "w", encoding="ascii") as f:
                    json.dump(self.document(), f, sort_keys=True, indent=1)
                os.replace(tmp, path)
            except (OSError, TypeError, ValueError) as e:
                print(f"kimi-k3 first-use: cannot write {path} ({type(e).__name__}: {e})", file=sys.stderr)

    def at_exit(self):
        if os.getpid() != self.pid:
            return
        try:
            self.scan_autotuners()
        except Exception as e:  # reported, never in the way of the exit itself
            print(f"kimi-k3 first-use: autotuner scan failed ({type(e).__name__}: {e})", file=sys.stderr)
        self.flush()
        self.drop_own_marker()
        if self.violations:
            # Registered before the server's own handlers, so this runs after them; an exception
            # the server caught must still fail the process.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(VERIFY_EXIT_CODE)

    def scan_autotuners(self):
        """Winners every live Autotuner holds (`cache`: tuning key -> config) that no listener
        call reported: a key with one config left after pruning, or a cache filled by hand."""
        for ref in self.autotuners:
            tuner = ref()
            if tuner is None:
                continue
            jit_fn = innermost_jit(tuner)
            kernel = kernel_name(jit_fn)
            for tuning_key, config in list(getattr(tuner, "cache", {}).items()):
                identity = ("triton-autotune", kernel, json.dumps(to_json(tuning_key)), "scan")
                if any(i[:3] == identity[:3] for i in self.index):
                    continue
                configs = list(getattr(tuner, "configs", []))
                self.add(identity, {
                    "kind": "triton-autotune", "kernel": kernel, "tuning_key": to_json(tuning_key),
                    "configs": [str(c) for c in configs], "winner": config_json(config),
                    "cache_key": None, "cacheable": bool(tuning_key) and not any(c.pre_hook for c in configs),
                    "cache_hit": None, "phase": self.phase()})


def recorded_env():
    """The variables that enter Triton's key, and the ones ENV_PREFIXES names that are set."""
    names = set()
    triton_c = sys.modules.get("triton._C.libtriton")
    if triton_c is not None:
        try:
            names.update(triton_c.get_cache_invalidating_env_vars())
        except Exception:
            pass
    names.update(n for n in os.environ if n.startswith(ENV_PREFIXES))
    env = {}
    for name in sorted(names):
        if name in (RECORD_ENV, ROOT_ENV) or name not in os.environ:
            continue
        env[name] = "<not recorded: a secret>" if any(w in name.upper() for w in SECRET_WORDS) else os.environ[name]
    return env


def kernel_name(jit_fn):
    """`module:qualname` of a @triton.jit function (an inventory site's name)."""
    fn = getattr(jit_fn, "fn", None)
    if fn is None:
        return str(getattr(jit_fn, "name", jit_fn))
    return f"{getattr(jit_fn, 'module', fn.__module__)}:{fn.__qualname__}"


def innermost_jit(fn):
    while type(fn).__name__ != "JITFunction" and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def config_json(config):
    return to_json({k: v for k, v in vars(config).items() if k != "pre_hook"})


RECORDER = None


# -- Triton ------------------------------------------------------------------------------------
def install_triton(_module):
    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime import autotuner, cache, jit

    rec = RECORDER

    # The specialization, before compile: pending until this thread's compile takes the key.
    previous_hook = knobs.runtime.jit_cache_hook

    def jit_cache_hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        result = None
        if previous_hook is not None:
            result = previous_hook(key=key, repr=repr, fn=fn, compile=compile,
                                   is_manual_warmup=is_manual_warmup, already_compiled=already_compiled)
        try:
            spec = json.loads(compile["specialization_data"])
        except (KeyError, TypeError, ValueError) as e:
            spec = {"unrecorded": f"{type(e).__name__}: {e}"}
        pending = getattr(rec.local, "specializations", None)
        if pending is None:
            pending = rec.local.specializations = {}
        pending[id(fn.jit_function)] = spec
        return result  # never truthy from here: a truthy return skips compile and launch

    knobs.runtime.jit_cache_hook = jit_cache_hook

    # A constant that is not JSON makes Triton's serializer raise, only because a hook is set:
    # keep the launch working and record why the specialization is missing.
    serialize = jit.serialize_specialization_data

    def serialize_specialization_data(name, signature, constants, attrs, options, key, target):
        try:
            return serialize(name, signature, constants, attrs, options, key, target)
        except (TypeError, ValueError) as e:
            return json.dumps({"name": name, "unserializable": f"{type(e).__name__}: {e}"})

    jit.serialize_specialization_data = serialize_specialization_data

    # The disk key's parts, as compile() takes them (it calls get_cache_key by module attribute).
    get_cache_key = compiler.get_cache_key

    def get_cache_key_recorded(src, backend, backend_options, env_vars):
        key = get_cache_key(src, backend, backend_options, env_vars)
        try:
            parts = triton_key_parts(cache, src, backend, backend_options, env_vars)
        except Exception as e:  # a part Triton renamed: the entry still names the kernel
            parts = {"unrecorded": f"{type(e).__name__}: {e}"}
        spec = None
        fn = getattr(src, "fn", None)
        pending = getattr(rec.local, "specializations", None)
        if fn is not None and pending:
            spec = pending.pop(id(fn), None)
        with rec.lock:
            rec.pending_parts[id(src)] = (parts, spec)
        if rec.verify and knobs.runtime.add_stages_inspection_hook is None:
            # Look where compile() will look, before it compiles.
            digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
            name = f"{src.name[:150]}.json"
            group = cache.get_cache_manager(digest).get_group(name)
            if not group or name not in group or knobs.compilation.always_compile:
                if rec.phase() == AFTER_READY:
                    rec.violation("triton", src_kernel(src), triton_dir_key(digest), "would compile (not in TRITON_CACHE_DIR)")
                # A miss before ready: written now, with the key's parts and the specialization,
                # since with the compilers hidden the compile fails and takes the process along
                # (the replay on an H100 lost which specialization missed that way).
                rec.add(("triton", src_kernel(src), triton_dir_key(digest)),
                        {"kind": "triton", "kernel": src_kernel(src), "key": triton_dir_key(digest),
                         "key_parts": parts, "specialization": spec, "phase": rec.phase(), "cache_hit": False},
                        merge_triton)
                rec.flush()
        return key

    compiler.get_cache_key = get_cache_key_recorded

    previous_listener = knobs.compilation.listener

    def compilation_listener(*, src, metadata, metadata_group, times, cache_hit):
        if previous_listener is not None:
            previous_listener(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                              cache_hit=cache_hit)
        with rec.lock:
            parts, spec = rec.pending_parts.pop(id(src), (None, None))
        digest = metadata.get("hash")
        key = triton_dir_key(digest) if isinstance(digest, str) else None
        kernel = src_kernel(src)
        entry = {"kind": "triton", "kernel": kernel, "key": key, "key_parts": parts,
                 "specialization": spec, "phase": rec.phase(), "cache_hit": bool(cache_hit)}
        rec.add(("triton", kernel, key), entry, merge_triton)
        rec.check("triton", kernel, key, not cache_hit)

    knobs.compilation.listener = compilation_listener

    # Autotuning: the configs left after pruning are part of the autotune disk key.
    prune_configs = autotuner.Autotuner.prune_configs

    def prune_configs_recorded(self, kwargs, *args, **kw):
        pruned = prune_configs(self, kwargs, *args, **kw)
        pending = getattr(rec.local, "pruned", None)
        if pending is None:
            pending = rec.local.pruned = {}
        pending[id(innermost_jit(self))] = list(pruned)
        return pruned

    autotuner.Autotuner.prune_configs = prune_configs_recorded

    init = autotuner.Autotuner.__init__

    def init_recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rec.autotuners.append(weakref.ref(self))

    autotuner.Autotuner.__init__ = init_recorded

    previous_autotune = knobs.autotuning.listener

    def autotuning_listener(*, fn, key, best_config, configs_timings, duration, cache_hit):
        if previous_autotune is not None:
            previous_autotune(fn=fn, key=key, best_config=best_config, configs_timings=configs_timings,
                              duration=duration, cache_hit=cache_hit)
        pending = getattr(rec.local, "pruned", None) or {}
        configs = pending.pop(id(fn), None)
        if configs is None:  # the benchmark's (or the disk file's) configs, in their order
            configs = list(configs_timings or {})
        kernel = kernel_name(fn)
        cache_key = autotune_dir_key(autotuner, fn, key, configs)
        entry = {"kind": "triton-autotune", "kernel": kernel, "tuning_key": to_json(key),
                 "configs": [str(c) for c in configs], "winner": config_json(best_config),
                 "cache_key": cache_key, "cacheable": bool(key) and not any(c.pre_hook for c in configs),
                 "cache_hit": bool(cache_hit), "phase": rec.phase()}
        rec.add(("triton-autotune", kernel, json.dumps(to_json(key)), cache_key), entry, merge_autotune)
        rec.check("triton-autotune", kernel, cache_key, not cache_hit, "benchmarked its configs")

    knobs.autotuning.listener = autotuning_listener


def src_kernel(src):
    fn = getattr(src, "fn", None)
    return kernel_name(fn) if fn is not None else str(getattr(src, "name", src))


def triton_key_parts(cache, src, backend, options, env_vars):
    """What Triton's disk key is made of (runtime/cache.py get_cache_key, compiler.py ASTSource.hash):
    sha256(f"{triton}-{source}-{backend}-{options}-{env}"), source = sha256(f"{fn}-{attrs}-{signature}-{constants}")."""
    parts = {"triton": cache.triton_key(), "source": src.hash(), "backend": backend.hash(),
             "options": options.hash(), "env": str(sorted(env_vars.items()))}
    fn = getattr(src, "fn", None)
    if fn is None:  # an IR file given to triton.compile: only its hash is known
        return parts
    names = list(getattr(fn, "arg_names", []))

    def constexpr_name(path):
        head = names[path[0]] if path and path[0] < len(names) else str(path)
        return head + "".join(f"[{i}]" for i in path[1:])

    get_key = lambda x: x.cache_key if hasattr(x, "cache_key") else str(x)  # noqa: E731 (as Triton)
    parts.update({
        "fn": fn.cache_key,
        "attrs": str(src.attrs),
        "signature": str([v for _, v in sorted(src.signature.items())]),
        "constants": "-".join(get_key(v) for _, v in sorted(src.constants.items())),
        "constexprs": {constexpr_name(k): to_json(v) for k, v in sorted(src.constants.items())},
    })
    return parts


def autotune_dir_key(autotuner, fn, tuning_key, configs):
    """The autotune disk cache's directory for this key (runtime/autotuner.py check_disk_cache),
    whether or not this run used the disk cache."""
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        parts = [autotuner.triton_key(), make_backend(driver.active.get_current_target()).hash(), fn.cache_key,
                 str(sorted(autotuner.get_cache_invalidating_env_vars().items())), str(tuning_key)]
        parts += [str(c) for c in configs]
        return triton_dir_key(hashlib.sha256("-".join(parts).encode("utf-8")).hexdigest())
    except Exception:  # no active driver (a process that never launched): no key
        return None


def merge_triton(old, new):
    old["cache_hit"] = old["cache_hit"] and new["cache_hit"]
    for field in ("key_parts", "specialization"):
        if old.get(field) is None:
            old[field] = new.get(field)


def merge_autotune(old, new):
    if old.get("cache_hit") is not None and new.get("cache_hit") is not None:
        old["cache_hit"] = old["cache_hit"] and new["cache_hit"]


# -- ready -------------------------------------------------------------------------------------
def install_triton_load_watch(module):
    mark = module.mark_serving_started

    def mark_serving_started(*args, **kwargs):
        RECORDER.mark_ready()
        return mark(*args, **kwargs)

    module.mark_serving_started = mark_serving_started


def install_scheduler(module):
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None:
        return
    init, loop = scheduler.__init__, scheduler.run_event_loop

    def init_recorded(self, *args, **kwargs):
        RECORDER.expects_own_ready = True  # this process marks ready itself: no marker adopted
        return init(self, *args, **kwargs)

    def run_event_loop(self, *args, **kwargs):
        RECORDER.mark_ready()
        return loop(self, *args, **kwargs)

    scheduler.__init__ = init_recorded
    scheduler.run_event_loop = run_event_loop


# -- SGLang JIT --------------------------------------------------------------------------------
def load_jit_caller():
    """`module:function` and the arguments of the function that called load_jit (the function
    jit_cache/sglang_modules.json names), from the stack."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "load_jit":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    while caller is not None and caller.f_code.co_name in ("wrapper", "inner", "_fn"):  # cache decorators
        caller = caller.f_back
    if caller is None:
        return None, {}
    code = caller.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    args = {n: to_json(caller.f_locals[n]) for n in names if n in caller.f_locals}
    qualname = getattr(code, "co_qualname", code.co_name)
    return f"{caller.f_globals.get('__name__', '?')}:{qualname}", args


def install_sglang_jit(loader):
    from sglang.kernels.jit.utils.compile import cache, ninja

    rec = RECORDER
    compute_build_key = cache.compute_build_key

    def compute_build_key_recorded(spec, *args, **kwargs):
        build_key = compute_build_key(spec, *args, **kwargs)
        function, arguments = load_jit_caller()
        call = {"function": function, "args": arguments, "module_args": to_json(spec.module_args),
                "cpp_wrappers": to_json(spec.cpp_wrappers), "cuda_wrappers": to_json(spec.cuda_wrappers)}
        rec.local.sglang_jit = {"kind": "sglang-jit", "module": spec.module_name, "build_key": build_key,
                                "call": call, "hit": True, "phase": rec.phase(), "lookups": 0}
        return build_key

    cache.compute_build_key = compute_build_key_recorded

    find_prebuilt = loader._find_prebuilt

    def find_prebuilt_recorded(*, spec, scope):
        found = find_prebuilt(spec=spec, scope=scope)
        entry = getattr(rec.local, "sglang_jit", None)
        if entry is not None and entry["module"] == spec.module_name:
            entry["lookups"] += 1
            if entry["lookups"] == 1:  # the first lookup decides: a miss here is a first-use miss
                entry["hit"] = found is not None
                rec.add(sglang_jit_identity(entry), {k: v for k, v in entry.items() if k != "lookups"},
                        merge_hit)
                rec.check("sglang-jit", entry["module"], entry["build_key"], found is None, "missed its cached build")
        return found

    loader._find_prebuilt = find_prebuilt_recorded

    build = ninja.build

    def build_recorded(*args, **kwargs):
        entry = getattr(rec.local, "sglang_jit", None)
        if entry is not None:  # a miss behind the lock after a hit on the fast path: a build all the same
            with rec.lock:
                recorded = rec.index.get(sglang_jit_identity(entry))
                if recorded is not None and recorded["hit"]:
                    recorded["hit"] = False
                    rec.dirty = True
                    rec.flush_soon()
        return build(*args, **kwargs)

    ninja.build = build_recorded


def sglang_jit_identity(entry):
    return ("sglang-jit", entry["module"], entry["build_key"])


def merge_hit(old, new):
    old["hit"] = old["hit"] and new["hit"]


# -- CuTe-DSL ----------------------------------------------------------------------------------
def install_cute(module):
    rec = RECORDER
    # cute.compile, cute.compile[...] (a new instance) and cute.experimental.compile share this class.
    compile_callable = type(module.compile)
    compile_ = compile_callable._compile

    def compile_recorded(self, func, *args, **kwargs):
        function = cute_function_name(func)
        key = getattr(rec.local, "cute_miss", None)
        rec.local.cute_miss = None
        rec.add(("cute-dsl", function, key or ""), {"kind": "cute-dsl", "function": function, "key": key,
                                                    "phase": rec.phase()})
        rec.check("cute-dsl", function, key, True)
        return compile_(self, func, *args, **kwargs)

    compile_callable._compile = compile_recorded


def cute_function_name(func):
    target = getattr(func, "__func__", None) or (func if callable(func) and hasattr(func, "__qualname__")
                                                 else type(func).__call__)
    while hasattr(target, "__wrapped__"):
        target = target.__wrapped__
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def install_cute_aot_cache(module):
    rec = RECORDER
    persistent = module.JITPersistentCache
    load = persistent._try_load_from_storage

    def load_recorded(self, key):
        found = load(self, key)
        # A miss is followed by cute.compile of this key in this thread: that compile's key.
        rec.local.cute_miss = None if found else f"{self.cache_path.name}/{self._key_to_hash(key)}"
        return found

    persistent._try_load_from_storage = load_recorded


# -- FlashInfer --------------------------------------------------------------------------------
def install_flashinfer(core):
    rec = RECORDER
    build_and_load = core.JitSpec.build_and_load

    def build_and_load_recorded(self):
        wrap_build(type(self))
        name = spec_name(self)
        rec.add(("flashinfer", name, ""), {"kind": "flashinfer", "module": name, "built": False, "phase": rec.phase()})
        return build_and_load(self)

    core.JitSpec.build_and_load = build_and_load_recorded

    def wrap_build(cls):
        if cls.__dict__.get("_kimi_k3_build_recorded"):
            return
        build = cls.build

        def build_recorded(self, *args, **kwargs):
            name = spec_name(self)
            entry = {"kind": "flashinfer", "module": name, "built": True, "phase": rec.phase()}
            rec.add(("flashinfer", name, ""), entry, merge_built)
            rec.check("flashinfer", name, None, True, "built its JIT module")
            return build(self, *args, **kwargs)

        cls.build = build_recorded
        cls._kimi_k3_build_recorded = True


def spec_name(spec):
    """JitSpec.name (nvcc modules: the module; CuTe-DSL specs: `<module dir>/<kernel>`)."""
    return str(getattr(spec, "name", None) or type(spec).__qualname__)


def merge_built(old, new):
    if new["built"] and not old["built"]:
        old["built"], old["phase"] = True, new["phase"]


# -- TorchInductor -----------------------------------------------------------------------------
def install_inductor(compile_fx):
    from torch._inductor.codecache import FxGraphCache

    rec = RECORDER
    prepare_key = FxGraphCache.prepare_key

    def prepare_key_recorded(*args, **kwargs):
        key_info, cache_info = prepare_key(*args, **kwargs)
        rec.local.fx_key = key_info[0] if key_info else None
        return key_info, cache_info

    FxGraphCache.prepare_key = staticmethod(prepare_key_recorded)
    codegen = compile_fx.fx_codegen_and_compile

    def fx_codegen_and_compile(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
        key = getattr(rec.local, "fx_key", None)
        rec.local.fx_key = None
        graph = compile_region_name or type(gm).__name__
        rec.add(("inductor", graph, key or ""), {"kind": "inductor", "graph": graph, "key": key, "phase": rec.phase()})
        rec.check("inductor", graph, key, True)
        return codegen(gm, example_inputs, inputs_to_check, compile_region_name=compile_region_name, **graph_kwargs)

    compile_fx.fx_codegen_and_compile = fx_codegen_and_compile


# -- the post-import hook ----------------------------------------------------------------------
INSTALLERS = {
    "triton": install_triton,
    "sglang.srt.utils.triton_load_watch": install_triton_load_watch,
    "sglang.srt.managers.scheduler": install_scheduler,
    "sglang.kernels.jit.utils.compile.loader": install_sglang_jit,
    "sglang.kernels.jit.cute_aot_cache": install_cute_aot_cache,
    "cutlass.cute": install_cute,
    "flashinfer.jit.core": install_flashinfer,
    "torch._inductor.compile_fx": install_inductor,
}


def run_installer(name, module):
    try:
        INSTALLERS[name](module)
    except Exception as e:  # a library that moved: say so, never break the server's import
        print(f"kimi-k3 first-use: cannot hook {name} ({type(e).__name__}: {e}); its compiles are not "
              f"recorded", file=sys.stderr)


class _PostImportLoader:
    """The module's own loader, then the installer; restored on the module once it ran."""

    def __init__(self, loader, name):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        run_installer(self.name, module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name, asks the finders after it and wraps the loader."""

    def __init__(self):
        self.busy = set()

    def find_spec(self, name, path, target=None):
        if name not in INSTALLERS or name in self.busy:
            return None
        self.busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _PostImportLoader(spec.loader, name)
                    return spec
            return None
        finally:
            self.busy.discard(name)


def install():
    """Install from the environment (sitecustomize calls it); nothing when neither variable is set."""
    global RECORDER
    record_dir = os.environ.get(RECORD_ENV) or None
    verify = os.environ.get(VERIFY_ENV, "") not in ("", "0")
    if RECORDER is not None or not (record_dir or verify):
        return RECORDER
    os.environ.setdefault(ROOT_ENV, str(os.getpid()))
    RECORDER = Recorder(os.path.abspath(record_dir) if record_dir else None, verify)
    atexit.register(RECORDER.at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=RECORDER.reset_process)
    sys.meta_path.insert(0, PostImportFinder())
    for name in INSTALLERS:  # imported before us (never from sitecustomize; a caller that is late)
        if name in sys.modules:
            run_installer(name, sys.modules[name])
    return RECORDER


def mark_ready():
    """Mark this process ready by hand (a process that is not SGLang's scheduler, tests)."""
    if RECORDER is not None:
        RECORDER.mark_ready()
