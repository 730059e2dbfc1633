"""CPU tests for kernel selections (tools/kernel_cache/selection.py, kernel_cache/selections.json).

Needs what test_kernel_cache.py needs (the default stack's flashinfer-python wheel as
KIMI_TEST_FLASHINFER_WHEEL, the pinned toolchain (KIMI_KC_CUDA_IDENTITY, KIMI_KC_USERLAND_IDENTITY); missing
nvcc fails, never skips). The wheel stands in for the patched tree: #4460 changes file contents,
not which instantiations exist. The compiled products come from the kernel stage's own Bazel
actions, built from the patch-gate tree of a stack that needs no GitHub (KIMI_KC_OFFLINE_TREE;
tests/cpu/kernel_cache/BUILD.bazel): the pruned fused_moe_120 of the test-only selection
load-check (no runner; KIMI_KC_LOAD_CHECK_BUILD), loaded here with every symbol bound
(LD_BIND_NOW, the image smoke test's driver stub) and an unselected runner constructed through
it; and gpu-test-sm90's W4A16 stub object with its generated sources (KIMI_KC_W4A16_STUBS_BUILD).
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tools.common.errors import UserError
from tools.image.driver_stub import write_driver_stub
from tools.kernel_cache.plan import describe_drift, make_plan, moe_instantiations, read_plan
from tools.kernel_cache.selection import (BINDING, HEADER_NAME, INSTANTIATION, SELECTION_DIR,
                                          instances, load_selections)
from tests.cpu.conftest import env_path, pinned_toolchain_paths, stack_version
from tools.kernel_cache.toolchain import load_toolchain
from tools.kernel_cache.tree import AOT_SUBDIR, REPO_ROOT

from tests.cpu.kernel_cache.plan_checks import assert_plan_matches_flashinfer, stage_output

SELECTIONS = REPO_ROOT / "kernel_cache" / "selections.json"
MODULES = REPO_ROOT / "kernel_cache" / "modules.json"
CSRC = "flashinfer/data/csrc"


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is unset: Bazel sets it from the pinned repository; set it to run "
                    "this test by hand")
    return value


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cuda_home, userland = pinned_toolchain_paths()
    base = tmp_path_factory.mktemp("selection")
    saved_tempdir = tempfile.tempdir
    tempfile.tempdir = str(base / "scratch")
    os.mkdir(tempfile.tempdir)
    tree = base / "tree"
    with zipfile.ZipFile(_required_env("KIMI_TEST_FLASHINFER_WHEEL")) as z:
        z.extractall(tree)
    # fused_moe_120 as declared, without the #4460 markers the wheel lacks.
    decl = next(m for m in json.loads(MODULES.read_text())["modules"] if m["name"] == "fused_moe_120")
    decl = {k: v for k, v in decl.items() if k != "source_markers"}
    modules = base / "modules.json"
    modules.write_text(json.dumps({"schema_version": 1, "modules": [decl]}))
    tc = load_toolchain(cuda_home, userland)
    yield {"base": base, "tree": tree, "modules": modules, "tc": tc, "cuda_home": cuda_home}
    tempfile.tempdir = saved_tempdir


def _selections(path: Path, **named: dict[str, Any]) -> Path:
    data = json.loads(SELECTIONS.read_text())
    data["selections"].update(named)
    path.write_text(json.dumps(data))
    return path


def _moe(runners: list[str], gemm_runners: list[str], kernels: list[dict[str, Any]]) -> dict[str, Any]:
    return {"arch": "12.0f", "modules": {"fused_moe_120": {
        "runners": runners, "gemm_runners": gemm_runners, "kernels": kernels}}}


def _starlark_dict(text: str, name: str) -> Any:
    m = re.search(rf"^{name} = (\{{.*?\n?\}})", text, re.M | re.S)
    assert m, name
    return ast.literal_eval(m.group(1))


def test_checked_in_selections_agree_with_the_bazel_constants() -> None:
    """Every selection of selections.json has a checked-in plan for its arch, and the Bazel
    settings' default per arch is default_for_arch. (The plans are indexed by file name,
    tools/kernel_cache/private/plans.bzl, which checks each file's arch, selection and variant.)"""
    data = load_selections(SELECTIONS)
    constants = (REPO_ROOT / "tools/kernel_cache/private/constants.bzl").read_text()
    planned = {n: s["arch"] for n, s in data["selections"].items() if n != "full"}
    plans = [read_plan(f) for f in sorted((REPO_ROOT / "kernel_cache").glob("plan_*.bzl"))]
    assert {p["selection"]: p["arch"] for p in plans if "selection" in p} == planned
    assert _starlark_dict(constants, "DEFAULT_SELECTION") == data["default_for_arch"]


@pytest.mark.parametrize("plan_name", ["plan_120f_kimi-k3.bzl", "plan_90a_gpu-test-sm90.bzl"])
def test_checked_in_selection_plan_matches_flashinfer(env: dict[str, Any], plan_name: str) -> None:
    assert_plan_matches_flashinfer(env["tree"], plan_name, env["tc"])


def test_offline_stack_plans_match_its_flashinfer(env: dict[str, Any]) -> None:
    """Each checked-in plan of the stack the Bazel products here are built from is what its
    selection makes of that stack's patch-gate tree (the tree those actions compile), digests
    included; the kimi-k3 one keeps 17 of fused_moe_120's objects."""
    stack = _required_env("KIMI_KC_OFFLINE_STACK")
    tree = env_path("KIMI_KC_OFFLINE_TREE")
    plans = sorted((REPO_ROOT / "kernel_cache").glob(f"plan_*.{stack}.bzl"))
    selections = set()
    for path in plans:
        checked_in = read_plan(path)
        assert checked_in["flashinfer_version"] == stack_version(stack, "flashinfer"), path.name
        fresh = make_plan(tree, MODULES, checked_in["arch"], "full", env["tc"],
                          selection=checked_in["selection"], selections_path=SELECTIONS)
        assert describe_drift(checked_in, fresh) is None, path.name
        selections.add(checked_in["selection"])
        if checked_in["selection"] == "kimi-k3":
            (moe,) = [m for m in fresh["modules"] if m["name"] == "fused_moe_120"]
            assert len(moe["objects"]) == 17
    assert selections >= {"kimi-k3", "load-check", "gpu-test-sm90"}, [p.name for p in plans]


def test_kimi_k3_plan_compiles_only_mxfp8_x_mxfp4(env: dict[str, Any], tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    plan = make_plan(env["tree"], env["modules"], "12.0f", "full", env["tc"], gen_out=gen,
                     enforce_markers=False, selection="kimi-k3", selections_path=SELECTIONS)
    (m,) = plan["modules"]
    assert plan["selection"] == "kimi-k3" and m["kernel_selection"]["name"] == "kimi-k3"
    names = [o["out"] for o in m["objects"]]
    assert not [n for n in names if "gemm_sm90" in n or "grouped_sm80" in n], names
    assert len([n for n in names if "grouped_sm120" in n]) == 2, names
    assert [n for n in names if "moe_gemm_kernels" in n] == ["moe_gemm_moe_gemm_kernels_fp8_fp4.cuda.o"]
    # FlashInfer's generated SM120 instantiations: the 12 of e4m3 x e2m1 with bf16 output only.
    found = moe_instantiations(gen / "fused_moe_120")
    assert len(found) == 12 and all("Sm120, __nv_fp8_e4m3, SafeFP4, __nv_bfloat16," in i
                                    for i in found), found
    sel = gen / "fused_moe_120" / SELECTION_DIR
    assert instances((sel / "cutlass_backend" / INSTANTIATION).read_text()) == [
        "CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>"]
    assert instances((sel / "moe_gemm" / "moe_gemm_kernels_fp8_fp4.cu").read_text()) == [
        "MoeGemmRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>"]
    binding = (sel / "cutlass_backend" / BINDING).read_text()
    assert binding.startswith(f'#include "{HEADER_NAME}"')
    # Every construction goes through make_runner (a commented-out one too, which is harmless).
    total = len(re.findall(r"kernels::CutlassMoeFCRunner<", binding))
    assert len(re.findall(r"make_runner<\s*kernels::CutlassMoeFCRunner<", binding)) == total > 0
    # Includes FlashInfer resolved beside the original are rebased onto csrc/ and exist there.
    for copy in sel.rglob("*.cu"):
        for inc in re.findall(r'#include "([^"]+)"', copy.read_text()):
            if "/" in inc and not inc.startswith(("tensorrt_llm/", "tvm/", "cutlass")):
                assert (env["tree"] / CSRC / inc).is_file(), (copy.name, inc)
    assert '"tvm_ffi_utils.h"' in binding and '"../../tvm_ffi_utils.h"' not in binding
    # `full` adds nothing to a plan: the plans made before selections stay byte-identical.
    full = make_plan(env["tree"], env["modules"], "12.0f", "full", env["tc"], enforce_markers=False)
    assert "selection" not in full and "kernel_selection" not in full["modules"][0]
    assert len(full["modules"][0]["objects"]) == 96


_MIXED_RE = re.compile(r"template\s+(?:<>\s*)?void\s+(sm90_generic_mixed_moe_\w*kernelLauncher)\s*<"
                       r"[^;{]*?cute::Shape<cute::Int<(\d+)>, cute::Int<(\d+)>, cute::Int<(\d+)>>, "
                       r"cute::Shape<cute::Int<(\d+)>, cute::Int<(\d+)>, cute::Int<(\d+)>>")


def _mixed_tiles(text: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(map(int, m.group(2, 3, 4))), tuple(map(int, m.group(5, 6, 7))))
            for m in _MIXED_RE.finditer(text)]


def test_w4a16_tile_set_compiles_its_tiles_and_stubs_the_rest() -> None:
    """gpu-test-sm90 keeps two W4A16 tiles: FlashInfer's generated mixed-input files hold only
    those, every other bf16 x e2m1 launcher is a stub (an explicit specialization, the symbol
    FlashInfer's explicit instantiation would define) that throws naming its tile and where to
    select it, and the stub file compiles for 9.0a and defines exactly those symbols. The
    generated sources, the plan and the object are the Bazel actions' (gen-sources checked them
    against the plan, compile-object ran the plan's command with the pinned toolchain)."""
    plan = read_plan(stage_output("KIMI_KC_W4A16_STUBS_BUILD", ".bzl"))
    assert (plan["arch"], plan["selection"]) == ("9.0a", "gpu-test-sm90")
    (m,) = [m for m in plan["modules"] if m["name"] == "fused_moe_90"]
    (entry,) = [k for k in load_selections(SELECTIONS)["selections"]["gpu-test-sm90"]["modules"]
                ["fused_moe_90"]["kernels"] if "tiles" in k]
    wanted = {(tuple(t["cta"]), tuple(t["cluster"])) for t in entry["tiles"]}
    mod_gen = stage_output("KIMI_KC_W4A16_STUBS_BUILD", "fused_moe_90_gen")
    kept_files = sorted(mod_gen.rglob("*_Mixed_*.generated.cu"))
    kept = [t for f in kept_files for t in _mixed_tiles(f.read_text())]
    assert kept and set(kept) == wanted, kept
    assert len(kept_files) == 2, kept_files  # from 23 files (181 operations more) in `full`
    stub_file = mod_gen / "kernel_selection" / "stubs" / "unselected_tiles.cu"
    stub_text = stub_file.read_text()
    stubbed = _mixed_tiles(stub_text)
    counts = m["kernel_selection"]["generated_operations"]
    assert len(stubbed) == counts["stubbed"] > 100 and not set(stubbed) & wanted
    assert stub_text.count("TVM_FFI_LOG_AND_THROW(NotImplementedError)") == len(stubbed)
    assert ("(CTA 64x16x128, cluster 2x1x1) is not compiled into fused_moe_90: its tile is outside "
            "kernel selection gpu-test-sm90 (arch 9.0a); add {\\\"cta\\\": [64, 16, 128], \\\"cluster\\\": "
            "[2, 1, 1]} to selections.gpu-test-sm90.modules.fused_moe_90.kernels[1].tiles") in stub_text
    (stub_obj,) = [o for o in m["objects"] if o["out"] == "stubs_unselected_tiles.cuda.o"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in stub_obj["args"], stub_obj["args"]
    # Compiled as the plan compiles it: one definition per stub.
    defined = subprocess.run(["nm", "-C", "--defined-only",
                              str(stage_output("KIMI_KC_W4A16_STUBS_BUILD", stub_obj["out"]))],
                             capture_output=True, text=True, check=True).stdout
    assert len([ln for ln in defined.splitlines() if " T " in ln
                and "sm90_generic_mixed_moe_gemm_kernelLauncher<" in ln]) == len(stubbed)


@pytest.mark.parametrize("selection,message", [
    (_moe(["CutlassMoeFCRunner<half, half, half>"], [], []),
     r"^selections\.broken\.modules\.fused_moe_120: runners \['CutlassMoeFCRunner<half, half, half>'\] "
     r"are not instantiated by FlashInfer \(it has: CutlassMoeFCRunner<float, float>; "
     r".*CutlassMoeFCRunner<half, half>;.*\); fix the spelling in kernel_cache/selections\.json$"),
    (_moe([], ["MoeGemmRunner<half, half>"], []),
     r"^selections\.broken\.modules\.fused_moe_120: gemm_runners \['MoeGemmRunner<half, half>'\]"),
    (_moe([], [], [{"kind": "grouped", "arch": 120, "act": "bf16", "weight": "bf16", "out": "bf16"}]),
     r"^selections\.broken\.modules\.fused_moe_120\.kernels\[0\] \(grouped sm120 bf16 x bf16 -> "
     r"bf16\): matches no operation FlashInfer generates for arch 12\.0f; fix or drop it"),
])
def test_selection_mistakes_are_named(env: dict[str, Any], tmp_path: Path,
                                      selection: dict[str, Any], message: str) -> None:
    """Names only FlashInfer knows are checked in the probe subprocess (inside FlashInfer's
    generators, which wrap errors in their own RuntimeError): the UserError still arrives as
    its one line, not as the probe's traceback under a question about torch. Mistakes that need
    no FlashInfer are test_selection_input.py's."""
    path = _selections(tmp_path / "selections.json", broken=selection)
    with pytest.raises(UserError) as raised:
        make_plan(env["tree"], env["modules"], "12.0f", "full", env["tc"], enforce_markers=False,
                  selection="broken", selections_path=path)
    assert "\n" not in str(raised.value) and re.search(message, str(raised.value)), raised.value


def test_unknown_tile_is_named_in_one_line(env: dict[str, Any], tmp_path: Path) -> None:
    """A tile the SM90 mixed-input kernels do not have: found in the probe, one line."""
    decl = next(m for m in json.loads(MODULES.read_text())["modules"] if m["name"] == "fused_moe_90")
    modules = tmp_path / "modules.json"
    modules.write_text(json.dumps({"schema_version": 1, "modules": [
        {k: v for k, v in decl.items() if k != "source_markers"}]}))
    data = json.loads(SELECTIONS.read_text())
    data["selections"]["gpu-test-sm90"]["modules"]["fused_moe_90"]["kernels"][1]["tiles"].append(
        {"cta": [64, 16, 129], "cluster": [1, 1, 1]})
    path = tmp_path / "selections.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as raised:
        make_plan(env["tree"], modules, "9.0a", "full", env["tc"], enforce_markers=False,
                  selection="gpu-test-sm90", selections_path=path)
    assert str(raised.value) == (
        "selections.gpu-test-sm90.modules.fused_moe_90.kernels[1] (grouped sm90 bf16 x e2m1 -> "
        'bf16): tiles [{"cta": [64, 16, 129], "cluster": [1, 1, 1]}] match no operation FlashInfer '
        "generates for that dtype pair; fix or drop them in kernel_cache/selections.json")


def test_unknown_selection_is_named(env: dict[str, Any]) -> None:
    with pytest.raises(UserError, match=r"--selection kimi: not in .*selections.json \(has full, "
                                        r"gpu-test-sm90, kimi-k3, load-check\)"):
        make_plan(env["tree"], env["modules"], "12.0f", "full", env["tc"], enforce_markers=False,
                  selection="kimi", selections_path=SELECTIONS)


_CALL_UNSELECTED = r"""
import json, sys
import tvm_ffi
mod = tvm_ffi.load_module(sys.argv[1])
bf16 = tvm_ffi.dtype("bfloat16")
try:
    mod.init(bf16, bf16, bf16, False, False, False, False, False, False)
    print(json.dumps({"raised": None}))
except Exception as e:
    print(json.dumps({"raised": f"{type(e).__module__}.{type(e).__qualname__}",
                      "exactly_runtime_error": type(e) is RuntimeError,
                      "kind": getattr(getattr(e, "__tvm_ffi_error__", None), "kind", None),
                      "message": str(e)}))
"""


def test_pruned_module_loads_and_an_unselected_runner_fails_by_name(tmp_path: Path) -> None:
    """The smallest pruned fused_moe_120 (selection load-check: no runner, no GEMM kernel), as
    the Bazel actions compile and link it: loads with every symbol bound (nothing undefined that
    the loader would need), and constructing the bf16 runner raises exactly RuntimeError (as the
    docs say; TVM FFI kind NotImplementedError) naming it and the selection to add it to."""
    aot = stage_output("KIMI_KC_LOAD_CHECK_BUILD", "_aot") / AOT_SUBDIR
    data = json.loads((aot / "kernel_cache.json").read_text())
    assert data["selection"] == "load-check" and data["arch_list"] == "12.0f"
    chosen = load_selections(SELECTIONS)["selections"]["load-check"]["modules"]["fused_moe_120"]
    assert (chosen["runners"], chosen["gemm_runners"], chosen["kernels"]) == ([], [], [])
    moe = data["modules"]["fused_moe_120"]
    assert moe["kernel_selection"]["runners"] == [] and moe["objects"] == 14  # 8 CUDA + 6 host C++
    so = aot / moe["path"]
    # The image smoke test's stand-in libcuda.so.1, defining the driver symbols the module imports.
    listing = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True,
                             text=True, check=True).stdout
    driver = sorted({ln.split()[-1].split("@")[0] for ln in listing.splitlines()
                     if re.match(r"^cu[A-Z]\w*$", ln.split()[-1].split("@")[0])})
    rootfs = tmp_path / "rootfs"
    stub_dir = rootfs / write_driver_stub(rootfs, driver).lstrip("/")
    libs = [str(stub_dir), str(Path(pinned_toolchain_paths()[0]) / "lib")]
    proc = subprocess.run(
        [sys.executable, "-c", _CALL_UNSELECTED, str(so)], capture_output=True, text=True,
        env={**os.environ, "LD_BIND_NOW": "1", "LD_LIBRARY_PATH": os.pathsep.join(libs)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # TVM FFI's NotImplementedError kind (the binding's own for unsupported combinations);
    # tvm-ffi registers no Python class for it, so Python sees exactly a RuntimeError.
    assert result["exactly_runtime_error"] and result["kind"] == "NotImplementedError", result
    assert ("CUTLASS MoE runner CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16> is not compiled "
            "into fused_moe_120: it is outside kernel selection load-check (arch 12.0f); add it "
            "to selections.load-check.modules.fused_moe_120") in result["message"], result


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
