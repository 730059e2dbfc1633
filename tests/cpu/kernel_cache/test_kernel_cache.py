"""CPU tests for tools/kernel_cache (tag cpu).

Needs the default stack's real flashinfer-python wheel (KIMI_TEST_FLASHINFER_WHEEL), the pinned
toolchain (the CUDA root from the lock's NVIDIA wheels and the bookworm compiler userland, as
data: KIMI_KC_CUDA_IDENTITY, KIMI_KC_USERLAND_IDENTITY; no CUDA or compiler of the machine) and,
in the interpreter, torch (CPU), apache-tvm-ffi, nvidia-ml-py, tqdm, requests, filelock, ninja
and nvidia-cuda-cuobjdump. One small real module (silu_and_mul) comes from the kernel stage's own
Bazel actions (KIMI_KC_SILU_BUILD: //tests/cpu/kernel_cache:silu_and_mul_build, compiled from
the patch-gate tree of a stack that needs no GitHub, KIMI_KC_OFFLINE_TREE); the checks of a
built cache run on it, and the in-process builder (build.py) compiles it once from the same tree
and must give the same bytes. The plan tests use the default stack's wheel with a "patch" written
by the test (a marker comment), standing in for the patch gate output.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

import tools.kernel_cache.build as kc_build
from tools.common.errors import UserError
from tools.kernel_cache.actions import (CACHE_JSON_NAME, Fill, compile_argv, compile_one,
                                        object_spec)
from tools.kernel_cache.build import object_key, record_path
from tools.kernel_cache.cli import main, parser
from tools.kernel_cache.plan import (PLAN_SCHEMA, _mem_hint, describe_drift, find_module,
                                     make_plan, moe_instantiations, parse_ninja, parse_only,
                                     read_plan, render_plan, select_modules)
from tests.cpu.conftest import env_path, pinned_toolchain_paths
from tools.kernel_cache.toolchain import (check_glibc_needed, glibc_needed, glibc_release, load_toolchain,
                                         unpack_tvm_ffi, userland_sysroot)
from tools.kernel_cache.tree import AOT_SUBDIR, REPO_ROOT, flashinfer_source_digest
from tools.kernel_cache.verify import check_elf, find_cuobjdump, verify

from tests.cpu.kernel_cache.plan_checks import assert_plan_matches_flashinfer, stage_output

MARKER = "kimi-k3 kernel cache test patch"
MARKED_FILE = "flashinfer/data/include/flashinfer/activation.cuh"
MODULES = REPO_ROOT / "kernel_cache" / "modules.json"
SELECTIONS = REPO_ROOT / "kernel_cache" / "selections.json"
SILU_SO = Path(AOT_SUBDIR) / "silu_and_mul" / "silu_and_mul.so"


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is unset: Bazel sets it from the pinned repository; set it to run "
                    "this test by hand")
    return value


def _write_modules(path: Path, modules: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"schema_version": 1, "modules": modules}))
    return path


SILU = {"name": "silu_and_mul", "generator": "flashinfer.jit.activation:gen_act_and_mul_module",
        "kwargs": {"act_func_name": "silu"},
        "source_markers": [{"path": MARKED_FILE, "regex": MARKER, "why": "test fixture patch"}]}
# As modules.json declares it (no source marker), for the module the Bazel actions built.
SILU_DECLARED = next(m for m in json.loads(MODULES.read_text())["modules"]
                     if m["name"] == "silu_and_mul")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    wheel = Path(_required_env("KIMI_TEST_FLASHINFER_WHEEL"))
    cuda_home, userland = pinned_toolchain_paths()
    base = tmp_path_factory.mktemp("kernel_cache")
    # The tool's scratch dirs (probe workspaces, verify views) also go under pytest's tmp.
    saved_tempdir = tempfile.tempdir
    tempfile.tempdir = str(base / "scratch")
    os.mkdir(tempfile.tempdir)
    unpatched = base / "unpatched"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpatched)
    patched = base / "patched"
    shutil.copytree(unpatched, patched, symlinks=True)
    with (patched / MARKED_FILE).open("a") as f:
        f.write(f"\n// {MARKER}\n")
    modules = _write_modules(base / "modules.json", [SILU])
    # The tvm-ffi headers the Bazel actions compiled against (the stack's wheel), so that the
    # in-process compiles and the toolchain identity are theirs.
    tc = load_toolchain(cuda_home, userland, str(stage_output("KIMI_KC_SILU_BUILD", "_tvm_ffi")))
    plan = make_plan(patched, modules, "12.0f", "full", tc)
    yield {"base": base, "unpatched": unpatched, "patched": patched, "modules": modules,
           "tc": tc, "cuda_home": cuda_home, "plan": plan,
           "tree": env_path("KIMI_KC_OFFLINE_TREE").absolute(),
           "cache_dir": stage_output("KIMI_KC_SILU_BUILD", "_aot")}
    tempfile.tempdir = saved_tempdir


@pytest.fixture(scope="module")
def built(env: dict[str, Any]) -> dict[str, Any]:
    """The in-process builder's silu_and_mul, from the tree and with the selection the Bazel
    actions used (the one compile of a real module in this file)."""
    bazel = json.loads((env["cache_dir"] / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    out, cache = env["base"] / "out", env["base"] / "cache"
    kc_build.build(env["tree"], MODULES, "12.0f", "full", out, 1, cache, env["tc"], 16000, 10,
                   only=["silu_and_mul"], selection=bazel["selection"], selections_path=SELECTIONS)
    (obj,) = (cache / "objects").rglob("*.o")
    return {"out": out, "cache": cache, "object": obj}


def test_parse_ninja_expands_variables_and_continuations() -> None:
    text = ("a = x $\n    y\nb = ${a}-z $$HOME\nrule r\n  command = cc $b -c $in -o $out\n"
            "build o.o: r s.c\n")
    (b,) = parse_ninja(text)
    assert (b.rule, b.inputs, b.outputs) == ("r", ["s.c"], ["o.o"])
    assert b.command == "cc x y-z $HOME -c s.c -o o.o"


def test_plan_is_host_independent_and_round_trips(env: dict[str, Any], tmp_path: Path) -> None:
    plan = env["plan"]
    text = render_plan(plan)
    for host_path in (str(env["base"]), env["cuda_home"], sys.prefix):
        assert host_path not in text
    (m,) = plan["modules"]
    (obj,) = m["objects"]
    assert obj["src"] == "@GEN@/silu_and_mul.cu"
    assert "-gencode=arch=compute_120f,code=sm_120f" in obj["args"]
    path = tmp_path / "plan.bzl"
    path.write_text(text)
    assert read_plan(path) == plan
    assert describe_drift(read_plan(path), plan) is None


def test_plan_drift_is_named(env: dict[str, Any], tmp_path: Path) -> None:
    plan = json.loads(json.dumps(env["plan"]))
    obj = plan["modules"][0]["objects"][0]
    obj["args"] = [a.replace("-O3", "-O2") for a in obj["args"]]
    path = tmp_path / "plan.bzl"
    path.write_text(render_plan(plan))
    with pytest.raises(UserError, match=r"module silu_and_mul object .*command differs.*-O3"):
        main(["plan", "--check", "--flashinfer-tree", str(env["patched"]), "--modules",
              str(env["modules"]), "--arch", "12.0f", "--variant", "full", "--cuda-home",
              env["cuda_home"], "--userland", str(env["tc"].userland), "--out", str(path)])


# The `full` selection's plans; the selections' plans are checked in test_selection.py.
FULL_PLANS = ["plan_120f_full.bzl", "plan_120f_lean.bzl", "plan_90a_full.bzl"]


@pytest.mark.parametrize("plan_name", FULL_PLANS)
def test_checked_in_plan_matches_flashinfer(env: dict[str, Any], plan_name: str) -> None:
    assert_plan_matches_flashinfer(env["unpatched"], plan_name, env["tc"])


def test_unpatched_tree_is_refused_before_building(env: dict[str, Any]) -> None:
    with pytest.raises(UserError, match=r"lacks .* required by module silu_and_mul"):
        make_plan(env["unpatched"], env["modules"], "12.0f", "full", env["tc"])


def test_built_module_has_sm120_code_and_resolves_without_jit(env: dict[str, Any]) -> None:
    report = verify(env["cache_dir"], env["tree"], MODULES, sys.executable, env["tc"],
                    None, require_load=True, driver_stub=False, only=["silu_and_mul"])
    r = report["modules"]["silu_and_mul"]
    assert r["elf"] == ["sm_120"]
    assert r["is_aot"] and r["aot_path"].endswith("flashinfer/data/aot/silu_and_mul/silu_and_mul.so")
    assert r["jit_refused"], "FLASHINFER_DISABLE_JIT=1 must refuse to compile"
    assert r["loaded"], r["load_error"]
    data = json.loads((env["cache_dir"] / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    assert data["arch_list"] == "12.0f"
    assert data["toolchain"]["nvcc_version"].startswith(env["tc"].nvcc_release)
    assert data["patched_source_digest"] == flashinfer_source_digest(env["tree"])


def test_wrong_arch_fails_the_elf_check(env: dict[str, Any]) -> None:
    so = env["cache_dir"] / SILU_SO
    objdump = find_cuobjdump(env["tc"], None)
    with pytest.raises(UserError, match=r"device code for \['sm_120'\], expected \['sm_90a'\]"):
        check_elf(objdump, so, "9.0a")


def test_cache_for_another_arch_is_refused(env: dict[str, Any]) -> None:
    with pytest.raises(UserError, match="built for arch 12.0f, required 9.0a"):
        verify(env["cache_dir"], env["tree"], None, sys.executable, env["tc"], None, True, False,
               arch="9.0a")


def test_cache_from_other_sources_is_refused(env: dict[str, Any]) -> None:
    """Checked against another FlashInfer tree (the default stack's, unpatched)."""
    with pytest.raises(UserError, match="stale or unpatched cache"):
        verify(env["cache_dir"], env["unpatched"], None, sys.executable, env["tc"], None, True,
               False)


def test_missing_module_is_named(env: dict[str, Any]) -> None:
    modules = _write_modules(env["base"] / "two.json", [SILU_DECLARED, {
        "name": "norm", "generator": "flashinfer.jit.norm:gen_norm_module"}])
    with pytest.raises(UserError, match="module norm .* is missing"):
        verify(env["cache_dir"], env["tree"], modules, sys.executable, env["tc"], None, True,
               False)


def test_altered_module_is_refused(env: dict[str, Any], tmp_path: Path) -> None:
    copy = tmp_path / "cache"
    shutil.copytree(env["cache_dir"], copy)
    so = copy / SILU_SO
    so.chmod(0o644)  # Bazel's outputs are read-only
    data = bytearray(so.read_bytes())
    data[-1] ^= 1
    so.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256 differs"):
        verify(copy, env["tree"], None, sys.executable, env["tc"], None, True, False)


def test_object_key_is_stable_and_sensitive(env: dict[str, Any]) -> None:
    tc_digest = env["tc"].digest()
    plan = env["plan"]
    again = make_plan(env["patched"], env["modules"], "12.0f", "full", env["tc"])
    m, m2 = plan["modules"][0], again["modules"][0]
    key = object_key(plan, m, m["objects"][0], tc_digest)
    assert key == object_key(again, m2, m2["objects"][0], tc_digest)
    flag = dict(m["objects"][0], args=m["objects"][0]["args"] + ["-DKIMI_EXTRA"])
    assert object_key(plan, m, flag, tc_digest) != key
    assert object_key(plan, m, m["objects"][0], "0" * 64) != key
    header = env["patched"] / "flashinfer/data/include/flashinfer/vec_dtypes.cuh"
    original = header.read_bytes()
    try:  # one byte of one header, restored afterwards (the tree is shared by the module)
        header.write_bytes(original.replace(b"\n", b" \n", 1))
        changed_digest = flashinfer_source_digest(env["patched"])
    finally:
        header.write_bytes(original)
    # The plan's source digest is this function of the tree; one changed byte changes the key.
    changed = dict(plan, patched_source_digest=changed_digest)
    assert changed["patched_source_digest"] != plan["patched_source_digest"]
    assert object_key(changed, m, m["objects"][0], tc_digest) != key


def test_warm_rebuild_compiles_nothing(env: dict[str, Any], built: dict[str, Any],
                                       capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An object's key is its own command, sources and toolchain: a plan of silu_and_mul alone
    (no selection) finds the object and module the first build cached."""
    capsys.readouterr()
    modules = _write_modules(tmp_path / "silu.json", [SILU_DECLARED])
    kc_build.build(env["tree"], modules, "12.0f", "full", tmp_path / "out", 1, built["cache"],
                   env["tc"], 16000, 10)
    assert "1 cached, 0 to compile" in capsys.readouterr().err
    assert (built["out"] / SILU_SO).read_bytes() == (tmp_path / "out" / SILU_SO).read_bytes()


def test_bazel_actions_and_the_in_process_build_give_one_module(env: dict[str, Any],
                                                                built: dict[str, Any]) -> None:
    """gen-sources -> compile-object -> link-module -> assemble as defs.bzl runs them (sandboxed,
    //tests/cpu/kernel_cache:silu_and_mul_build) and build.py from the same tree: the same
    object, module and kernel_cache.json (plan, toolchain identity, digests), byte for byte."""
    ours = json.loads((built["out"] / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    theirs = json.loads((env["cache_dir"] / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    assert ours == theirs
    assert built["object"].read_bytes() == stage_output("KIMI_KC_SILU_BUILD", ".cuda.o").read_bytes()
    assert (built["out"] / SILU_SO).read_bytes() == (env["cache_dir"] / SILU_SO).read_bytes()


def test_compile_object_by_plan_or_by_spec_compiles_one_entry(
        env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CLI for people (--plan/--module/--object) hands the compiler the same object entry
    and paths as the spec file defs.bzl writes for the action (the compile itself is the
    test above's); a spec of the wrong kind is refused."""
    import tools.kernel_cache.cli as cli
    calls = []

    def record(module: Any, obj: Any, fill: Fill, out: Path, nice: int) -> float:
        calls.append((dict(module), dict(obj), fill.tree, fill.gen_dir, nice))
        return 0.0

    monkeypatch.setattr(cli, "compile_one", record)
    plan_file = stage_output("KIMI_KC_SILU_BUILD", ".bzl")
    plan = read_plan(plan_file)
    (obj,) = find_module(plan, "silu_and_mul")["objects"]
    spec = tmp_path / "obj.json"
    spec.write_text(json.dumps(object_spec(plan, "silu_and_mul", obj["out"])))
    common = ["--cuda-home", env["cuda_home"], "--userland", str(env["tc"].userland),
              "--tvm-ffi", str(env["tc"].tvm_ffi_dir), "--flashinfer-tree", str(env["tree"]),
              "--gen-dir", str(tmp_path / "gen"), "--out", str(tmp_path / "x.o")]
    assert main(["compile-object", *common, "--spec", str(spec)]) == 0
    assert main(["compile-object", *common, "--plan", str(plan_file), "--module", "silu_and_mul",
                 "--object", obj["out"]]) == 0
    assert len(calls) == 2 and calls[0] == calls[1], calls
    assert calls[0][1] == {k: v for k, v in obj.items() if k != "mem_mb"}
    with pytest.raises(UserError, match="not a link spec"):
        main(["link-module", "--cuda-home", env["cuda_home"], "--spec", str(spec),
              "--objects-dir", str(tmp_path), "--out", str(tmp_path / "x.so")])


INTERNAL_SYMBOL_SOURCE = """
namespace { __device__ int counter = 3; }  // internal linkage: cudafe++ names it _INTERNAL_<id>_...
__global__ void bump(int* p) { p[0] += counter; }
"""


def test_object_bytes_do_not_depend_on_where_the_tree_lives(env: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """cudafe++ hashes the source's absolute path into internal device symbol names; the tool
    names the source by its fixed /kimi-k3/... path, so two tree locations give one object."""
    obj = {"out": "k.cuda.o", "src": "@TREE@/k.cu", "kind": "cuda", "mem_mb": 1500,
           "args": ["@CUDA_HOME@/bin/nvcc", "-gencode=arch=compute_120f,code=sm_120f", "-c",
                    "@INPUT@", "-o", "@OUTPUT@"]}
    outs = []
    for where in ("a", "tree_somewhere_else"):
        tree = tmp_path / where
        tree.mkdir()
        (tree / "k.cu").write_text(INTERNAL_SYMBOL_SOURCE)
        out = tmp_path / f"{where}.o"
        compile_one({"name": "t"}, obj, Fill(tree, Path("/nonexistent"), env["tc"]), out, 0)
        outs.append(out.read_bytes())
    assert b"_INTERNAL_" in outs[0], "the fixture must produce an internal-linkage device symbol"
    assert outs[0] == outs[1]


INSTANTIATION_ONLY_SOURCE = """
namespace { __device__ int counter = 3; }
template <typename T> __global__ void bump(T* p) { p[0] += counter; }
template __global__ void bump<int>(int*);  // nothing external of its own, like FlashInfer's generated files
"""


def test_object_bytes_do_not_depend_on_the_compiler_process(env: dict[str, Any],
                                                           tmp_path: Path) -> None:
    """A source that defines nothing external of its own gets anonymous-namespace names from
    a random number and nvcc's pid (_GLOBAL__N__..._k_cu_6169e7d9_2758); the tool passes nvcc's
    -frandom-seed (the object's name), so two compiles give one object."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "k.cu").write_text(INSTANTIATION_ONLY_SOURCE)
    obj = {"out": "k.cuda.o", "src": "@TREE@/k.cu", "kind": "cuda", "mem_mb": 1500,
           "args": ["@CUDA_HOME@/bin/nvcc", "-gencode=arch=compute_120f,code=sm_120f", "-c",
                    "@INPUT@", "-o", "@OUTPUT@"]}
    fill = Fill(tree, Path("/nonexistent"), env["tc"])
    names = []
    for i in range(2):  # without the seed: the fixture is one that varies, or this test could not fail
        out = tmp_path / f"unseeded{i}.o"
        argv = [a for a in compile_argv(obj, fill, out) if not a.startswith("-frandom-seed")]
        assert env["tc"].run(argv, 0).returncode == 0
        names.append(sorted(set(re.findall(rb"_GLOBAL__N__\w+", out.read_bytes()))))
    assert names[0] and names[0] != names[1], names
    seeded = []
    for i in range(2):
        out = tmp_path / f"seeded{i}.o"
        compile_one({"name": "t"}, obj, fill, out, 0)
        seeded.append(out.read_bytes())
    assert seeded[0] == seeded[1]


def test_toolchain_is_the_pinned_one(env: dict[str, Any]) -> None:
    """The compilers are the lock's: nvcc V13.0.88 from the wheels (identity: their sha256),
    g++-12 from the bookworm userland (identity: every .deb's sha256); kernel_cache.json records
    that identity, and nothing of the machine's own CUDA or compiler."""
    tc = env["tc"]
    ident = tc.identity()
    assert tc.nvcc_version_text == "13.0 V13.0.88"
    assert "nvidia-cuda-nvcc-13.0.88" in ident["cuda"]["pinned"]["pins"]
    assert ident["userland"]["packages"]["g++-12"]["version"].startswith("12.")
    assert "g++-12" in tc.cxx_version or "12." in tc.cxx_version
    # The wrappers run the userland's compiler with --sysroot: its headers, not the system's.
    proc = tc.run(["g++", "-v", "-E", "-x", "c++", "/dev/null"])
    assert proc.returncode == 0, proc.stderr
    search = proc.stderr.split("search starts here:")[-1].split("End of search list.")[0].split()
    # The sysroot's dirs by the given path, gcc's own by where its binary really is (a sandbox
    # links each input file to it).
    real_root = str(Path(os.path.realpath(tc.userland / "usr" / "bin" / "g++-12")).parents[2])
    assert search and all(p.startswith((str(tc.userland) + "/", real_root + "/"))
                          for p in search), search
    assert not [p for p in search if p.startswith(("/usr/", "/usr/local/"))], search
    assert tc.run(["g++", "-print-prog-name=as"]).stdout.strip() == "as"
    which_as = subprocess.run(["sh", "-c", "command -v as"], capture_output=True, text=True,
                              env=tc.env()).stdout.strip()
    assert which_as == str(tc.userland / "usr" / "bin" / "as"), which_as
    built = json.loads((env["cache_dir"] / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    assert built["toolchain"] == ident
    assert "/usr/local/cuda" not in json.dumps(built)


def test_a_link_takes_glibc_from_the_userland_not_the_running_system(env: dict[str, Any], tmp_path: Path) -> None:
    """Here the userland is a forest of links (runfiles), as in every Bazel sandbox. ld reads a
    linker script's absolute paths (libm.so: /lib/x86_64-linux-gnu/libm.so.6) inside the sysroot
    only when the script really lies there, so a --sysroot at the forest linked the running root's
    glibc: FlashInfer modules needed sqrtf@GLIBC_2.43 (Debian sid's) and could not load on the
    image's glibc 2.36. The sysroot is the userland's real directory; a newer need fails the build."""
    tc = env["tc"]
    assert userland_sysroot(tc.userland) == Path(os.path.realpath(tc.userland / "usr/lib/x86_64-linux-gnu/libc.so")).parents[3]
    src = tmp_path / "m.c"
    src.write_text("#include <math.h>\nfloat root(float x) { return sqrtf(x); }\n")
    so = tmp_path / "m.so"
    proc = tc.run(["gcc", "-shared", "-fPIC", "-fno-builtin", str(src), "-lm", "-o", str(so)])
    assert proc.returncode == 0, proc.stderr
    have = glibc_release(tc.userland_identity)
    needed = glibc_needed(so, tc.env())
    assert have == (2, 36) and needed and max(needed) <= have, needed
    check_glibc_needed(so, tc, "link m")
    older = dataclasses.replace(tc, userland_identity={"packages": [{"name": "libc6", "version": "2.1-1"}]})
    with pytest.raises(UserError, match=r"^link m: m.so needs GLIBC_2\.2.*newer than the compiler userland's glibc 2\.1"):
        check_glibc_needed(so, older, "link m")


def test_no_cuda_is_picked_up_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --cuda-home or KIMI_CUDA_HOME the tool names the pinned root; it never falls back to
    a CUDA the machine happens to have."""
    monkeypatch.delenv("KIMI_CUDA_HOME", raising=False)
    with pytest.raises(UserError, match=r"--cuda-home: not given .*kimi_cuda/root"):
        load_toolchain(None)


def test_prefix_maps_cover_where_the_compilers_really_are(tmp_path: Path) -> None:
    """In a Bazel sandbox the toolchain is a forest of links into the output base; nvcc and gcc
    find their include dirs from their real location, so that location must be mapped too, or
    the objects embed the output base (measured: norm.so differed between two output roots)."""
    from tools.kernel_cache.toolchain import Toolchain
    real, forest = tmp_path / "output_base" / "external" / "x", tmp_path / "sandbox" / "x"
    files = ["cuda/bin/nvcc", "cuda/include/cuda.h", "ul/usr/bin/g++-12",
             "ul/usr/include/python3.11/Python.h", "tvm/include/tvm/ffi/c_api.h"]
    for rel in files:
        (real / rel).parent.mkdir(parents=True, exist_ok=True)
        (real / rel).write_text("x")
        (forest / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(real / rel, forest / rel)
    tc = Toolchain(cuda_home=forest / "cuda", cuda_identity=None, nvcc_release="13.0",
                   nvcc_version_text="", userland=forest / "ul", userland_identity=None,
                   cxx_version="", tvm_ffi_dir=forest / "tvm", tvm_ffi_version="",
                   python_include=forest / "ul/usr/include/python3.11")
    maps = dict(tc.prefix_maps())
    assert maps[str(real / "cuda")] == maps[str(forest / "cuda")] == "/kimi-k3/cuda"
    assert maps[str(real / "ul")] == maps[str(forest / "ul")] == ""
    assert maps[str(real / "tvm")] == "/kimi-k3/tvm_ffi"
    assert maps[str(real / "ul/usr/include/python3.11")] == "/kimi-k3/python-include"
    # The tree and generated sources likewise: cudafe++ names every file it reads by its real
    # path (measured: norm's csrc_norm.cuda.o embedded the output base's tree path).
    for rel in ("tree/flashinfer/data/include/norm.cuh", "gen/m/x.cu"):
        (real / rel).parent.mkdir(parents=True, exist_ok=True)
        (real / rel).write_text("x")
        (forest / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(real / rel, forest / rel)
    fill = dict(Fill(forest / "tree", forest / "gen", tc).prefix_maps())
    assert fill[str(real / "tree")] == fill[str(forest / "tree")] == "/kimi-k3/flashinfer-tree"
    assert fill[str(real / "gen")] == "/kimi-k3/gen"


def test_unpack_tvm_ffi_takes_headers_and_version_from_the_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "apache_tvm_ffi-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tvm_ffi/include/tvm/ffi/c_api.h", "// header\n")
        z.writestr("tvm_ffi/__init__.py", "")
        z.writestr("apache_tvm_ffi-9.9.9.dist-info/METADATA", "Name: apache-tvm-ffi\nVersion: 9.9.9\n")
    out = unpack_tvm_ffi(wheel, tmp_path / "tvm")
    assert (out / "include" / "tvm" / "ffi" / "c_api.h").read_text() == "// header\n"
    assert not (out / "__init__.py").exists()
    assert json.loads((out / "kimi-k3-tvm-ffi.json").read_text())["version"] == "9.9.9"
    bad = tmp_path / "not-tvm.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("x/y.h", "")
    with pytest.raises(UserError, match=r"--wheel .*not-tvm.whl: no tvm_ffi/include/"):
        unpack_tvm_ffi(bad, tmp_path / "tvm2")
    assert not (tmp_path / "tvm2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_only_selects_modules_and_names_typos(env: dict[str, Any]) -> None:
    assert parse_only(["norm,silu_and_mul", "norm"]) == ["norm", "silu_and_mul"]
    plan = env["plan"]
    assert select_modules(plan, ["silu_and_mul"])["object_count"] == 1
    with pytest.raises(UserError, match=r"--only silu_and_mull: not in the plan"):
        select_modules(plan, ["silu_and_mull"])


def test_plan_file_is_starlark_with_booleans(tmp_path: Path) -> None:
    """Plans are loaded by Bazel: booleans (use_fast_build) must be True/False, not JSON's."""
    plan = {"schema_version": PLAN_SCHEMA, "kwargs": {"use_fast_build": False},
            "none": None, "list": [1, "a\\b\"c"], "empty": {}}
    text = render_plan(plan)
    assert "False" in text and "None" in text and "false" not in text
    path = tmp_path / "p.bzl"
    path.write_text(text)
    assert read_plan(path) == plan


def test_lean_build_keeps_every_cuda_object_of_fused_moe_120(env: dict[str, Any]) -> None:
    """use_fast_build only adds -DFAST_BUILD to the C++ (.cpp) objects: the CUDA objects, and so
    the MXFP8 x MXFP4 SM120 grouped-GEMM instantiations Kimi-K3 needs, are the same both ways."""
    moe = _write_modules(env["base"] / "moe.json", [{
        "name": "fused_moe_120",
        "generator": "flashinfer.jit.fused_moe:gen_cutlass_fused_moe_sm120_module",
        "variant_kwargs": {"lean": {"use_fast_build": True}, "full": {"use_fast_build": False}}}])
    gen = env["base"] / "moe-gen"
    lean = make_plan(env["patched"], moe, "12.0f", "lean", env["tc"],
                     gen_out=gen)["modules"][0]
    full = make_plan(env["patched"], moe, "12.0f", "full", env["tc"])["modules"][0]
    assert [o["out"] for o in lean["objects"]] == [o["out"] for o in full["objects"]]
    assert lean["gen_digest"] == full["gen_digest"]
    for lo, fo in zip(lean["objects"], full["objects"]):
        if lo["kind"] == "cuda":
            assert lo == fo
        else:
            assert [a for a in lo["args"] if a != "-DFAST_BUILD"] == fo["args"]
    found = moe_instantiations(gen / "fused_moe_120")
    assert any(i.startswith("Sm120, __nv_fp8_e4m3, SafeFP4,") for i in found), found[:3]


def test_lean_and_full_share_the_bazel_keys_of_every_cuda_object() -> None:
    """Bazel's compile action reads only its object's spec, so an object whose spec is the same
    in two plans is one cached action: lean after full recompiles only the 6 host C++ objects."""
    plans = {v: read_plan(REPO_ROOT / "kernel_cache" / f"plan_120f_{v}.bzl")
             for v in ("lean", "full")}
    differ = []
    for m in plans["full"]["modules"]:
        for o in m["objects"]:
            if (object_spec(plans["lean"], m["name"], o["out"])
                    != object_spec(plans["full"], m["name"], o["out"])):
                differ.append((m["name"], o["kind"]))
    assert differ and all(kind != "cuda" for _, kind in differ), differ
    assert len(differ) == 6, differ


def test_memory_hints_follow_the_arch() -> None:
    """SM90 GEMMs are guarded off (small) for 12.0f but real code for 9.0a."""
    name = "90_cutlass_kernel_file_gemm_grouped_sm90_M128_Mixed_group4.generated.cuda.o"
    assert _mem_hint(name, "12.0f") == 1500
    assert _mem_hint(name, "9.0a") == 4000
    assert _mem_hint("120_cutlass_kernel_file_gemm_grouped_sm120_M128_BS_group0.generated.cuda.o",
                     "12.0f") == 9000
    plan = read_plan(REPO_ROOT / "kernel_cache" / "plan_90a_full.bzl")
    moe = next(m for m in plan["modules"] if m["name"] == "fused_moe_90")
    assert sum(o["mem_mb"] == 4000 for o in moe["objects"]) >= 210


# --- build()'s cache discipline, with the compiler steps replaced by stand-ins (no nvcc) ---

class _FakeToolchain:
    """What build()/assemble() read from a Toolchain, without a CUDA install."""
    nvcc_release = "13.0"
    cuda_home = Path("/nonexistent/cuda")
    userland = None

    def identity(self) -> dict[str, Any]:
        return {"fake": True}

    def digest(self) -> str:
        return "f" * 64


def _fake_tree(root: Path) -> Path:
    (root / "flashinfer" / "data" / "csrc").mkdir(parents=True)
    (root / "flashinfer" / "__init__.py").write_text("")
    return root


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """build() with make_plan/compile/link/stubs replaced: each compile reads the module's
    generated source from this run's gen dir, as nvcc does."""
    state: dict[str, Any] = {"compiles": 0, "links": 0, "during_compile": None,
                             "tree": _fake_tree(tmp_path / "tree"), "cache": tmp_path / "cache",
                             "modules": tmp_path / "modules.json"}

    def make_plan(tree, modules_path, arch, variant, tc, gen_out=None, **kw):
        if modules_path.name == "dies.json":
            raise UserError("probe failed (a run that dies early)")
        (gen_out / "m").mkdir(parents=True)
        (gen_out / "m" / "gen.cu").write_text("generated source\n")
        obj = {"out": "m.cuda.o", "src": "@GEN@/gen.cu", "kind": "cuda", "mem_mb": 1,
               "args": ["nvcc", "@INPUT@"]}
        return {"schema_version": PLAN_SCHEMA, "flashinfer_version": "0", "arch": arch,
                "variant": variant, "patched_source_digest": "d" * 64, "nvcc_release": "13.0",
                "source_markers": [], "object_count": 1,
                "modules": [{"name": "m", "generator": "g:f", "kwargs": {}, "gen_digest": "g",
                             "objects": [obj], "link": {"args": ["c++", "@OBJECTS@"]}}]}

    def compile_one(module, obj, fill, out, nice):
        state["compiles"] += 1
        if state["during_compile"]:
            hook, state["during_compile"] = state["during_compile"], None
            hook()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"object of " + (fill.gen_dir / "gen.cu").read_bytes())
        return 0.0

    def link_one(module, fill, objects, out, stub_dir):
        state["links"] += 1
        assert stub_dir.is_dir()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"module:" + b"".join(o.read_bytes() for o in objects))

    def write_cuda_stubs(tc, out):
        out.mkdir(parents=True, exist_ok=True)
        return out

    for name, fn in (("make_plan", make_plan), ("compile_one", compile_one),
                     ("link_one", link_one), ("write_cuda_stubs", write_cuda_stubs)):
        monkeypatch.setattr(kc_build, name, fn)

    def run(out: Path, modules: Path | None = None) -> bytes:
        kc_build.build(state["tree"], modules or state["modules"], "12.0f", "full", out, 1,
                       state["cache"], _FakeToolchain(), 1000, 0)  # type: ignore[arg-type]
        return (out / AOT_SUBDIR / "m" / "m.so").read_bytes()

    state["run"] = run
    return state


def test_build_rebuilds_truncated_cached_object_and_module(
        fake_build: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cached file is reused only when it matches its sha256 record, never by existence."""
    good = fake_build["run"](tmp_path / "out1")
    assert (fake_build["compiles"], fake_build["links"]) == (1, 1)
    (obj,) = (fake_build["cache"] / "objects").rglob("*.o")
    (so,) = (fake_build["cache"] / "modules").rglob("*.so")
    assert fake_build["run"](tmp_path / "out2") == good  # warm: both reused
    assert (fake_build["compiles"], fake_build["links"]) == (1, 1)
    capsys.readouterr()

    obj.write_bytes(obj.read_bytes()[:5])  # e.g. a disk that filled up
    so.write_bytes(so.read_bytes()[:-1])
    assert fake_build["run"](tmp_path / "out3") == good
    assert (fake_build["compiles"], fake_build["links"]) == (2, 2)
    err = capsys.readouterr().err
    assert f"cached {obj.name}: 5 bytes, its record says" in err and "rebuilding it" in err
    assert f"cached {so.name}:" in err

    # Same size, other bytes; and a file whose record is gone: rebuilt too.
    assert record_path(obj).is_file() and record_path(so).is_file()
    so.write_bytes(b"X" * so.stat().st_size)
    record_path(obj).unlink()
    assert fake_build["run"](tmp_path / "out4") == good
    assert (fake_build["compiles"], fake_build["links"]) == (3, 3)
    err = capsys.readouterr().err
    assert f"cached {so.name}: sha256 differs from its record" in err
    assert f"cached {obj.name}: no valid .sha256 record" in err


def test_build_leaves_other_runs_generated_sources_alone(fake_build: dict[str, Any],
                                                         tmp_path: Path) -> None:
    """Two builds on one cache and tree at once: one that starts (and dies) while the other
    compiles must not remove the generated sources the other is compiling from."""
    dies = tmp_path / "dies.json"

    def second_run() -> None:
        with pytest.raises(UserError, match="a run that dies early"):
            fake_build["run"](tmp_path / "other", dies)

    fake_build["during_compile"] = second_run
    fake_build["run"](tmp_path / "out")
    assert fake_build["compiles"] == 1 and fake_build["during_compile"] is None
    assert not (tmp_path / "other").exists()
    # Each run's scratch (generated sources, link stubs) is gone afterwards; the shared
    # content-addressed objects and modules stay.
    assert list((fake_build["cache"] / "gen").iterdir()) == []
    assert sorted(p.name for p in fake_build["cache"].iterdir()) == ["gen", "modules", "objects"]


def test_build_progress_line_per_compiled_object(fake_build: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """One line per compiled object, in the format people and the bench read."""
    fake_build["run"](tmp_path / "out")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " objects  " in ln]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"\[kernel_cache\] 1/1 objects  m/m\.cuda\.o \d+\.\ds  elapsed \d+s  "
                        r"ETA 0s", lines[0]), lines[0]


def test_default_cache_dir_is_under_the_shared_cache_root(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = ["build", "--flashinfer-tree", "t", "--modules", "m", "--out", "o"]
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "root"))
    assert parser().parse_args(args).cache_dir == tmp_path / "root" / "kernels"
    monkeypatch.delenv("KIMI_K3_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parser().parse_args(args).cache_dir == tmp_path / "xdg" / "kimi-k3-build" / "kernels"


# The pypi stack's plan (its own FlashInfer) is checked against its wheel in test_selection.py.
@pytest.mark.parametrize("plan_name", [*FULL_PLANS, "plan_120f_kimi-k3.bzl",
                                       "plan_90a_gpu-test-sm90.bzl", "plan_120f_kimi-k3.pypi.bzl",
                                       "plan_120f_load-check.pypi.bzl",
                                       "plan_90a_gpu-test-sm90.pypi.bzl"])
def test_checked_in_plan_is_byte_for_byte_what_the_tool_writes(plan_name: str) -> None:
    """Header included: it names the generator, so a plan left from an older tool shows here."""
    path = REPO_ROOT / "kernel_cache" / plan_name
    assert render_plan(read_plan(path)) == path.read_text()
    assert path.read_text().startswith("# Generated by `python3 -m tools.kernel_cache plan`")


def test_bazel_actions_do_not_import_build_or_verify() -> None:
    """The Bazel actions' tool (//tools/kernel_cache:actions, the inputs of every compile action)
    leaves build.py and verify.py out: `python -m tools.kernel_cache` must not import them
    unless their subcommand runs, or an action would miss them (and an edit to them would have
    to invalidate every compiled object)."""
    code = ("import sys, runpy; sys.argv = ['kernel_cache', 'cuda-stubs', '--help']\n"
            "try:\n    runpy.run_module('tools.kernel_cache', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('tools.kernel_cache')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1].replace("'", '"'))
    assert "tools.kernel_cache.cli" in loaded, loaded
    assert "tools.kernel_cache.build" not in loaded and "tools.kernel_cache.verify" not in loaded, loaded


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
