"""First-use caches rebuilt from a recording (tools/jit_cache/triton_recorded.py) on the stand-in
device, with a fixture kernel module generated here: a recording made by running the fixture's
kernels through Triton's own hooks rebuilds with every key equal, twice to the same bytes; an
edited constexpr or option fails naming it and the kernel; an autotune result is read back by
Triton's own autotuner without a benchmark; a malformed entry is one line.

Triton: KIMI_TRITON_SITE (a directory holding the unpacked triton package), else
KIMI_TRITON_WHEEL (the pinned wheel, unpacked here; Bazel passes @pins//:triton-3.8.0). Outside
Bazel: `python3 -m tools.fetch fetch --pin triton-3.8.0` and unpack it, then
`KIMI_TRITON_SITE=DIR python3 tests/cpu/jit_cache/test_triton_recorded.py`.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tools.common.errors import UserError  # noqa: E402
from tools.jit_cache import triton_aot, triton_recorded  # noqa: E402
from tools.jit_cache.recording import memory_fitted_problems  # noqa: E402

WORKER_DIR = Path(triton_recorded.__file__).parent
FIXTURE = textwrap.dedent('''\
    import triton
    import triton.language as tl


    @triton.jit
    def scale_add(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, RELU: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n) * alpha + tl.load(y_ptr + i, mask=i < n)
        if RELU:
            v = tl.maximum(v, 0.0)
        tl.store(y_ptr + i, v, mask=i < n)


    @triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)],
                     key=["n"])
    @triton.jit
    def tuned_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)
''')
# Runs in a fresh interpreter with Triton and the fixture importable: a CPU tensor stand-in (Triton
# reads a pointer argument's data_ptr and dtype), the stand-in driver, and the recording: each
# compile's specialization (Triton's jit_post_compile_hook) with its key and parts, each autotune
# result (Triton's autotuning listener) with the disk-cache key Triton itself wrote it under.
SCRIPT = textwrap.dedent('''\
    import base64, glob, json, os, sys
    import triton_recorded_worker as w
    from triton import knobs
    from triton.runtime import driver
    request = json.load(open(sys.argv[1]))
    driver.set_active(w.stand_in_driver(request["target"], request["device"]))
    benchmarks = []
    if request["mode"] == "record":
        def bench(fn, quantiles=None, **kwargs):  # the second config measures faster
            fn()
            benchmarks.append(1)
            return [2.0 if len(benchmarks) % 2 else 1.0] * 3
        type(driver.active).get_benchmarker = lambda self: bench

    class DType:
        def __str__(self):
            return "torch.float32"

    class Tensor:
        dtype = DType()
        def data_ptr(self):
            return 1 << 20

    import fixture_kernels as fx
    entries, compiles = [], []
    def post_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        entries.append({"specialization": json.loads(compile["specialization_data"])})
    knobs.runtime.jit_post_compile_hook = post_compile
    def listener(*, src, metadata, metadata_group, times, cache_hit):
        compiles.append({"hash": metadata["hash"], "cache_hit": cache_hit, "src": src})
    knobs.compilation.listener = listener
    tuned = []
    def on_autotune(*, fn, key, best_config, configs_timings, duration, cache_hit):
        tuned.append({"fn": fn, "key": list(key), "configs": [str(c) for c in configs_timings],
                      "winner": {k: v for k, v in best_config.__dict__.items() if k != "pre_hook"},
                      "cache_hit": cache_hit})
    knobs.autotuning.listener = on_autotune
    for n, block, relu in request["calls"]:
        fx.scale_add[(1,)](Tensor(), Tensor(), n, 0.5, BLOCK=block, RELU=relu)
    fx.tuned_copy[(1,)](Tensor(), Tensor(), request["tuned_n"])
    out = []
    for entry, c in zip(entries, [c for c in compiles]):
        spec = entry["specialization"]
        fn = fx.scale_add if spec["name"].endswith("scale_add") else fx.tuned_copy.fn
        backend = fn.device_caches[0][3]
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}  # as preload
        parts, joined, _ = w.key_parts(fn, c["src"], options, backend)
        assert joined == c["hash"]
        key = base64.b32encode(bytes.fromhex(c["hash"])).decode().rstrip("=")  # its directory, as recorded
        out.append({"kind": "triton", "kernel": "fixture_kernels:" + fn.__qualname__, "key": key,
                    "key_parts": parts, "specialization": spec, "phase": "before_ready", "cache_hit": c["cache_hit"]})
    for t in tuned:
        found = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "tuned_copy.autotune.json"))
        out.append({"kind": "triton-autotune", "kernel": "fixture_kernels:tuned_copy", "tuning_key": t["key"],
                    "configs": t["configs"], "winner": t["winner"], "phase": "after_ready",
                    "cache_key": os.path.basename(os.path.dirname(found[0])) if found else "",
                    "cacheable": True, "cache_hit": t["cache_hit"]})
    json.dump({"entries": out, "benchmarks": len(benchmarks), "compiles": sum(not c["cache_hit"] for c in compiles),
               "tuned": [{"winner": t["winner"], "cache_hit": t["cache_hit"]} for t in tuned]},
              open(request["result"], "w"))
''')
TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}
DEVICE = {"capability": [9, 0], "device_name": "NVIDIA H200", "device_properties": {
    "max_shared_mem": 232448, "max_num_regs": 65536, "multiprocessor_count": 132, "warpSize": 32}}


@pytest.fixture(scope="module")
def triton_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("KIMI_TRITON_SITE"):
        return Path(os.environ["KIMI_TRITON_SITE"])
    wheel = os.environ.get("KIMI_TRITON_WHEEL")
    if not wheel:
        pytest.skip("no Triton: set KIMI_TRITON_SITE (an unpacked triton) or KIMI_TRITON_WHEEL (this file's docstring)")
    site = tmp_path_factory.mktemp("triton-site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for tool in (site / "triton" / "backends" / "nvidia" / "bin").iterdir():  # zip keeps no modes
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return site


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fixture")
    (d / "fixture_kernels.py").write_text(FIXTURE)
    (d / "record.py").write_text(SCRIPT)
    return d


def _run(site: Path, fixture: Path, tmp: Path, mode: str, cache: Path, extra_env: dict | None = None) -> dict:
    request = {"mode": mode, "target": TARGET, "device": DEVICE, "calls": [[1000, 128, True], [1000, 256, False]],
               "tuned_n": 4096, "result": str(tmp / f"{mode}-result.json")}
    (tmp / f"{mode}-request.json").write_text(json.dumps(request))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "TRITON_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(site), str(fixture), str(WORKER_DIR)]), **(extra_env or {})}
    proc = subprocess.run([sys.executable, str(fixture / "record.py"), str(tmp / f"{mode}-request.json")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(request["result"]).read_text())


@pytest.fixture(scope="module")
def recorded(triton_site: Path, fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("record")
    run = _run(triton_site, fixture_dir, tmp, "record", tmp / "server-cache", {"TRITON_CACHE_AUTOTUNING": "1"})
    assert run["benchmarks"] == 2 and run["tuned"][0]["winner"]["kwargs"] == {"BLOCK": 128}
    return {"schema_version": 1, "stack": "pypi", "arch": "9.0",
            "recorded_on": {"gpu": "NVIDIA H200", "capability": [9, 0], "env": {}},
            "workload": {}, "counts": {}, "entries": run["entries"]}


def _write(tmp: Path, recording: dict) -> Path:
    path = tmp / "pypi.9.0.json"
    path.write_text(json.dumps(recording))
    return path


def _build(site: Path, fixture: Path, tmp: Path, recording: dict, out: Path) -> dict:
    scratch = tmp / "scratch"
    scratch.mkdir(exist_ok=True)
    interp = triton_recorded.HostPython(sys.executable, [str(site), str(fixture)], scratch)
    return triton_recorded.build(_write(tmp, recording), "pypi", "9.0", interp, scratch, out, sglang=False)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rebuild_gives_every_recorded_key_the_same_bytes_twice(triton_site, fixture_dir, recorded, tmp_path):
    kinds = [e["kind"] for e in recorded["entries"]]
    assert kinds.count("triton") == 4 and kinds.count("triton-autotune") == 1
    manifest = _build(triton_site, fixture_dir, tmp_path, recorded, tmp_path / "out1")
    keys = {e["key"] for e in recorded["entries"] if e["kind"] == "triton"}
    assert set(manifest["entries"]) == keys
    for key, entry in manifest["entries"].items():
        assert sorted(entry["files"]) == [f"{entry['kernel']}.cubin", f"{entry['kernel']}.json"]
    [tuned] = manifest["autotune"]
    # The recording's server wrote its own autotune file under the key the rebuild recomputes.
    assert tuned["key"] == [e for e in recorded["entries"] if e["kind"] == "triton-autotune"][0]["cache_key"]
    _build(triton_site, fixture_dir, tmp_path, recorded, tmp_path / "out2")
    assert _tree(tmp_path / "out1") == _tree(tmp_path / "out2")


def test_driver_module_ships_beside_the_entries(triton_site, fixture_dir, recorded, tmp_path):
    """The image has no C compiler: the rebuilt cache carries Triton's driver module (built by the
    callback, triton_aot.build_driver_module in the Bazel build) and lists it for `bind`."""
    def driver_module(cache_dir: Path) -> dict:
        (cache_dir / "DRIVERKEY").mkdir()
        (cache_dir / "DRIVERKEY" / "cuda_utils.so").write_bytes(b"module")
        return {"module": "cuda_utils", "key": "DRIVERKEY", "file": "cuda_utils.so"}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    interp = triton_recorded.HostPython(sys.executable, [str(triton_site), str(fixture_dir)], scratch)
    manifest = triton_recorded.build(_write(tmp_path, recorded), "pypi", "9.0", interp, scratch, tmp_path / "out",
                                     sglang=False, driver_module=driver_module)
    assert manifest["modules"] == [{"module": "cuda_utils", "key": "DRIVERKEY", "file": "cuda_utils.so"}]
    assert (tmp_path / "out" / "DRIVERKEY" / "cuda_utils.so").read_bytes() == b"module"
    assert "DRIVERKEY" not in manifest["entries"]


def _edited(recorded: dict, edit) -> dict:
    copy = json.loads(json.dumps(recorded))
    edit(next(e for e in copy["entries"] if e["kind"] == "triton" and e["kernel"].endswith("scale_add")))
    return copy


def test_changed_constexpr_fails_naming_it_and_the_kernel(triton_site, fixture_dir, recorded, tmp_path, capsys):
    def edit(entry):
        spec = entry["specialization"]
        i = spec["constant_keys"].index([4])  # BLOCK
        spec["constant_vals"][i] = 64
    with pytest.raises(UserError, match="1 recorded entry cannot be prebuilt"):
        _build(triton_site, fixture_dir, tmp_path, _edited(recorded, edit), tmp_path / "out")
    err = capsys.readouterr().err
    assert "fixture_kernels:scale_add: Triton keys it" in err and "constexpr BLOCK: 128 in the recorded key, 64" in err
    assert not (tmp_path / "out").exists()


def test_changed_option_fails_naming_it(triton_site, fixture_dir, recorded, tmp_path, capsys):
    def edit(entry):
        entry["specialization"]["options"]["num_warps"] = 8
    with pytest.raises(UserError, match="cannot be prebuilt"):
        _build(triton_site, fixture_dir, tmp_path, _edited(recorded, edit), tmp_path / "out")
    err = capsys.readouterr().err
    assert "fixture_kernels:scale_add" in err and "option num_warps: the recorded launch gives 4" in err \
        and "says 8" in err


def test_autotune_result_is_read_back_without_a_benchmark(triton_site, fixture_dir, recorded, tmp_path):
    _build(triton_site, fixture_dir, tmp_path, recorded, tmp_path / "out")
    server_cache = tmp_path / "server-cache"
    assert triton_aot.bind(tmp_path / "out", server_cache) == 5  # 4 kernels, 1 autotune result
    run = _run(triton_site, fixture_dir, tmp_path, "serve", server_cache, {"TRITON_CACHE_AUTOTUNING": "1"})
    assert run["benchmarks"] == 0  # the stand-in refuses any benchmark: none ran
    assert run["tuned"] == [{"winner": run["tuned"][0]["winner"], "cache_hit": True}]
    assert run["tuned"][0]["winner"]["kwargs"] == {"BLOCK": 128} and run["compiles"] == 0


@pytest.mark.parametrize("edit, message", [
    (lambda e: e.pop("specialization"), r"\$\.entries\[0\]: .*specialization"),
    (lambda e: e.update(kernel="no_colon"), r"\$\.entries\[0\]\.kernel: 'no_colon' is not \"module:qualname\""),
    (lambda e: e.update(key="abc"), r"\$\.entries\[0\]\.key: 'abc' is not a Triton cache key"),
    (lambda e: e.update(kind="triton-ir"), r"\$\.entries\[0\]\.kind: 'triton-ir' is not one of"),
])
def test_malformed_entry_is_one_line(tmp_path, edit, message):
    entry = {"kind": "triton", "kernel": "m:k", "key": "0" * 64, "phase": "before_ready",
             "key_parts": {n: "" for n in ("triton", "source", "fn", "signature", "constexprs", "attrs", "backend",
                                           "options", "env")},
             "specialization": {n: None for n in ("name", "signature", "constant_keys", "constant_vals",
                                                  "attrs_keys", "attrs_vals", "options", "key", "target")}}
    edit(entry)
    recording = {"schema_version": 1, "stack": "pypi", "arch": "9.0", "recorded_on": {"capability": [9, 0]},
                 "entries": [entry]}
    with pytest.raises(UserError, match=message) as e:
        triton_recorded.load_recording(_write(tmp_path, recording))
    assert "\n" not in str(e.value)


def _pool_keyed(recorded: dict, args: list[str] | None) -> dict:
    """The recording with its scale_add entry keyed on the conv-state pool's row count, as SGLang's
    causal_conv1d kernels are (num_cache_lines, a tl.constexpr), run with ARGS."""
    copy = _edited(recorded, lambda e: e["key_parts"].update(constexprs={"BLOCK": 128, "num_cache_lines": 68}))
    copy["recorded_on"] = dict(copy["recorded_on"], profile="kimi-k3-h200-proof",
                               **({} if args is None else {"args": args}))
    return copy


def test_pool_size_fitted_to_free_memory_is_refused_naming_the_kernel_and_the_pin(
        triton_site, fixture_dir, recorded, tmp_path, capsys):
    """A pool SGLang sizes to the free memory gives a host with other free memory another
    num_cache_lines, so other keys: a build from such a recording ships kernels other hosts do not
    look up (the H100 replay missed _causal_conv1d_update_kernel so). Refused, naming the pin."""
    with pytest.raises(UserError, match=r"1 Triton entry is keyed on a pool size fitted to the recording host's "
                                        r"free memory"):
        _build(triton_site, fixture_dir, tmp_path, _pool_keyed(recorded, ["--tp-size", "1"]), tmp_path / "out")
    err = capsys.readouterr().err
    assert "fixture_kernels:scale_add: keyed on num_cache_lines=68" in err
    assert "add `--max-mamba-cache-size 67` to kimi-k3-h200-proof's args and record again" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, problem", [
    (["--max-mamba-cache-size", "67"], None),
    (["--max-mamba-cache-size=67"], None),
    (["--max-mamba-cache-size", "66"], "yet the recorded server gave --max-mamba-cache-size 66"),
    ([], "gave no --max-mamba-cache-size"),
])
def test_pool_size_pinned_by_the_recorded_args_is_shippable(recorded, args, problem):
    problems = memory_fitted_problems(_pool_keyed(recorded, args))
    if problem is None:
        assert problems == []
    else:
        [line] = problems
        assert problem in line and line.startswith("$.entries[")


def test_other_kinds_are_checked_against_the_builds_that_ship_them(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "kimi-k3-sglang-jit.json").write_text(json.dumps(
        {"modules": [{"module": "norm_a", "build_key": "k1"}]}))
    entries = [{"kind": "sglang-jit", "module": "norm_a", "build_key": "k1", "phase": "before_ready"},
               {"kind": "sglang-jit", "module": "rope_b", "build_key": "k2", "phase": "after_ready",
                "call": {"call": "sglang.jit.rope:_jit_rope_module", "args": {"dtype": "torch.bfloat16", "width": 64}}}]
    verdicts, failures = triton_recorded.check_sglang_jit(entries, tmp_path / "sglang", "pypi")
    assert verdicts == [{"module": "norm_a", "build_key": "k1", "prebuilt": True}]
    assert failures == ['sglang-jit module rope_b: not in the SGLang JIT build; add to jit_cache/sglang_modules.json '
                        'stacks.pypi: {"args": [{"dtype": "bfloat16"}, 64], "call": "sglang.jit.rope:_jit_rope_module", '
                        '"why": "recorded at first use"}']
    # A record run keys with its own compilers (SGLang's build key holds their --version), the
    # build with the image's none: the module is matched by its arguments, not by a key it cannot have.
    (tmp_path / "sglang" / "kimi-k3-sglang-jit.json").write_text(json.dumps(
        {"modules": [{"module": "norm_a", "build_key": "k1", "module_args": ["norm", "true"]}]}))
    recorded = {"kind": "sglang-jit", "module": "norm_a", "build_key": "host", "phase": "before_ready",
                "call": {"module_args": ["norm", "true"]}}
    verdicts, failures = triton_recorded.check_sglang_jit([recorded], tmp_path / "sglang", "pypi")
    assert failures == [] and verdicts[0]["prebuilt"] is True and verdicts[0]["recorded_build_key"] == "host"
    other = {**recorded, "call": {"module_args": ["norm", "false"]}}
    verdicts, failures = triton_recorded.check_sglang_jit([other], tmp_path / "sglang", "pypi")
    assert verdicts == [] and failures == [
        "sglang-jit module norm_a: recorded build_key host with module arguments ['norm', 'false'], the build has k1 "
        "with [['norm', 'true']]: rebuild jit_cache/sglang_modules.json's entry with the recorded call and arguments"]
    plan = tmp_path / "plan_90a_x.pypi.bzl"
    plan.write_text('KERNEL_CACHE_PLAN = {"schema_version": 1, "selection": "gpu-test-sm90", "modules": ["norm"]}\n')
    verdicts, failures = triton_recorded.check_flashinfer(
        [{"kind": "flashinfer", "module": m, "phase": "before_ready"} for m in ("norm", "sampling")], plan)
    assert verdicts == [{"module": "norm", "prebuilt": True}]
    assert failures == ["flashinfer module sampling: plan_90a_x.pypi.bzl does not build it; add it to "
                        "kernel_cache/selections.json selections.gpu-test-sm90 and regenerate the plan "
                        "(tools/bazel run //kernel_cache:update_plans)"]


def test_coverage_maps_recorded_sites_to_the_inventory(tmp_path, capsys):
    from tools.jit_cache import cli, coverage

    key = "A" * 52
    recording = {"schema_version": 1, "stack": "pypi", "arch": "9.0", "recorded_on": {"capability": [9, 0]}, "entries": [
        {"kind": "triton", "kernel": "sglang.ops.k:fwd_kernel", "key": key, "phase": "before_ready",
         "key_parts": None, "specialization": None},
        {"kind": "triton", "kernel": "sglang.ops.new:other_kernel", "key": "B" * 52, "phase": "after_ready",
         "key_parts": None, "specialization": None},
        {"kind": "flashinfer", "module": "norm", "phase": "before_ready"},
        {"kind": "inductor", "graph": "g0", "key": "x", "phase": "after_ready"},
        # keyed by the record run's compilers, matched by arguments in the build; and one not built
        {"kind": "sglang-jit", "module": "m_add", "build_key": "host-key", "phase": "before_ready"},
        {"kind": "sglang-jit", "module": "m_gate", "build_key": "k9", "phase": "after_ready"}]}
    sites = {"triton:sglang/ops/k.py:fwd_kernel": {"kind": "triton", "file": "sglang/ops/k.py", "name": "fwd_kernel"},
             "triton:sglang/ops/k.py:bwd_kernel": {"kind": "triton", "file": "sglang/ops/k.py", "name": "bwd_kernel"},
             "flashinfer:kernel_cache:norm": {"kind": "flashinfer", "file": "image/backend_needs.json", "name": "norm",
                                              "status": "prebuilt"}}
    (tmp_path / "rec.json").write_text(json.dumps(recording))
    (tmp_path / "inv.json").write_text(json.dumps({"sites": sites}))
    (tmp_path / "kimi-k3-triton.json").write_text(json.dumps({
        "entries": {key: {}}, "flashinfer": [{"module": "norm"}],
        "sglang_jit": [{"module": "m_add", "build_key": "image-key", "recorded_build_key": "host-key"},
                       {"module": "m_gate", "build_key": "k1"}]}))
    rows = {r["kind"]: r for r in coverage.coverage(recording, {"sites": sites},
                                                    json.loads((tmp_path / "kimi-k3-triton.json").read_text()))}
    assert (rows["triton"]["prebuilt"], rows["triton"]["entries"], rows["triton"]["in_inventory"]) == (1, 2, 1)
    assert rows["triton"]["static_only"] == ["triton:sglang/ops/k.py:bwd_kernel"]
    assert rows["triton"]["not_in_inventory"] == ["triton:sglang/ops/new.py:other_kernel"]
    assert (rows["flashinfer"]["prebuilt"], rows["inductor"]["entries"], rows["inductor"]["sites"]) == (1, 1, 0)
    assert (rows["sglang-jit"]["prebuilt"], rows["sglang-jit"]["entries"]) == (1, 2)
    assert cli.main(["coverage", "--recording", str(tmp_path / "rec.json"), "--inventory", str(tmp_path / "inv.json"),
                     "--cache-manifest", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "triton           1/2" in out and "recorded, not in the inventory's reached sites: triton:sglang/ops/new.py:other_kernel" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
