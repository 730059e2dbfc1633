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
     generated header, which constructs R only when it is selected and otherwise throws TVM
     FFI's NotImplementedError kind naming R and the selection (Python sees a RuntimeError:
     tvm-ffi registers no Python class for that kind). An unselected runner is then never
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
from tools.common.jsondata import ANY, TEXT, Enum, MapOf, Object, json_path, load_json_file

SELECTIONS_SCHEMA = 1
# The selection that changes nothing: FlashInfer's own source lists, as before selections.
FULL = "full"
# Where generated copies go inside a module's generated-sources directory.
SELECTION_DIR = "kernel_selection"
HEADER_NAME = "kimi_k3_kernel_selection.h"
_KERNEL_KEYS = {"kind", "arch", "act", "weight", "out"}
# Optional per kernel entry: "tiles" (keep only these CTA / cluster shapes, stub the rest) and a "why".
_KERNEL_OPTIONAL = {"tiles", "why"}
# Unselected tiles of a kept dtype pair get throwing definitions here (gen dir relative).
STUBS_SOURCE = f"{SELECTION_DIR}/stubs/unselected_tiles.cu"
# FlashInfer's explicit instantiation of an SM90 mixed-input grouped launcher (generate_kernels.py
# instantiate_operation_tma_warp_specialized): "template void NAME<ARGS> (PARAMS);".
_MIXED_INSTANTIATION_RE = re.compile(
    r"^\s*template\s+void\s+(sm90_generic_mixed_moe_\w*kernelLauncher)\s*<(.*)>\s*\((.*)\)\s*;\s*$",
    re.S)
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")


# --------------------------------------------------------------------------------------------
# selections.json
# --------------------------------------------------------------------------------------------

# kernel_cache/selections.json down to each module's selection, which _check_module_selection
# checks with what FlashInfer's names look like.
SELECTIONS_FILE = Object({
    "schema_version": Enum(SELECTIONS_SCHEMA),
    "selections": MapOf(Object({}, optional={"arch": TEXT, "description": TEXT, "modules": MapOf(ANY)})),
}, optional={"description": TEXT, "default_for_arch": MapOf(TEXT)})


def load_selections(path: Path) -> dict[str, Any]:
    """The validated file: {"selections": {name: {...}}, "default_for_arch": {arch: name}}.
    Everything that can be wrong without FlashInfer is refused here, one line naming the entry
    and the fix: a key, runner, GEMM runner, dtype pair or tile given twice (a second copy would
    be shadowed by the first, or make the plan's generated sources unreproducible), tiles on a
    kernel that cannot take them. Names FlashInfer does not have are refused by the probe."""
    data = load_json_file(path, "--selections", SELECTIONS_FILE)
    sels = data["selections"]
    if FULL not in sels:
        raise UserError(f"--selections {path}: $.selections: the '{FULL}' selection (everything) is missing")
    for name, sel in sels.items():
        where = f"--selections {path}: {json_path(['selections', name])}"
        if not _NAME_RE.match(name):
            raise UserError(f"{where}: names are lower-case words with '-'")
        if name == FULL:
            if sel.get("modules"):
                raise UserError(f"{where}: '{FULL}' filters nothing; it takes no 'modules'")
            continue
        if "arch" not in sel or "modules" not in sel:
            raise UserError(f"{where}: needs 'arch' (e.g. 12.0f) and 'modules'")
        for mod, ms in sel["modules"].items():
            _check_module_selection(f"{where}.modules.{mod}", ms)
    for arch, name in data.get("default_for_arch", {}).items():
        if name not in sels or (name != FULL and sels[name]["arch"] != arch):
            raise UserError(f"--selections {path}: {json_path(['default_for_arch', arch])}: {name!r} is not a "
                            f"selection for arch {arch}")
    return data


def _first_repeat(items: Sequence[Any]) -> tuple[int, int] | None:
    """(first index, repeat index) of the first item that occurs twice, else None."""
    for j, item in enumerate(items):
        if item in items[:j]:
            return items.index(item), j
    return None


def _check_module_selection(where: str, ms: Any) -> None:
    if not isinstance(ms, dict) or set(ms) - {"why", "runners", "gemm_runners", "kernels"}:
        raise UserError(f"{where}: expected an object with runners, gemm_runners, kernels (and why)")
    for key, prefix in (("runners", "CutlassMoeFCRunner<"), ("gemm_runners", "MoeGemmRunner<")):
        names = ms.get(key, [])
        if not isinstance(names, list) or not all(
                isinstance(n, str) and n.startswith(prefix) and n.endswith(">") for n in names):
            raise UserError(f"{where}.{key}: a list of '{prefix}...>' as FlashInfer's explicit "
                            "instantiations spell them")
        repeat = _first_repeat(names)
        if repeat:
            raise UserError(f"{where}.{key}[{repeat[1]}]: {names[repeat[1]]} is listed twice "
                            f"(also {key}[{repeat[0]}]); remove one")
    kernels = ms.get("kernels", [])
    if not isinstance(kernels, list):
        raise UserError(f"{where}.kernels: a list of {{kind, arch, act, weight, out}} objects")
    for i, k in enumerate(kernels):
        if not isinstance(k, dict) or not _KERNEL_KEYS <= set(k) <= _KERNEL_KEYS | _KERNEL_OPTIONAL \
                or k["kind"] not in ("grouped", "gemm") or not isinstance(k["arch"], int) \
                or not all(isinstance(k[x], str) for x in ("act", "weight", "out")):
            raise UserError(f"{where}.kernels[{i}]: expected {{kind: grouped|gemm, arch: int, act, "
                            "weight, out} with FlashInfer's type names (bf16, f16, e4m3, e2m1, ...), "
                            "optionally tiles and why")
        if "tiles" in k:
            tiles = k["tiles"]
            if not isinstance(tiles, list) or not tiles or not all(
                    isinstance(t, dict) and set(t) == {"cta", "cluster"}
                    and all(isinstance(t[x], list) and len(t[x]) == 3
                            and all(isinstance(v, int) for v in t[x]) for x in ("cta", "cluster"))
                    for t in tiles):
                raise UserError(f"{where}.kernels[{i}].tiles: a non-empty list of "
                                "{\"cta\": [m, n, k], \"cluster\": [x, y, z]}")
            if not _is_sm90_mixed(k):
                raise UserError(f"{where}.kernels[{i}].tiles: tile sets are supported for the SM90 "
                                "mixed-input grouped kernels only (kind grouped, arch 90, act other "
                                "than weight: their launchers are plain function templates a stub "
                                "can define); drop 'tiles' there")
            repeat = _first_repeat(tiles)
            if repeat:
                raise UserError(f"{where}.kernels[{i}].tiles[{repeat[1]}]: "
                                f"{json.dumps(tiles[repeat[1]])} is listed twice (also "
                                f"tiles[{repeat[0]}]); remove one")
    # One entry per dtype pair: the filter gives each operation to the first entry it matches,
    # so a second entry would match nothing.
    repeat = _first_repeat([{x: k[x] for x in _KERNEL_KEYS} for k in kernels])
    if repeat:
        i, j = repeat
        raise UserError(f"{where}.kernels[{j}]: the same kind, arch, act, weight and out as "
                        f"kernels[{i}] ({_describe_kernel(kernels[j])}); keep one entry per dtype "
                        "pair (with tiles: all of them in that entry)")


def _describe_kernel(k: Mapping[str, Any]) -> str:
    return f"{k['kind']} sm{k['arch']} {k['act']} x {k['weight']} -> {k['out']}"


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
                  "kernels": [{k: v for k, v in entry.items() if k != "why"}
                              for entry in ms.get("kernels", [])]}
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


def tile_key(op: Any) -> dict[str, list[int]]:
    """An operation's CTA and cluster shape as a selection's "tiles" spell them."""
    return {"cta": [int(v) for v in op.cta_shape],
            "cluster": [int(v) for v in getattr(op, "cga_shape", (1, 1, 1))]}


def _is_sm90_mixed(key: Mapping[str, Any]) -> bool:
    return key["kind"] == "grouped" and key["arch"] == 90 and key["act"] != key["weight"]


@contextlib.contextmanager
def kernel_filter(ms: Mapping[str, Any], module: str) -> Iterator[dict[str, Any]]:
    """While active, FlashInfer's generate_sm*_operations return only selected operations, so its
    own grouping and file writer emit the selected kernels only. An entry with "tiles" keeps
    only those CTA / cluster shapes of its dtype pair; the dispatch still takes the address of
    every other tile's launcher, so those become stubs (select_sources writes them) that throw
    naming the tile and the selection. Yields counts for the plan (and the stubs under "_stubs").
    load_selections has refused repeated dtype pairs, so each operation matches one entry."""
    from flashinfer.jit.gemm.cutlass import generate_kernels as gk

    entry = f"selections.{ms['selection']}.modules.{module}.kernels"
    wanted = [{k: v for k, v in e.items() if k != "tiles"} for e in ms["kernels"]]
    tiles = [e.get("tiles") for e in ms["kernels"]]
    hits = [0] * len(wanted)
    tile_hits: list[set[int]] = [set() for _ in wanted]
    stats: dict[str, Any] = {"operations": 0, "selected": 0}
    stubs: list[dict[str, Any]] = []
    mixed_includes: list[list[str]] = []
    originals = {n: f for n, f in vars(gk).items()
                 if re.fullmatch(r"generate_sm\d+_operations", n) and callable(f)}
    if not originals:
        raise UserError("flashinfer.jit.gemm.cutlass.generate_kernels has no generate_sm*_operations:"
                        " update tools/kernel_cache/selection.py for this FlashInfer version")
    original_write = gk.write_file

    def wrap(fn: Any) -> Any:
        def filtered(*args: Any, **kwargs: Any) -> list[Any]:
            kept = []
            for op in fn(*args, **kwargs):
                stats["operations"] += 1
                key = operation_key(op, gk)
                for i, w in enumerate(wanted):
                    if w != key:
                        continue
                    hits[i] += 1
                    tile = tile_key(op)
                    if tiles[i] is None or tile in tiles[i]:
                        if tiles[i] is not None:
                            tile_hits[i].add(tiles[i].index(tile))
                        kept.append(op)
                    else:  # an SM90 mixed-input kernel: load_selections refuses tiles elsewhere
                        stubs.append({"entry": i, "tile": tile,
                                      "instantiation": gk.instantiate_operation(op)})
                    break
            stats["selected"] += len(kept)
            return kept
        return filtered

    def write_file(launcher_inl_files: Any, operations: Any, output_file: Any) -> Any:
        # The includes FlashInfer gives its mixed-input files are the stubs' includes too.
        if "_Mixed_" in str(output_file) and not mixed_includes:
            mixed_includes.append([str(f) for f in launcher_inl_files])
        return original_write(launcher_inl_files, operations, output_file)

    for n, f in originals.items():
        setattr(gk, n, wrap(f))
    gk.write_file = write_file
    try:
        yield stats
    finally:
        for n, f in originals.items():
            setattr(gk, n, f)
        gk.write_file = original_write
    unmatched = [f"{entry}[{i}] ({_describe_kernel(w)})" for i, (w, h) in enumerate(zip(wanted, hits))
                 if not h]
    if unmatched:
        one = len(unmatched) == 1
        raise UserError(f"{'; '.join(unmatched)}: {'matches' if one else 'match'} no operation "
                        f"FlashInfer generates for arch {ms['arch']}; fix or drop "
                        f"{'it' if one else 'them'} in kernel_cache/selections.json (FlashInfer's "
                        "type names: bf16, f16, e4m3, e2m1, ...)")
    for i, t in enumerate(tiles):
        missing = [x for j, x in enumerate(t or []) if j not in tile_hits[i]]
        if missing:
            raise UserError(f"{entry}[{i}] ({_describe_kernel(wanted[i])}): tiles "
                            f"{json.dumps(missing)} match no operation FlashInfer generates for "
                            "that dtype pair; fix or drop them in kernel_cache/selections.json")
    if stubs:
        if not mixed_includes:
            raise UserError(f"selection {ms['selection']}: FlashInfer wrote no mixed-input file to "
                            "take the stubs' includes from; update tools/kernel_cache/selection.py")
        stats["stubbed"] = len(stubs)
        stats["_stubs"] = {"includes": mixed_includes[0], "stubs": stubs}


def stubs_source(ms: Mapping[str, Any], module: str, stubs: Mapping[str, Any]) -> str:
    """Definitions for the unselected tiles' launchers: explicit specializations (the same
    symbols FlashInfer's explicit instantiations would define) whose body throws TVM FFI's
    NotImplementedError kind (a RuntimeError in Python) naming the kernel, its tile and where to
    select it. Only declarations are needed, but the launcher's .inl brings every type the
    template arguments name."""
    sel, arch = ms["selection"], ms["arch"]
    lines = [f"// Generated by tools/kernel_cache (kernel selection {sel}, arch {arch}); do not edit.",
             "// Launchers of tiles outside the selection: they exist (the dispatch takes their",
             "// address) and throw when called.", "#include <tvm/ffi/error.h>"]
    lines += [f'#include "{inc}"' for inc in stubs["includes"]]
    lines += ["", "namespace tensorrt_llm {", "namespace kernels {", "namespace cutlass_kernels_oss {", ""]
    for stub in stubs["stubs"]:
        m = _MIXED_INSTANTIATION_RE.match(stub["instantiation"])
        if not m:
            raise UserError(f"module {module}: FlashInfer's mixed-input instantiation "
                            f"{stub['instantiation'].strip()[:120]!r} has a form "
                            "tools/kernel_cache/selection.py does not know; update it")
        name, args, params = m.group(1), " ".join(m.group(2).split()), " ".join(m.group(3).split())
        cta, cluster = ("x".join(map(str, stub["tile"][k])) for k in ("cta", "cluster"))
        tile_json = json.dumps(stub["tile"], separators=(", ", ": "))
        message = (f"CUTLASS kernel {name} (CTA {cta}, cluster {cluster}) is not compiled into "
                   f"{module}: its tile is outside kernel selection {sel} (arch {arch}); add "
                   f"{tile_json} to selections.{sel}.modules.{module}.kernels[{stub['entry']}].tiles "
                   "in kernel_cache/selections.json, regenerate the plan and rebuild the kernel cache")
        lines += [f"template <>\nvoid {name}<{args}>(\n    {params}) {{",
                  f"  TVM_FFI_LOG_AND_THROW(NotImplementedError) << {json.dumps(message)};", "}", ""]
    lines += ["}  // namespace cutlass_kernels_oss", "}  // namespace kernels",
              "}  // namespace tensorrt_llm", ""]
    return "\n".join(lines)


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
    """make_runner<R>(): R when selected, else TVM FFI's NotImplementedError kind (a RuntimeError
    in Python) naming R and the selection.
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
                   gen_dir: Path, stubs: Mapping[str, Any] | None = None
                   ) -> tuple[list[Path], dict[str, Any]]:
    """The module's sources for the selection (generated copies under gen_dir/kernel_selection/,
    plus the unselected tiles' stubs kernel_filter collected) and a summary for the plan. Every
    name the selection lists must exist in FlashInfer's lists."""
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
            raise UserError(f"selections.{ms['selection']}.modules.{module}: {key} {unknown} are "
                            f"not instantiated by FlashInfer (it has: {'; '.join(available[key])}); "
                            "fix the spelling in kernel_cache/selections.json")
    header = out_dir / "cutlass_backend" / HEADER_NAME
    header.write_text(selection_header(ms, module, available["runners"]))
    if stubs:
        stub_file = gen_dir / STUBS_SOURCE
        stub_file.parent.mkdir(parents=True, exist_ok=True)
        stub_file.write_text(stubs_source(ms, module, stubs))
        result.append(stub_file)
        summary["stubbed_tiles"] = sorted({json.dumps(s["tile"]) for s in stubs["stubs"]})
    return result, summary
