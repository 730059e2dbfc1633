"""The first-use compile recorder (tools/jit_cache/first_use_hooks.py, installed by
tools/jit_cache/first_use_site/sitecustomize.py) and the recordings it makes
(tools/jit_cache/recording.py), on the pinned Triton with a stand-in device: each run is a fresh
Python process with the site directory first on PYTHONPATH, as every process an SGLang server
spawns; it launches a generated @triton.jit kernel and an @triton.autotune'd one through Triton's
own launch path (the stand-in answers as an SM90 GPU, its launch does nothing and its benchmark
returns a constant; Triton compiles with its own ptxas), and marks "ready" through a stand-in of
SGLang's triton_load_watch.

KIMI_FIRST_USE_TRITON: the pinned Triton (triton-3.8.0, cp311): its wheel (Bazel passes it) or
the wheel unpacked. Without Bazel:
    python3 -m tools.fetch fetch --pin triton-3.8.0     # prints the wheel's path
    KIMI_FIRST_USE_TRITON=WHEEL python3 tests/cpu/jit_cache/test_first_use_recorder.py
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).absolute().parents[3]
sys.path.insert(0, str(REPO))

from tools.common.errors import UserError  # noqa: E402
from tools.jit_cache import recording  # noqa: E402

SITE = REPO / "tools" / "jit_cache" / "first_use_site"
KERNELS = "first_use_kernels"

# The fixtures: two kernels, a stand-in device and a stand-in of SGLang's ready mark (no upstream code).
KERNELS_PY = '''
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)],
                 key=["n"], cache_results=True)
@triton.jit
def scale(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)
'''

# argv: steps, `add_one:<BLOCK>`, `scale:<n>` or `ready`; a step that raises is reported and the
# script goes on and exits 0, as a server that catches the error would.
RUN_PY = '''
import sys

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia
from triton.runtime import driver


class Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
                "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}

    def load_binary(self, name, kernel, shared, device):
        return (1, 1, 0, 0, 1024)

    def unload_module(self, *args):
        pass


class Launcher:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        pass


class StandInSM90(nvidia.CudaDriver):
    def __init__(self):  # no CudaUtils: it would build a C module against libcuda
        self.utils, self.launcher_cls = Utils(), Launcher
        self.get_device_capability = lambda device=None: (9, 0)
        self.get_current_stream = lambda device=None: 0
        self.get_current_device = lambda: 0
        self.set_current_device = lambda device: None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_benchmarker(self):
        def bench(fn, quantiles=None, **kwargs):
            fn()
            return [1.0, 1.0, 1.0] if quantiles else 1.0
        return bench

    def get_empty_cache_for_benchmark(self):
        return None

    def clear_cache(self, cache):
        pass

    @staticmethod
    def is_active():
        return True


class Buffer:
    """What Triton reads of a tensor argument: its dtype and a 16-byte aligned address."""
    dtype = tl.float32

    def data_ptr(self):
        return 1 << 20


driver.set_active(StandInSM90())
import first_use_kernels as k
from sglang.srt.utils import triton_load_watch

for step in sys.argv[1:]:
    try:
        if step == "ready":
            triton_load_watch.mark_serving_started()
        elif step.startswith("add_one:"):
            k.add_one[(1,)](Buffer(), 100, BLOCK=int(step.split(":")[1]))
        elif step.startswith("scale:"):
            k.scale[(1,)](Buffer(), int(step.split(":")[1]))
    except Exception as e:
        print(f"caught: {type(e).__name__}: {e}")
'''

READY_PY = '''
"""Stand-in of SGLang's triton_load_watch: only the names the recorder wraps."""


def install():
    pass


def mark_serving_started():
    pass
'''


# Stand-ins of the other libraries' hook points: only the names and call shapes the recorder wraps
# (read in the pinned wheels: SGLang 0.5.23's JIT loader and CuTe AOT cache, flashinfer 0.7.2's
# JitSpec, nvidia-cutlass-dsl 4.8.0's cute.compile, torch 2.14.1's inductor). Each compile writes a
# file under $STANDIN_CACHE, which later processes find: a hit.
STANDINS = {
    "sglang/kernels/__init__.py": "",
    "sglang/kernels/jit/__init__.py": "",
    "sglang/kernels/jit/utils/__init__.py": "",
    "sglang/kernels/jit/utils/compile/__init__.py":
        "from sglang.kernels.jit.utils.compile.loader import load_jit\n",
    "sglang/kernels/jit/utils/compile/cache.py": '''
import hashlib


def compute_build_key(spec, *, build_file):
    return hashlib.sha256((build_file + spec.module_name).encode()).hexdigest()[:16]
''',
    "sglang/kernels/jit/utils/compile/ninja.py": '''
def build(*, spec, build_dir, build_file):
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "module.so").write_text(build_file)
    return build_dir / "module.so"
''',
    "sglang/kernels/jit/utils/compile/loader.py": '''
import os
import pathlib

from sglang.kernels.jit.utils.compile import cache, ninja


class BuildSpec:
    def __init__(self, args):
        self.module_args = tuple(args)
        self.cpp_wrappers, self.cuda_wrappers = (), (("run", "Kernel<" + args[-1] + ">"),)

    @property
    def module_name(self):
        return "sgl_kernel_jit_" + "_".join(self.module_args)


def load_jit(*args):
    spec = BuildSpec(args)
    build_key = cache.compute_build_key(spec, build_file="rule cc")
    scope = pathlib.Path(os.environ["STANDIN_CACHE"]) / "sglang" / spec.module_name / build_key
    if _find_prebuilt(spec=spec, scope=scope) is not None:
        return "loaded"
    if _find_prebuilt(spec=spec, scope=scope) is not None:  # behind the lock
        return "loaded"
    ninja.build(spec=spec, build_dir=scope, build_file="rule cc")
    return "built"


def _find_prebuilt(*, spec, scope):
    return scope if (scope / "module.so").exists() else None
''',
    "sglang/kernels/demo.py": '''
from sglang.kernels.jit.utils.compile import load_jit


def _jit_demo_module(dtype):
    return load_jit("demo", dtype)
''',
    "sglang/kernels/jit/cute_aot_cache.py": '''
import hashlib
import os
import pathlib


class JITPersistentCache:
    def __init__(self, name):
        self.cache_path = pathlib.Path(os.environ["STANDIN_CACHE"]) / "cute" / name
        self.cache = {}

    def _key_to_hash(self, key):
        return hashlib.sha256(repr(key).encode()).hexdigest()

    def _try_load_from_storage(self, key):
        return (self.cache_path / (self._key_to_hash(key) + ".o")).exists()

    def __contains__(self, key):
        return key in self.cache or self._try_load_from_storage(key)

    def __setitem__(self, key, fn):
        self.cache[key] = fn
        self.cache_path.mkdir(parents=True, exist_ok=True)
        (self.cache_path / (self._key_to_hash(key) + ".o")).write_text("o")
''',
    "cutlass/__init__.py": "",
    "cutlass/cute/__init__.py": '''
class CompileCallable:
    def __init__(self, options=None):
        self.options = options

    def __getitem__(self, options):
        return CompileCallable(options)

    def __call__(self, *args, **kwargs):
        return self._compile(*args, **kwargs)

    def _compile(self, func, *args, **kwargs):
        return func


compile = CompileCallable()
''',
    "flashinfer/__init__.py": "",
    "flashinfer/jit/__init__.py": "",
    "flashinfer/jit/core.py": '''
import os
import pathlib


class JitSpec:
    def build_and_load(self):
        cached = self.try_load()
        if cached is not None:
            return cached
        self.build()
        return self.load()


class JitSpecNvcc(JitSpec):
    def __init__(self, name, aot=False):
        self.name, self.aot = name, aot
        self.path = pathlib.Path(os.environ["STANDIN_CACHE"]) / "flashinfer" / name

    def try_load(self):
        return "aot" if self.aot else None  # only an AOT module loads without build()

    def build(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("so")

    def load(self):
        return "jit"
''',
    "torch/__init__.py": "",
    "torch/_inductor/__init__.py": "",
    "torch/_inductor/codecache.py": '''
class FxGraphCache:
    @staticmethod
    def prepare_key(gm, example_inputs, fx_kwargs, inputs_to_check, remote):
        return ("fxkey-" + gm, []), {"cache_state": "miss"}
''',
    "torch/_inductor/compile_fx.py": '''
from torch._inductor.codecache import FxGraphCache


def fx_codegen_and_compile(gm, example_inputs, inputs_to_check, compile_region_name=None, **graph_kwargs):
    return "compiled " + gm


def compile_fx_inner(gm, region):
    FxGraphCache.prepare_key(gm, [], {}, [], False)
    return fx_codegen_and_compile(gm, [], [], compile_region_name=region)
''',
}

# argv: `sglang-jit:<dtype>`, `flashinfer:<module>[:aot]`, `cute:<key>`, `inductor:<graph>`, `ready`.
RUN_OTHERS_PY = '''
import sys

from sglang.srt.utils import triton_load_watch

for step in sys.argv[1:]:
    kind, _, arg = step.partition(":")
    try:
        if kind == "ready":
            triton_load_watch.mark_serving_started()
        elif kind == "sglang-jit":
            from sglang.kernels.demo import _jit_demo_module
            print("sglang-jit", _jit_demo_module(arg))
        elif kind == "flashinfer":
            from flashinfer.jit.core import JitSpecNvcc
            name, _, aot = arg.partition(":")
            print("flashinfer", JitSpecNvcc(name, aot=bool(aot)).build_and_load())
        elif kind == "cute":
            import cutlass.cute as cute
            from sglang.kernels.jit.cute_aot_cache import JITPersistentCache

            def fwd_kernel():
                pass

            store = JITPersistentCache("fwd")
            if arg not in store:
                store[arg] = cute.compile[("opt",)](fwd_kernel)
        elif kind == "inductor":
            from torch._inductor.compile_fx import compile_fx_inner
            print("inductor", compile_fx_inner(arg, "region_" + arg))
    except Exception as e:
        print(f"caught: {type(e).__name__}: {e}")
'''


@pytest.fixture(scope="session")
def triton_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    value = os.environ.get("KIMI_FIRST_USE_TRITON")
    if not value:
        pytest.fail("KIMI_FIRST_USE_TRITON is unset: run through Bazel (tools/bazel test "
                    "//tests/cpu/jit_cache:test_first_use_recorder), or set it to the triton-3.8.0 wheel "
                    "(`python3 -m tools.fetch fetch --pin triton-3.8.0` prints its path) or that wheel unpacked")
    path = Path(value)
    if path.is_dir():
        if not (path / "triton" / "__init__.py").is_file():
            pytest.fail(f"KIMI_FIRST_USE_TRITON={path}: no triton/__init__.py in it; give the unpacked triton-3.8.0 wheel")
        return path
    tree = tmp_path_factory.mktemp("triton")
    with zipfile.ZipFile(path) as wheel:
        for info in wheel.infolist():
            wheel.extract(info, tree)
            mode = (info.external_attr >> 16) & 0o777
            if mode:  # ptxas must stay executable
                (tree / info.filename).chmod(mode)
    return tree


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fixtures")
    (root / f"{KERNELS}.py").write_text(KERNELS_PY)
    (root / "run_kernels.py").write_text(RUN_PY)
    watch = root / "sglang" / "srt" / "utils"
    watch.mkdir(parents=True)
    for package in (root / "sglang", root / "sglang" / "srt", watch):
        (package / "__init__.py").write_text("")
    (watch / "triton_load_watch.py").write_text(READY_PY)
    for name, text in STANDINS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "run_others.py").write_text(RUN_OTHERS_PY)
    return root


def run(triton_tree: Path | None, fixtures: Path, cache: Path, steps: list[str], *, record: Path | None = None,
        verify: bool = False, root: str | None = None, script: str = "run_kernels.py",
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_K3_", "TRITON_", "PYTHON"))}
    env.update(extra_env or {})
    path = [str(SITE), str(fixtures)] + ([str(triton_tree)] if triton_tree else [])
    env.update(PYTHONPATH=os.pathsep.join(path), TRITON_CACHE_DIR=str(cache), STANDIN_CACHE=str(cache),
               PYTHONDONTWRITEBYTECODE="1")
    if record is not None:
        env["KIMI_K3_FIRST_USE_RECORD"] = str(record)
    if verify:
        env["KIMI_K3_FIRST_USE_VERIFY"] = "1"
    if root is not None:
        env["KIMI_K3_FIRST_USE_ROOT"] = root
    return subprocess.run([sys.executable, str(fixtures / script), *steps], env=env, text=True,
                          capture_output=True, timeout=600, cwd=fixtures)


def only_record(record: Path) -> dict[str, Any]:
    [path] = [p for p in record.iterdir() if p.suffix == ".json"]
    return json.loads(path.read_text())


def entries(document: dict[str, Any], kind: str, kernel: str) -> list[dict[str, Any]]:
    return [e for e in document["entries"] if e["kind"] == kind and e.get("kernel") == f"{KERNELS}:{kernel}"]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def base32(hex_digest: str) -> str:
    return base64.b32encode(bytes.fromhex(hex_digest)).decode("ascii").rstrip("=")


META = {"stack": "pypi", "arch": "9.0",
        "recorded_on": {"gpu": "stand-in SM90", "capability": [9, 0], "driver": "none", "image": None,
                        "profile": "fixture", "args": ["--tp-size", "1"]},
        "workload": {"steps": "add_one, scale"}}


def write_meta(tmp_path: Path) -> Path:
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps(META))
    return meta


def test_a_process_records_the_triton_disk_key_its_parts_and_the_autotune_key(
        triton_tree: Path, fixtures: Path, tmp_path: Path) -> None:
    cache, record = tmp_path / "triton", tmp_path / "record"
    done = run(triton_tree, fixtures, cache, ["add_one:128", "scale:100"], record=record)
    assert done.returncode == 0 and "caught" not in done.stdout, done.stdout + done.stderr
    doc = only_record(record)
    assert doc["ready"] is False and doc["violations"] == [] and doc["triton_key"]

    [jit] = entries(doc, "triton", "add_one")
    assert (cache / jit["key"] / "add_one.json").is_file()  # the directory Triton wrote is the key
    parts = jit["key_parts"]
    assert parts["source"] == sha256(f"{parts['fn']}-{parts['attrs']}-{parts['signature']}-{parts['constants']}")
    assert jit["key"] == base32(sha256(
        f"{parts['triton']}-{parts['source']}-{parts['backend']}-{parts['options']}-{parts['env']}"))
    assert parts["triton"] == doc["triton_key"] and parts["constexprs"] == {"BLOCK": 128}
    assert jit["specialization"]["name"] == f"{KERNELS}.add_one" and jit["specialization"]["constant_vals"] == [128]
    assert jit["phase"] == "before_ready" and jit["cache_hit"] is False

    # Every config the autotuner benchmarked is compiled (a triton entry), and its choice recorded
    # under the directory Triton's autotune disk cache keeps it in (check_disk_cache's key).
    assert sorted(e["key_parts"]["constexprs"]["BLOCK"] for e in entries(doc, "triton", "scale")) == [64, 128]
    [tune] = entries(doc, "triton-autotune", "scale")
    saved = json.loads((cache / tune["cache_key"] / "scale.autotune.json").read_text())
    assert saved["key"] == tune["tuning_key"] == [100, "fp32"]
    assert tune["configs"] == ["BLOCK: 64, num_warps: 2, num_ctas: 1, num_stages: 3, maxnreg: None",
                               "BLOCK: 128, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None"]
    assert tune["winner"]["kwargs"] == {"BLOCK": 64} and tune["winner"]["num_warps"] == 2
    assert tune["cacheable"] is True and tune["cache_hit"] is False and "pre_hook" not in tune["winner"]


def test_ready_splits_the_phases_and_a_warm_cache_is_a_hit(triton_tree: Path, fixtures: Path, tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    assert run(triton_tree, fixtures, cache, ["add_one:128", "ready", "add_one:64"], record=cold).returncode == 0
    doc = only_record(cold)
    assert doc["ready"] is True
    phases = {e["key_parts"]["constexprs"]["BLOCK"]: e["phase"] for e in entries(doc, "triton", "add_one")}
    assert phases == {128: "before_ready", 64: "after_ready"}
    assert run(triton_tree, fixtures, cache, ["add_one:128", "add_one:64"], record=warm).returncode == 0
    assert {e["cache_hit"] for e in entries(only_record(warm), "triton", "add_one")} == {True}


def test_merge_is_canonical_and_one_entry_per_compile(triton_tree: Path, fixtures: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cache, record = tmp_path / "triton", tmp_path / "record"
    # Two processes of one run (two ranks): the second hits what the first compiled. SGLang sets
    # its run id (the launch time) in each server's environment, so the processes differ in it.
    for launched in ("1796496797.4659545", "1796496801.0201"):
        monkeypatch.setenv("SGLANG_RUN_ID", f"sglang-run-{launched}-37706419")
        done = run(triton_tree, fixtures, cache, ["add_one:128", "scale:100", "ready"], record=record, root="4242")
        assert done.returncode == 0, done.stderr
    assert len(list(record.glob("*.json"))) == 2
    meta = write_meta(tmp_path)
    first, second = tmp_path / "pypi.9.0.json", tmp_path / "again.json"
    assert recording.main(["merge", "--records", str(record), "--meta", str(meta), "--out", str(first)]) == 0
    assert recording.main(["merge", "--records", str(record), "--meta", str(meta), "--out", str(second)]) == 0
    assert first.read_bytes() == second.read_bytes()
    merged = recording.check_recording(first)
    [jit] = entries(merged, "triton", "add_one")
    assert jit["cache_hit"] is False  # compiled in one process, a hit in the other: a compile
    assert len(entries(merged, "triton", "scale")) == 2 and len(entries(merged, "triton-autotune", "scale")) == 1
    assert merged["counts"]["before_ready"]["triton"] == 3 and merged["counts"]["after_ready"]["triton"] == 0
    assert merged["recorded_on"]["gpu"] == "stand-in SM90" and merged["recorded_on"]["triton_key"]
    assert merged["workload"] == META["workload"]
    text = first.read_text()
    assert "4242" not in text and '"pid"' not in text
    assert merged["recorded_on"]["env"]["SGLANG_RUN_ID"] == "<set per run>" and "sglang-run-" not in text
    order = [(e["kind"], e.get("kernel"), e.get("key") or e.get("cache_key")) for e in merged["entries"]]
    assert order == sorted(order)


def test_records_of_two_runs_are_refused(triton_tree: Path, fixtures: Path, tmp_path: Path) -> None:
    cache, record = tmp_path / "triton", tmp_path / "record"
    for root in ("1", "2"):
        assert run(triton_tree, fixtures, cache, ["add_one:128"], record=record, root=root).returncode == 0
    with pytest.raises(UserError, match=r"records of 2 server runs .*record each run into an empty directory"):
        recording.merge(record, write_meta(tmp_path))


def test_verify_fails_a_compile_after_ready_naming_the_kernel(triton_tree: Path, fixtures: Path, tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    assert run(triton_tree, fixtures, cache, ["add_one:128", "add_one:64", "scale:100"]).returncode == 0
    # A hit after ready is allowed (64 is on disk, not yet in this process).
    hit = run(triton_tree, fixtures, cache, ["add_one:128", "ready", "add_one:64", "scale:100"], verify=True)
    assert hit.returncode == 0 and "caught" not in hit.stdout, hit.stdout + hit.stderr
    # A compile after ready: the launch raises naming the kernel, one line on stderr, and the
    # process fails although the script caught the error and exited 0.
    record = tmp_path / "record"
    miss = run(triton_tree, fixtures, cache, ["add_one:128", "ready", "add_one:32"], verify=True, record=record)
    assert miss.returncode == 3, miss.stdout + miss.stderr
    assert f"caught: FirstUseCompileError: kimi-k3 first-use verify: triton {KERNELS}:add_one" in miss.stdout
    [line] = [line for line in miss.stderr.splitlines() if "first-use verify" in line]
    assert f"triton {KERNELS}:add_one would compile" in line
    assert only_record(record)["violations"] == [line]
    # The autotune disk cache's answer after ready is a hit; a benchmark fails, even when every
    # config it compiles is a hit (n=7 specializes as n=100 does, but is another tuning key).
    tune = run(triton_tree, fixtures, cache, ["ready", "scale:100"], verify=True)
    assert tune.returncode == 0 and "caught" not in tune.stdout, tune.stdout + tune.stderr
    bench = run(triton_tree, fixtures, cache, ["ready", "scale:7"], verify=True)
    assert bench.returncode == 3, bench.stdout + bench.stderr
    assert f"first-use verify: triton-autotune {KERNELS}:scale benchmarked its configs" in bench.stderr


def test_verify_writes_a_miss_before_ready_before_its_compile_fails(triton_tree: Path, fixtures: Path,
                                                                   tmp_path: Path) -> None:
    """The replay hides the compilers, so a kernel the shipped cache lacks fails in ptxas before
    ready and takes the process along: the record must already hold that miss with the key's
    parts and the specialization (an H100 replay lost exactly which specialization missed)."""
    real = next(triton_tree.glob("triton/backends/nvidia/bin/ptxas"))
    shim = tmp_path / "ptxas"
    shim.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then exec {real} --version; fi\nexit 1\n')
    shim.chmod(0o755)
    record = tmp_path / "record"
    done = run(triton_tree, fixtures, tmp_path / "triton", ["add_one:128"], verify=True, record=record,
               extra_env={"TRITON_PTXAS_PATH": str(shim)})
    # The fixture's script catches the launch's error and says so (a server's scheduler dies of it).
    assert "caught: PTXASError" in done.stdout, done.stdout + done.stderr
    [entry] = entries(only_record(record), "triton", "add_one")
    assert entry["cache_hit"] is False and entry["phase"] == "before_ready"
    assert entry["key"] and entry["key_parts"]["constants"] and entry["specialization"]["constant_vals"]


def record_with(tmp_path: Path, triton_tree: Path, fixtures: Path) -> tuple[Path, Path, dict[str, Any]]:
    record = tmp_path / "record"
    assert run(triton_tree, fixtures, tmp_path / "triton", ["add_one:128"], record=record).returncode == 0
    [path] = list(record.glob("*.json"))
    return record, path, json.loads(path.read_text())


@pytest.mark.parametrize("break_it, problem", [
    (lambda e: e.pop("key"), r"\$\.entries\[0\]: missing key 'key'"),
    (lambda e: e.update(cache_hit="yes"), r"\$\.entries\[0\]\.cache_hit: expected true or false"),
])
def test_a_malformed_record_entry_is_one_line_naming_it(triton_tree: Path, fixtures: Path, tmp_path: Path,
                                                        break_it: Any, problem: str) -> None:
    record, path, doc = record_with(tmp_path, triton_tree, fixtures)
    break_it(doc["entries"][0])
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        recording.merge(record, write_meta(tmp_path))
    message = str(e.value)
    assert "\n" not in message and str(path) in message and f"(entry triton {KERNELS}:add_one)" in message
    assert "record the run again" in message
    assert re.search(problem, message), message


def test_a_malformed_recording_is_one_line_naming_it(triton_tree: Path, fixtures: Path, tmp_path: Path) -> None:
    record, _, _ = record_with(tmp_path, triton_tree, fixtures)
    out = tmp_path / "pypi.9.0.json"
    assert recording.main(["merge", "--records", str(record), "--meta", str(write_meta(tmp_path)), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    doc["entries"][0]["key"] = 7
    out.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    with pytest.raises(UserError, match=rf"^recording {out} \(entry triton {KERNELS}:add_one\): \$\.entries\[0\]\.key: "
                                        r"expected a non-empty string, found the number 7; regenerate it"):
        recording.check_recording(out)
    doc["entries"][0]["key"] = "X"
    doc["counts"]["after_ready"]["triton"] = 5
    out.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    with pytest.raises(UserError, match=r"\$\.counts: not the entries' compiles"):
        recording.check_recording(out)


def test_merge_warns_of_a_kernel_keyed_on_an_unpinned_pool(triton_tree: Path, fixtures: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Written all the same (the run's true account), with a warning naming the kernel and the
    pin; the build from it refuses the entry (test_triton_recorded)."""
    record, path, doc = record_with(tmp_path, triton_tree, fixtures)
    doc["entries"][0]["key_parts"]["constexprs"] = {"num_cache_lines": 68}
    path.write_text(json.dumps(doc))
    out = tmp_path / "pypi.9.0.json"
    assert recording.main(["merge", "--records", str(record), "--meta", str(write_meta(tmp_path)), "--out", str(out)]) == 0
    assert recording.check_recording(out)["entries"]
    [warning] = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert warning.startswith(f"recording: warning: {out}: $.entries[0] {KERNELS}:add_one: keyed on num_cache_lines=68")
    assert "add `--max-mamba-cache-size 67`" in warning


def test_a_meta_file_without_its_fields_is_one_line(tmp_path: Path) -> None:
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({**META, "recorded_on": {**META["recorded_on"], "capability": "9.0"}}))
    (tmp_path / "record").mkdir()
    with pytest.raises(UserError, match=r"^--meta .*: \$\.recorded_on\.capability: expected a non-empty list"):
        recording.merge(tmp_path / "record", meta)


OTHER_STEPS = ["sglang-jit:bf16", "flashinfer:norm", "flashinfer:sampling:aot", "cute:k1", "inductor:g1"]


def test_the_other_kinds_are_recorded_at_their_hook_points(fixtures: Path, tmp_path: Path) -> None:
    cache, cold, warm = tmp_path / "cache", tmp_path / "cold", tmp_path / "warm"
    done = run(None, fixtures, cache, OTHER_STEPS, record=cold, script="run_others.py")
    assert done.returncode == 0 and "caught" not in done.stdout, done.stdout + done.stderr
    doc = only_record(cold)
    by_kind = {e["kind"]: e for e in doc["entries"] if e["kind"] != "flashinfer"}
    jit = by_kind["sglang-jit"]
    assert jit["module"] == "sgl_kernel_jit_demo_bf16" and jit["hit"] is False and len(jit["build_key"]) == 16
    assert jit["call"] == {"function": "sglang.kernels.demo:_jit_demo_module", "args": {"dtype": "bf16"},
                           "module_args": ["demo", "bf16"], "cpp_wrappers": [],
                           "cuda_wrappers": [["run", "Kernel<bf16>"]]}
    flashinfer = {e["module"]: e["built"] for e in doc["entries"] if e["kind"] == "flashinfer"}
    assert flashinfer == {"norm": True, "sampling": False}  # an AOT module's load is not a compile
    assert by_kind["cute-dsl"]["function"].endswith(":fwd_kernel") and by_kind["cute-dsl"]["key"].startswith("fwd/")
    assert by_kind["inductor"] == {"kind": "inductor", "graph": "region_g1", "key": "fxkey-g1", "phase": "before_ready"}
    assert {e["phase"] for e in doc["entries"]} == {"before_ready"}
    # A second process finds the SGLang JIT module and the CuTe object built: hits, no cute.compile.
    again = run(None, fixtures, cache, ["sglang-jit:bf16", "cute:k1"], record=warm, script="run_others.py")
    assert again.returncode == 0, again.stdout + again.stderr
    assert [(e["kind"], e.get("hit")) for e in only_record(warm)["entries"]] == [("sglang-jit", True)]


def test_verify_without_a_record_dir_leaves_no_ready_marker(fixtures: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a record directory the ready marker lives in the temp directory, named by the root
    pid; left there, a later server whose root got the same pid would start "after ready"."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    done = run(None, fixtures, tmp_path / "cache", ["ready"], verify=True, script="run_others.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("kimi-k3-first-use-ready")) == []


@pytest.mark.parametrize("step, named", [
    ("sglang-jit:fp8", "sglang-jit sgl_kernel_jit_demo_fp8 missed its cached build"),
    ("flashinfer:rope", "flashinfer rope built its JIT module"),
    ("cute:k2", "cute-dsl __main__:fwd_kernel compiled"),
    ("inductor:g2", "inductor region_g2 compiled"),
])
def test_verify_fails_each_kind_after_ready(fixtures: Path, tmp_path: Path, step: str, named: str) -> None:
    cache = tmp_path / "cache"
    assert run(None, fixtures, cache, OTHER_STEPS, script="run_others.py").returncode == 0
    hits = run(None, fixtures, cache, ["ready", "sglang-jit:bf16", "flashinfer:sampling:aot", "cute:k1"], verify=True,
               script="run_others.py")
    assert hits.returncode == 0 and "caught" not in hits.stdout, hits.stdout + hits.stderr
    miss = run(None, fixtures, cache, ["ready", step], verify=True, script="run_others.py")
    assert miss.returncode == 3, miss.stdout + miss.stderr
    assert f"kimi-k3 first-use verify: {named} after the server was ready" in miss.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
