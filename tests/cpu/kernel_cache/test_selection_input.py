"""Kernel selections as the tool reads them, without FlashInfer, a toolchain or a compile
(seconds): kernel_cache/selections.json mistakes refused at load (tools/kernel_cache/selection.py
load_selections), the probe subprocess's channel for a selection's UserError
(tools/kernel_cache/probe.py, with a stand-in flashinfer package), and the exception type the
docs promise for a call outside the selection. What needs FlashInfer's own lists (a misspelled
runner, a tile FlashInfer lacks) and the real module is test_selection.py's.
"""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from tools.common.errors import UserError
from tools.kernel_cache.modules import ModuleDecl
from tools.kernel_cache.probe import run_probe
from tools.kernel_cache.selection import (load_selections, module_selections, selection_header,
                                          stubs_source)
from tools.kernel_cache.tree import REPO_ROOT

SELECTIONS = REPO_ROOT / "kernel_cache" / "selections.json"
CHECKED_IN = json.loads(SELECTIONS.read_text())


def _edited(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = copy.deepcopy(CHECKED_IN)
    edit(data)
    path = tmp_path / "selections.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def _module(data: dict[str, Any], selection: str) -> dict[str, Any]:
    (ms,) = data["selections"][selection]["modules"].values()
    return ms


def _kimi(data: dict[str, Any]) -> dict[str, Any]:
    return _module(data, "kimi-k3")


def _sm90(data: dict[str, Any]) -> dict[str, Any]:
    return _module(data, "gpu-test-sm90")


KIMI = "$.selections.kimi-k3.modules.fused_moe_120"
SM90 = "$.selections.gpu-test-sm90.modules.fused_moe_90"
W4A16_TILE = {"cta": [64, 16, 128], "cluster": [1, 1, 1]}

LOAD_MISTAKES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # Before: the first copy took every operation, the second was "matches no operation".
    ("kernel entry twice", lambda d: _kimi(d)["kernels"].append(dict(_kimi(d)["kernels"][0])),
     f"{KIMI}.kernels[1]: the same kind, arch, act, weight and out as kernels[0] (grouped sm120 "
     "e4m3 x e2m1 -> bf16); keep one entry per dtype pair (with tiles: all of them in that entry)"),
    ("dtype pair in two entries", lambda d: _sm90(d)["kernels"].append(
        dict(_sm90(d)["kernels"][1], tiles=[{"cta": [64, 16, 128], "cluster": [2, 1, 1]}])),
     f"{SM90}.kernels[3]: the same kind, arch, act, weight and out as kernels[1] (grouped sm90 "
     "bf16 x e2m1 -> bf16); keep one entry per dtype pair (with tiles: all of them in that entry)"),
    # Before: a plan (rc 0) whose generated sources gen-sources could never reproduce.
    ("runner twice", lambda d: _kimi(d)["runners"].append(_kimi(d)["runners"][0]),
     f"{KIMI}.runners[1]: CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16> is listed "
     "twice (also runners[0]); remove one"),
    ("GEMM runner twice", lambda d: _sm90(d)["gemm_runners"].insert(0, _sm90(d)["gemm_runners"][1]),
     f"{SM90}.gemm_runners[2]: MoeGemmRunner<__nv_bfloat16, Fp4Type, __nv_bfloat16> is listed "
     "twice (also gemm_runners[0]); remove one"),
    ("tile twice", lambda d: _sm90(d)["kernels"][1]["tiles"].append(dict(W4A16_TILE)),
     f'{SM90}.kernels[1].tiles[2]: {json.dumps(W4A16_TILE)} is listed twice (also tiles[0]); '
     "remove one"),
    # Before: FlashInfer's "Failed to generate Cutlass kernels" traceback from the probe.
    ("tiles on an SM120 kernel", lambda d: _kimi(d)["kernels"][0].update(tiles=[W4A16_TILE]),
     f"{KIMI}.kernels[0].tiles: tile sets are supported for the SM90 mixed-input grouped kernels "
     "only (kind grouped, arch 90, act other than weight: their launchers are plain function "
     "templates a stub can define); drop 'tiles' there"),
    ("tiles on an SM90 same-type kernel", lambda d: _sm90(d)["kernels"][0].update(tiles=[W4A16_TILE]),
     f"{SM90}.kernels[0].tiles: tile sets are supported for the SM90 mixed-input grouped kernels "
     "only (kind grouped, arch 90, act other than weight: their launchers are plain function "
     "templates a stub can define); drop 'tiles' there"),
    ("tile of two numbers", lambda d: _sm90(d)["kernels"][1].update(
        tiles=[{"cta": [64, 16], "cluster": [1, 1, 1]}]),
     f'{SM90}.kernels[1].tiles: a non-empty list of {{"cta": [m, n, k], "cluster": [x, y, z]}}'),
    ("runner not spelled as a class", lambda d: _kimi(d).update(runners=["half"]),
     f"{KIMI}.runners: a list of 'CutlassMoeFCRunner<...>' as FlashInfer's explicit "
     "instantiations spell them"),
    ("type name not a string", lambda d: _kimi(d)["kernels"][0].update(out=16),
     f"{KIMI}.kernels[0]: expected {{kind: grouped|gemm, arch: int, act, weight, out}} with "
     "FlashInfer's type names (bf16, f16, e4m3, e2m1, ...), optionally tiles and why"),
]


@pytest.mark.parametrize("edit,message", [(e, m) for _, e, m in LOAD_MISTAKES],
                         ids=[name for name, _, _ in LOAD_MISTAKES])
def test_selection_mistakes_are_refused_at_load_in_one_line(
        tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(UserError) as raised:
        load_selections(path)
    assert str(raised.value) == f"--selections {path}: {message}"


def test_checked_in_selections_load() -> None:
    data = load_selections(SELECTIONS)
    assert sorted(data["selections"]) == ["full", "gpu-test-sm90", "kimi-k3", "load-check"]


def _line_of(text: str, needle: str) -> int:
    return text[:text.index(needle)].count("\n") + 1


@pytest.mark.parametrize("needle,duplicate,key", [
    # A second selection of one name: json would keep the last silently.
    ('"kimi-k3": {', '"kimi-k3": {"arch": "12.0f", "modules": {}},\n  "kimi-k3": {', "kimi-k3"),
    # A second "runners" in one module: the first list silently dropped.
    ('"runners": ["CutlassMoeFCRunner<__nv_fp8_e4m3', '"runners": [],\n     "runners": '
     '["CutlassMoeFCRunner<__nv_fp8_e4m3', "runners"),
], ids=["selection twice", "runners twice"])
def test_a_key_twice_is_refused_naming_the_key_and_its_object(
        tmp_path: Path, needle: str, duplicate: str, key: str) -> None:
    text = SELECTIONS.read_text()
    assert text.count(needle) == 1, needle
    edited = text.replace(needle, duplicate)
    path = tmp_path / "selections.json"
    path.write_text(edited)
    # The object holding the key twice starts on the line of its "{".
    obj_line, obj_path = {"kimi-k3": (_line_of(edited, '"selections": {'), "$.selections"),
                          "runners": (_line_of(edited, '"fused_moe_120": {'),
                                      "$.selections.kimi-k3.modules.fused_moe_120")}[key]
    with pytest.raises(UserError) as raised:
        load_selections(path)
    assert str(raised.value) == (f"--selections {path}: {obj_path}: key '{key}' appears twice in one object "
                                 f"(the object at line {obj_line}); remove one")


def test_a_selection_for_another_arch_is_named() -> None:
    with pytest.raises(UserError) as raised:
        module_selections(SELECTIONS, "gpu-test-sm90", "12.0f")
    assert str(raised.value) == ("--selection gpu-test-sm90: made for arch 9.0a, not 12.0f; pass "
                                 "--arch 9.0a or another selection")


# --------------------------------------------------------------------------------------------
# The probe subprocess: a selection's UserError raised inside FlashInfer's generators
# --------------------------------------------------------------------------------------------

# The probe imports flashinfer and tvm_ffi from the tree first on its path: stand-ins for both
# (the real tvm_ffi imports torch, seconds of a small test's minute).
_STAND_IN = {
    "tvm_ffi/__init__.py": "",
    "flashinfer/__init__.py": '__version__ = "0.0.0+stand-in"\n',
    "flashinfer/jit/__init__.py": "",
    "flashinfer/jit/cpp_ext.py": "def get_cuda_path():\n    return '/nonexistent/cuda'\n",
    "flashinfer/jit/env.py": ("from pathlib import Path\n"
                              "FLASHINFER_GEN_SRC_DIR = Path('/nonexistent/gen')\n"
                              "FLASHINFER_JIT_DIR = Path('/nonexistent/jit')\n"),
}
_MESSAGE = ("selections.broken.modules.stand_in.kernels[0] (grouped sm120 bf16 x bf16 -> bf16): "
            "matches no operation FlashInfer generates for arch 12.0f; fix or drop it")
GENERATORS = {
    # FlashInfer's CUTLASS generators re-raise what the selection's filter raises this way
    # (flashinfer/jit/fused_moe.py: RuntimeError("Failed to generate Cutlass kernels: ...") from e).
    "wrapped": ("from tools.common.errors import UserError\n"
                "def gen():\n    try:\n"
                f"        raise UserError({_MESSAGE!r})\n"
                "    except Exception as e:\n"
                '        raise RuntimeError(f"Failed to generate Cutlass kernels: {e}") from e\n'),
    "direct": ("from tools.common.errors import UserError\n"
               f"def gen():\n    raise UserError({_MESSAGE!r})\n"),
    "broken": "def gen():\n    import torch_that_is_not_installed\n",
}


def _probe(tmp_path: Path, generator: str) -> UserError:
    tree = tmp_path / "tree"
    for rel, text in {**_STAND_IN, "flashinfer/stand_in_gen.py": GENERATORS[generator]}.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    decl = ModuleDecl(name="stand_in", generator="flashinfer.stand_in_gen:gen", kwargs={},
                      variant_kwargs={}, archs=(), markers=())
    toolchain: Any = SimpleNamespace(cuda_home=Path("/nonexistent/cuda"))
    with pytest.raises(UserError) as raised:
        run_probe(tree, [decl], "12.0f", "full", toolchain, python=sys.executable)
    return raised.value


@pytest.mark.parametrize("generator", ["wrapped", "direct"])
def test_a_selection_error_in_the_probe_arrives_as_its_one_line(tmp_path: Path,
                                                                 generator: str) -> None:
    """Before: the probe's traceback tail under 'FlashInfer generator probe failed (is the tree
    a flashinfer wheel and torch/tvm_ffi installed?)'."""
    assert str(_probe(tmp_path, generator)) == _MESSAGE


def test_other_probe_failures_keep_the_probe_tail(tmp_path: Path) -> None:
    message = str(_probe(tmp_path, "broken"))
    assert message.startswith(f"--flashinfer-tree {tmp_path / 'tree'}: FlashInfer generator probe "
                              "failed (is the tree a flashinfer wheel"), message
    assert "No module named 'torch_that_is_not_installed'" in message, message


# --------------------------------------------------------------------------------------------
# What Python sees for a call outside the selection, and what the docs say
# --------------------------------------------------------------------------------------------

DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "docs" / "GPU_RUN.md",
        REPO_ROOT / "kernel_cache" / "README.md", REPO_ROOT / "kernel_cache" / "INTERNALS.md"]
# A claim that a call raises the Python class (the TVM FFI kind of that name is no such claim).
_CLAIM = re.compile(r"\b(?:raises?|raised|raising|throws?)\s+(?:an?\s+)?`?NotImplementedError\b")


# What Python gets for an error of a TVM FFI kind, from the installed tvm-ffi (without torch,
# which tvm_ffi would otherwise import first: seconds).
_RAISE_KIND = r"""
import json, sys
sys.modules["torch"] = None
import tvm_ffi
try:
    tvm_ffi.get_global_func("testing.test_raise_error")(sys.argv[1], "outside the selection")
except Exception as e:
    print(json.dumps({"exactly_runtime_error": type(e) is RuntimeError, "type": type(e).__name__,
                      "kind": e.__tvm_ffi_error__.kind}))
"""


def test_docs_name_the_exception_python_sees() -> None:
    """make_runner and the tile stubs throw one TVM FFI error kind; the installed tvm-ffi turns
    it into exactly RuntimeError (no Python class is registered for the kind), which is what
    kernel_cache/README.md and INTERNALS.md, docs/GPU_RUN.md, README.md and selections.json must say."""
    header = selection_header({"selection": "s", "arch": "12.0f", "runners": []}, "m", [])
    stub = stubs_source({"selection": "s", "arch": "9.0a"}, "m", {"includes": [], "stubs": [{
        "entry": 0, "tile": {"cta": [64, 16, 128], "cluster": [2, 1, 1]},
        "instantiation": "template void sm90_generic_mixed_moe_gemm_kernelLauncher<int>(int);"}]})
    (kind,) = set(re.findall(r"TVM_FFI_LOG_AND_THROW\((\w+)\)", header + stub))
    proc = subprocess.run([sys.executable, "-c", _RAISE_KIND, kind], capture_output=True,
                          text=True, check=True)
    seen = json.loads(proc.stdout)
    assert seen == {"exactly_runtime_error": True, "type": "RuntimeError",
                    "kind": "NotImplementedError"}, seen
    texts = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in DOCS}
    texts["kernel_cache/selections.json description"] = CHECKED_IN["description"]
    for name, text in texts.items():
        assert not _CLAIM.findall(text), (name, _CLAIM.findall(text))
        assert "RuntimeError" in text, name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
