"""Kernel selection (kernel_cache/selections.json): which CUTLASS fused-MoE instantiations a
deployment compiles, so a module builds only the kernels it runs.

A selection names, per CUTLASS MoE module, the runner classes the binding may construct
(`runners`: `CutlassMoeFCRunner<...>` as FlashInfer's cutlass_fused_moe_instantiation.cu spells
them), the GEMM runners they use (`gemm_runners`: `MoeGemmRunner<...>` as the
moe_gemm_kernels_*.cu files spell them) and the generated GEMM kernels (`kernels`: FlashInfer's
own operations of flashinfer/jit/gemm/cutlass/generate_kernels.py, matched on kind, arch and
activation / weight / output type). Everything here works on generated sources; the patched tree
is never changed, so the `full` selection's plans (and the full cache) stay as they are.

In the probe subprocess (FlashInfer imported from the tree), for a module with a selection:
  1. FlashInfer's operation generators are wrapped so only matching operations reach its own
     grouping and file writer (kernel_filter): fewer, smaller generated files;
  2. the host sources are replaced by generated copies (select_sources): the instantiation lists
     keep only the selected `template class ...;` statements (a moe_gemm_kernels file with none
     left is dropped), and the binding's runner constructions go through make_runner<R>() from a
     generated header, which constructs R only when it is selected and otherwise throws
     NotImplementedError naming R and the selection. An unselected runner is then never
     odr-used, so nothing the module references is undefined: it loads, and fails per call.
Why copies and not a patch in flashinfer_patches/: see kernel_cache/README.md "Kernel selection".
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from tools.common.errors import UserError

SELECTIONS_SCHEMA = 1
# The selection that changes nothing: FlashInfer's own source lists, as before selections.
FULL = "full"
# Where generated copies go inside a module's generated-sources directory.
SELECTION_DIR = "kernel_selection"
HEADER_NAME = "kimi_k3_kernel_selection.h"
_KERNEL_KEYS = {"kind", "arch", "act", "weight", "out"}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


# --------------------------------------------------------------------------------------------
# selections.json
# --------------------------------------------------------------------------------------------

def load_selections(path: Path) -> dict[str, Any]:
    """The validated file: {"selections": {name: {...}}, "default_for_arch": {arch: name}}."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--selections {path}: cannot read JSON ({e}); fix the file") from None
    if data.get("schema_version") != SELECTIONS_SCHEMA or not isinstance(data.get("selections"), dict):
        raise UserError(f"--selections {path}: expected schema_version {SELECTIONS_SCHEMA} and a "
                        "'selections' object")
    sels = data["selections"]
    if FULL not in sels:
        raise UserError(f"--selections {path}: the '{FULL}' selection (everything) is missing")
    for name, sel in sels.items():
        where = f"--selections {path}: selections.{name}"
        if not _NAME_RE.match(name) or not isinstance(sel, dict):
            raise UserError(f"{where}: names are lower-case words with '-', values objects")
        if name == FULL:
            if sel.get("modules"):
                raise UserError(f"{where}: '{FULL}' filters nothing; it takes no 'modules'")
            continue
        if not isinstance(sel.get("arch"), str) or not isinstance(sel.get("modules"), dict):
            raise UserError(f"{where}: needs 'arch' (e.g. 12.0f) and 'modules'")
        for mod, ms in sel["modules"].items():
            _check_module_selection(f"{where}.modules.{mod}", ms)
    for arch, name in data.get("default_for_arch", {}).items():
        if name not in sels or (name != FULL and sels[name]["arch"] != arch):
            raise UserError(f"--selections {path}: default_for_arch.{arch} = {name!r} is not a "
                            f"selection for arch {arch}")
    return data


def _check_module_selection(where: str, ms: Any) -> None:
    if not isinstance(ms, dict) or set(ms) - {"why", "runners", "gemm_runners", "kernels"}:
        raise UserError(f"{where}: expected an object with runners, gemm_runners, kernels (and why)")
    for key, prefix in (("runners", "CutlassMoeFCRunner<"), ("gemm_runners", "MoeGemmRunner<")):
        names = ms.get(key, [])
        if not isinstance(names, list) or not all(
                isinstance(n, str) and n.startswith(prefix) and n.endswith(">") for n in names):
            raise UserError(f"{where}.{key}: a list of '{prefix}...>' as FlashInfer's explicit "
                            "instantiations spell them")
    for i, k in enumerate(ms.get("kernels", [])):
        if not isinstance(k, dict) or set(k) != _KERNEL_KEYS or k["kind"] not in ("grouped", "gemm") \
                or not isinstance(k["arch"], int):
            raise UserError(f"{where}.kernels[{i}]: expected {{kind: grouped|gemm, arch: int, act, "
                            "weight, out}} with FlashInfer's type names (bf16, f16, e4m3, e2m1, ...)")


def module_selections(path: Path, name: str, arch: str) -> dict[str, dict[str, Any]] | None:
    """{module: its selection} for selection `name` (None for `full`: nothing filtered)."""
    sels = load_selections(path)["selections"]
    if name not in sels:
        raise UserError(f"--selection {name}: not in {path} (has {', '.join(sorted(sels))})")
    if name == FULL:
        return None
    sel = sels[name]
    if sel["arch"] != arch:
        raise UserError(f"--selection {name}: made for arch {sel['arch']}, not {arch}; pass "
                        f"--arch {sel['arch']} or another selection")
    return {mod: {"selection": name, "arch": arch, "runners": sorted(ms.get("runners", [])),
                  "gemm_runners": sorted(ms.get("gemm_runners", [])),
                  "kernels": ms.get("kernels", [])}
            for mod, ms in sel["modules"].items()}


def planned_selections(plan: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """module_selections() as recorded in a plan (gen-sources re-runs the probe from the plan
    alone, so its generated sources equal the planned ones)."""
    if "selection" not in plan:
        return None
    return {m["name"]: {"selection": plan["selection"], "arch": plan["arch"],
                        "runners": m["kernel_selection"]["runners"],
                        "gemm_runners": m["kernel_selection"]["gemm_runners"],
                        "kernels": m["kernel_selection"]["kernels"]}
            for m in plan["modules"] if "kernel_selection" in m}


# --------------------------------------------------------------------------------------------
# 1. FlashInfer's operation lists, filtered (runs in the probe subprocess)
# --------------------------------------------------------------------------------------------

def operation_key(op: Any, names: Any) -> dict[str, Any]:
    """An operation of generate_kernels.py as the selection matches it. SM80 fused grouped
    operations (GemmSm80LauncherConfig) carry one dtype for activation, weight and output."""
    kind = "grouped" if op.gemm_kind == names.GemmKind.Grouped else "gemm"
    if hasattr(op, "act_type"):
        act, weight, out = op.act_type, op.weight_type, op.output_type
    else:
        act = weight = out = op.dtype
    return {"kind": kind, "arch": int(op.arch), "act": names.GetDataTypeNames(act),
            "weight": names.GetDataTypeNames(weight), "out": names.GetDataTypeNames(out)}


@contextlib.contextmanager
def kernel_filter(ms: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """While active, FlashInfer's generate_sm*_operations return only selected operations, so its
    own grouping and writer emit the selected kernels only. Yields counts for the plan."""
    from flashinfer.jit.gemm.cutlass import generate_kernels as gk

    wanted = [dict(k) for k in ms["kernels"]]
    hits = [0] * len(wanted)
    stats = {"operations": 0, "selected": 0}
    originals = {n: f for n, f in vars(gk).items()
                 if re.fullmatch(r"generate_sm\d+_operations", n) and callable(f)}
    if not originals:
        raise UserError("flashinfer.jit.gemm.cutlass.generate_kernels has no generate_sm*_operations:"
                        " update tools/kernel_cache/selection.py for this FlashInfer version")

    def wrap(fn: Any) -> Any:
        def filtered(*args: Any, **kwargs: Any) -> list[Any]:
            kept = []
            for op in fn(*args, **kwargs):
                stats["operations"] += 1
                key = operation_key(op, gk)
                for i, w in enumerate(wanted):
                    if w == key:
                        hits[i] += 1
                        kept.append(op)
                        break
            stats["selected"] += len(kept)
            return kept
        return filtered

    for n, f in originals.items():
        setattr(gk, n, wrap(f))
    try:
        yield stats
    finally:
        for n, f in originals.items():
            setattr(gk, n, f)
    unmatched = [w for w, h in zip(wanted, hits) if not h]
    if unmatched:
        raise UserError(f"selection {ms['selection']}: kernels {unmatched} match no operation "
                        "FlashInfer generates for this arch; fix kernel_cache/selections.json")


# --------------------------------------------------------------------------------------------
# 2. Host sources: filtered instantiation lists, the binding through make_runner
# --------------------------------------------------------------------------------------------

INSTANCE_RE = re.compile(r"^[ \t]*template[ \t]+class[ \t]+(CutlassMoeFCRunner|MoeGemmRunner)"
                         r"\s*<(.*?)>\s*;", re.M | re.S)
_CONSTRUCT_RE = re.compile(r"std::make_(?:shared|unique)<(\s*)kernels::CutlassMoeFCRunner<")
_INCLUDE_RE = re.compile(r'^([ \t]*#[ \t]*include[ \t]*)"([^"]+)"', re.M)
BINDING = "flashinfer_cutlass_fused_moe_binding.cu"
INSTANTIATION = "cutlass_fused_moe_instantiation.cu"
_GEMM_FILE = re.compile(r"^moe_gemm_kernels_\w+\.cu$")


def instance_name(cls: str, args: str) -> str:
    return f"{cls}<{', '.join(' '.join(a.split()) for a in args.split(','))}>"


def instances(text: str) -> list[str]:
    return [instance_name(m.group(1), m.group(2)) for m in INSTANCE_RE.finditer(text)]


def _keep_instances(text: str, keep: set[str], selection: str) -> tuple[str, list[str]]:
    kept: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name = instance_name(m.group(1), m.group(2))
        if name in keep:
            kept.append(name)
            return m.group(0)
        return f"/* {name}: not in kernel selection {selection} */"
    return INSTANCE_RE.sub(sub, text), kept


def _rebase_includes(text: str, orig: Path, csrc: Path) -> str:
    """A copy compiles from another directory: includes FlashInfer resolves relative to the
    original file ("x.h" beside it, "../../y.h") are rewritten relative to csrc/, which every
    object of the module has on its include path."""
    def sub(m: re.Match[str]) -> str:
        target = (orig.parent / m.group(2)).resolve()
        if not target.is_file():
            return m.group(0)
        try:
            rel = target.relative_to(csrc.resolve())
        except ValueError:
            raise UserError(f"{orig.name}: include {m.group(2)!r} leaves csrc/; cannot copy it "
                            "for a kernel selection") from None
        return f'{m.group(1)}"{rel.as_posix()}"'
    return _INCLUDE_RE.sub(sub, text)


def selection_header(ms: Mapping[str, Any], module: str, all_runners: Sequence[str]) -> str:
    """make_runner<R>(): R when selected, else NotImplementedError naming R and the selection.
    std::is_same_v never instantiates R, so an unselected runner's vtable and members are never
    referenced (no undefined symbol at load)."""
    ns = "tensorrt_llm::kernels::cutlass_kernels"

    def chain(names: Sequence[str], then: Callable[[str], str], other: str) -> str:
        return "".join(f"  if constexpr (std::is_same_v<R, {n}>) {{\n    return {then(n)};\n  }} else\n"
                       for n in names) + f"  {{\n    return {other};\n  }}\n"
    sel, arch = ms["selection"], ms["arch"]
    hint = (f"add it to selections.{sel}.modules.{module} (runners, gemm_runners, kernels) in "
            "kernel_cache/selections.json, regenerate the plan and rebuild the kernel cache")
    return (
        f"// Generated by tools/kernel_cache (kernel selection {sel}, arch {arch}); do not edit.\n"
        "#pragma once\n#include <memory>\n#include <type_traits>\n\n#include <tvm/ffi/error.h>\n\n"
        '#include "moe_kernels.h"\n\nnamespace kimi_k3_kernel_selection {\n'
        f"using namespace {ns};\n\n"
        "template <typename R>\nconstexpr bool selected() {\n"
        + chain(ms["runners"], lambda n: "true", "false") + "}\n\n"
        "template <typename R>\nconstexpr char const* runner_name() {\n"
        + chain(all_runners, lambda n: json.dumps(n), "nullptr") + "}\n\n"
        "template <typename R>\n"
        f"std::unique_ptr<{ns}::CutlassMoeFCRunnerInterface> make_runner() {{\n"
        "  if constexpr (selected<R>()) {\n    return std::make_unique<R>();\n  } else {\n"
        "    char const* name = runner_name<R>();\n"
        "    TVM_FFI_LOG_AND_THROW(NotImplementedError)\n"
        "        << \"CUTLASS MoE runner \" << (name ? name : __PRETTY_FUNCTION__)\n"
        f"        << \" is not compiled into {module}: it is outside kernel selection {sel} (arch \"\n"
        f"        << \"{arch}); {hint}\";\n"
        "    return nullptr;\n  }\n}\n}  // namespace kimi_k3_kernel_selection\n")


def select_sources(sources: Sequence[Path], ms: Mapping[str, Any], module: str, csrc: Path,
                   gen_dir: Path) -> tuple[list[Path], dict[str, Any]]:
    """The module's sources for the selection (generated copies under gen_dir/kernel_selection/)
    and a summary for the plan. Every name the selection lists must exist in FlashInfer's lists."""
    out_dir = gen_dir / SELECTION_DIR
    runners, gemm_runners = set(ms["runners"]), set(ms["gemm_runners"])
    by_name = {p.name: p for p in sources}
    for need in (BINDING, INSTANTIATION):
        if need not in by_name:
            raise UserError(f"module {module}: no {need} among its sources; kernel selection "
                            "needs FlashInfer's CUTLASS fused-MoE module layout")
    available: dict[str, list[str]] = {"runners": [], "gemm_runners": []}
    summary: dict[str, Any] = {"name": ms["selection"], "runners": sorted(runners),
                               "gemm_runners": sorted(gemm_runners), "kernels": ms["kernels"],
                               "copied": [], "dropped": []}
    result: list[Path] = []

    def copy(orig: Path, sub: str, text: str) -> Path:
        dest = out_dir / sub / orig.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(_rebase_includes(text, orig, csrc))
        summary["copied"].append(f"{orig.relative_to(csrc).as_posix()} -> {SELECTION_DIR}/{sub}/{orig.name}")
        return dest

    for src in sources:
        if src.name == INSTANTIATION:
            text = src.read_text()
            available["runners"] += instances(text)
            text, _ = _keep_instances(text, runners, ms["selection"])
            result.append(copy(src, "cutlass_backend", text))
        elif src.name == BINDING:
            text, n = _CONSTRUCT_RE.subn(r"::kimi_k3_kernel_selection::make_runner<\1kernels::CutlassMoeFCRunner<",
                                         src.read_text())
            if n == 0 or re.search(r"(\bnew\s+|std::make_\w+<\s*)(kernels::)?CutlassMoeFCRunner<", text):
                raise UserError(f"module {module}: {BINDING} constructs CutlassMoeFCRunner in a way "
                                "tools/kernel_cache/selection.py does not know; update it")
            result.append(copy(src, "cutlass_backend", f'#include "{HEADER_NAME}"\n' + text))
        elif _GEMM_FILE.match(src.name):
            text = src.read_text()
            available["gemm_runners"] += instances(text)
            text, kept = _keep_instances(text, gemm_runners, ms["selection"])
            if kept:
                result.append(copy(src, "moe_gemm", text))
            else:
                summary["dropped"].append(src.relative_to(csrc).as_posix())
        else:
            result.append(src)
    for key, names in (("runners", runners), ("gemm_runners", gemm_runners)):
        unknown = sorted(names - set(available[key]))
        if unknown:
            raise UserError(f"selection {ms['selection']} module {module}: {key} {unknown} are not "
                            f"instantiated by FlashInfer (it has: {'; '.join(available[key])}); fix "
                            "kernel_cache/selections.json")
    header = out_dir / "cutlass_backend" / HEADER_NAME
    header.write_text(selection_header(ms, module, available["runners"]))
    return result, summary
