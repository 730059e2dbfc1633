"""The plan: per module, per object, the exact compiler argv FlashInfer's ninja file gives, with
every machine-specific absolute path replaced by a placeholder. It is checked in
(kernel_cache/plan_<arch>_<variant>.bzl, like a lock) so Bazel knows every object at analysis
time; `plan --check`, `build --plan` and gen-sources refuse a plan that drifted from the tree.

Placeholders in plan arguments:
  @TREE@       the patched tree (directory holding flashinfer/)
  @GEN@        the module's generated-sources directory (output of gen-sources)
  @CUDA_HOME@  the pinned CUDA root
  @PY_INCLUDE@ the interpreter's C include dir       @TVM_FFI@  the tvm_ffi package directory
  @INPUT@ / @OUTPUT@ / @OBJECTS@   the action's source, output, and (link) objects
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.kernel_cache.modules import check_markers, load_modules
from tools.kernel_cache.probe import run_probe
from tools.kernel_cache.selection import FULL, module_selections
from tools.kernel_cache.toolchain import Toolchain
from tools.kernel_cache.tree import check_tree, flashinfer_source_digest, log

PLAN_SCHEMA = 1
# Rough peak RSS per object (MiB), used for the memory budget and Bazel resource hints. Measured
# with nvcc 13.0 for 120f: SM120 grouped GEMM 7.6-8.6 GB, SM80 grouped GEMM 6.9 GB, SM90 GEMM
# (guarded off for 120f) 1.2 GB, small modules <= 1.2 GB; the other entries are estimates.
# For 9.x the 210 SM90 (grouped) GEMM objects are real code: 16 fused_moe_90 compiles at once
# (10 biggest-first + 6 of these) peaked at 80 GB on the H200 host, so they get 4 GB there.
_MEM_HINTS_BY_ARCH_MB: dict[str, tuple[tuple[str, int], ...]] = {
    "9": (("gemm_grouped_sm90", 4000), ("gemm_sm90", 4000)),
}
_MEM_HINTS_MB: tuple[tuple[str, int], ...] = (
    ("gemm_grouped_sm120", 9000),
    ("gemm_grouped_sm100", 9000),
    ("gemm_grouped_sm80", 7500),
    ("moe_gemm_kernels_", 4000),
    ("cutlass_fused_moe_instantiation", 4000),
    ("flashinfer_cutlass_fused_moe_binding", 3000),
)
_DEFAULT_MEM_MB = 1500

# --------------------------------------------------------------------------------------------
# Ninja parsing (FlashInfer's build description)
# --------------------------------------------------------------------------------------------

_NINJA_VAR = re.compile(r"\$(\$|:| |\{[\w-]+\}|[\w-]+)")


def _ninja_eval(value: str, scope: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        tok = m.group(1)
        if tok in ("$", ":", " "):
            return tok
        return scope.get(tok.strip("{}"), "")
    return _NINJA_VAR.sub(sub, value)


@dataclasses.dataclass
class NinjaBuild:
    outputs: list[str]
    rule: str
    inputs: list[str]
    command: str  # fully expanded


def parse_ninja(text: str) -> list[NinjaBuild]:
    """The subset of ninja that FlashInfer's generate_ninja_build_for_op writes: top-level
    variables, rules with `command`, and build statements (no nested scopes beyond that)."""
    joined = re.sub(r"\$\n[ \t]*", "", text)  # `$` at end of line continues it
    top: dict[str, str] = {}
    rules: dict[str, dict[str, str]] = {}
    builds: list[tuple[list[str], str, list[str], dict[str, str]]] = []
    current: dict[str, str] | None = None
    for raw in joined.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        indented = raw[0] in " \t"
        line = raw.strip()
        if indented:
            if current is None:
                raise UserError(f"FlashInfer ninja: indented line outside a block: {line!r}")
            k, _, v = line.partition("=")
            current[k.strip()] = v.strip()
            continue
        if line.startswith("rule "):
            current = rules.setdefault(line[5:].strip(), {})
        elif line.startswith("build "):
            outs, _, rest = line[6:].partition(":")
            parts = rest.split()
            current = {}
            builds.append((outs.split(), parts[0], parts[1:], current))
        elif line.startswith("default ") or line.startswith("ninja_required_version"):
            current = None
        else:
            k, _, v = line.partition("=")
            top[k.strip()] = _ninja_eval(v.strip(), top)
            current = None
    result = []
    for outputs, rule, ins, local in builds:
        if rule not in rules or "command" not in rules[rule]:
            raise UserError(f"FlashInfer ninja: build uses unknown rule {rule!r}")
        scope = {**top, **{k: _ninja_eval(v, top) for k, v in local.items()},
                 "in": " ".join(ins), "out": " ".join(outputs)}
        result.append(NinjaBuild(outputs, rule, ins, _ninja_eval(rules[rule]["command"], scope)))
    return result


def _drop_depfile_flags(argv: list[str]) -> list[str]:
    # Depfiles feed ninja's header tracking. Here every object already depends on the whole tree
    # (digest / Bazel inputs), and an extra .d output would be undeclared in a Bazel action.
    out: list[str] = []
    skip_next = False
    for a in argv:
        if skip_next:
            skip_next = False
        elif a in ("-MMD", "--generate-dependencies-with-compile"):
            continue
        elif a == "-MF":
            skip_next = True
        else:
            out.append(a)
    return out


def _mem_hint(obj_name: str, arch: str) -> int:
    for needle, mb in _MEM_HINTS_BY_ARCH_MB.get(arch.split(".")[0], ()) + _MEM_HINTS_MB:
        if needle in obj_name:
            return mb
    return _DEFAULT_MEM_MB


_ABS_PATH = re.compile(r"(?:^|[=,:]|^-[IL]|^-isystem)(/[^\s]*)")


def placeholderize(arg: str, replacements: Sequence[tuple[str, str]]) -> str:
    for real, ph in replacements:
        arg = arg.replace(real, ph)
    return arg


def plan_module(probe: Mapping[str, Any], mod: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """One module's plan entry from the probe's ninja text, with placeholders for host paths."""
    name = mod["name"]
    paths = probe["paths"]
    replacements = sorted([
        (mod["gen_dir"], "@GEN@"),
        (mod["build_dir"] + "/", ""),  # objects are named relative to the module
        (paths["tree"], "@TREE@"),
        (paths["cuda_home"], "@CUDA_HOME@"),
        (paths["py_include"], "@PY_INCLUDE@"),
        (paths["tvm_ffi"], "@TVM_FFI@"),
    ], key=lambda kv: -len(kv[0]))
    objects: list[dict[str, Any]] = []
    link: dict[str, Any] | None = None
    for b in parse_ninja(mod["ninja"]):
        argv = _drop_depfile_flags(shlex.split(b.command))
        if b.rule in ("compile", "cuda_compile"):
            (src,), (out,) = b.inputs, b.outputs
            argv = [{src: "@INPUT@", out: "@OUTPUT@"}.get(a, a) for a in argv]
            argv = [placeholderize(a, replacements) for a in argv]
            obj = Path(out).name
            objects.append({"out": obj, "src": placeholderize(src, replacements),
                            "kind": "cuda" if b.rule == "cuda_compile" else "cxx",
                            "mem_mb": _mem_hint(obj, arch), "args": argv})
        elif b.rule in ("link", "nvcc_link"):
            ins = set(b.inputs)
            argv = [a for a in argv if a not in ins]
            pos = argv.index(b.outputs[0])
            argv = [placeholderize(a, replacements) for a in argv]
            argv[pos] = "@OUTPUT@"
            # The objects go where FlashInfer put $in (right after the linker).
            argv[1:1] = ["@OBJECTS@"]
            link = {"kind": b.rule, "args": argv}
        else:
            raise UserError(f"FlashInfer ninja for {name}: unknown rule {b.rule!r}; update "
                            "tools/kernel_cache for this FlashInfer version")
    if link is None or not objects:
        raise UserError(f"FlashInfer ninja for {name}: no link or no objects")
    for entry in [*objects, link]:
        for a in entry["args"]:
            m = _ABS_PATH.search(a)
            if m and not m.group(1).startswith(("/usr/include", "/usr/lib")):
                raise UserError(f"module {name}: argument {a!r} keeps a host path no placeholder "
                                "covers; extend placeholderize() in tools/kernel_cache")
    names = [o["out"] for o in objects]
    if len(set(names)) != len(names):
        raise UserError(f"module {name}: two sources map to one object name; FlashInfer's own "
                        "ninja build would collide too")
    # rglob order (generated .cu files) depends on the filesystem: sort so plans and link
    # order are reproducible.
    objects.sort(key=lambda o: o["out"])
    entry = {"name": name, "generator": mod["generator"], "kwargs": mod["kwargs"],
             "gen_digest": mod["gen_digest"], "gen_files": mod["gen_files"],
             "objects": objects, "link": link}
    if "kernel_selection" in mod:  # absent for `full`: its plans keep their bytes
        entry["kernel_selection"] = mod["kernel_selection"]
    return entry


_MOE_INSTANCE = re.compile(r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(([^;]*?)\);", re.S)


def moe_instantiations(gen_dir: Path) -> list[str]:
    """The CUTLASS MoE GEMM template instantiations in a module's generated sources, one
    normalized argument string each (arch, activation type, weight type, output type, ...)."""
    found = set()
    for f in sorted(gen_dir.rglob("*.generated.cu")):
        for m in _MOE_INSTANCE.finditer(f.read_text()):
            found.add(", ".join(a.strip() for a in m.group(1).split(",")))
    return sorted(found)


# --------------------------------------------------------------------------------------------
# The plan file (Starlark), drift, module selection
# --------------------------------------------------------------------------------------------

def make_plan(tree: Path, modules_path: Path, arch: str, variant: str, tc: Toolchain,
              python: str | None = None, gen_out: Path | None = None,
              enforce_markers: bool = True, selection: str = FULL,
              selections_path: Path | None = None) -> dict[str, Any]:
    """enforce_markers=False only for comparing commands against an unpatched wheel.
    selection: a name in selections_path (default: selections.json beside modules_path);
    `full` compiles everything and adds no field, so plans made before selections stay valid."""
    tree = check_tree(tree)
    decls = [d for d in load_modules(modules_path) if d.applies_to(arch)]
    if not decls:
        raise UserError(f"--modules {modules_path}: no module applies to arch {arch}")
    # `full` needs no selections file (a modules.json elsewhere, e.g. a test's, has none beside it).
    chosen = None if selection == FULL and selections_path is None else module_selections(
        selections_path or modules_path.parent / "selections.json", selection, arch)
    unknown = sorted(set(chosen or ()) - {d.name for d in decls})
    if unknown:
        raise UserError(f"--selection {selection}: modules {unknown} are not declared for arch "
                        f"{arch} in {modules_path}")
    markers = check_markers(tree, decls) if enforce_markers else []
    log(f"probing {len(decls)} FlashInfer generators for arch {arch} ({variant}, selection "
        f"{selection})")
    probe = run_probe(tree, decls, arch, variant, tc, gen_out=gen_out, python=python,
                      selections=chosen)
    modules = [plan_module(probe, m, arch) for m in probe["modules"]]
    return {
        **({"selection": selection} if chosen is not None else {}),
        "schema_version": PLAN_SCHEMA,
        "flashinfer_version": probe["flashinfer_version"],
        "arch": arch,
        "variant": variant,
        "patched_source_digest": flashinfer_source_digest(tree),
        "nvcc_release": tc.nvcc_release,
        "source_markers": markers,
        "modules": modules,
        "object_count": sum(len(m["objects"]) for m in modules),
    }


def starlark_literal(value: Any, indent: int = 0) -> str:
    """A value as a Starlark (= Python) literal, laid out like json.dumps(indent=1, sort_keys).
    Not JSON itself: Starlark spells booleans and null True/False/None (kwargs such as
    use_fast_build are booleans). Strings use JSON escapes, which Starlark reads the same way
    for the ASCII text plans hold."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, (int, str)):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {starlark_literal(v, indent + 1)}"
                 for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        items = [f"{inner}{starlark_literal(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    raise TypeError(f"plan value of type {type(value).__name__} has no Starlark literal")


def render_plan(plan: Mapping[str, Any]) -> str:
    # One file for both sides: Bazel loads it (objects known at analysis time), the tool reads
    # it back with ast.literal_eval (Starlark's literal subset is Python's).
    body = starlark_literal(plan)
    return ("# Generated by `python3 -m tools.kernel_cache plan`; do not edit. "
            "Checked in like a lock:\n"
            "# a CPU test regenerates it from the patched tree and fails on any drift.\n"
            f"KERNEL_CACHE_PLAN = {body}\n")


def read_plan(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"--plan {path}: cannot read ({e}); generate it with "
                        "`python3 -m tools.kernel_cache plan`") from None
    _, sep, body = text.partition("KERNEL_CACHE_PLAN = ")
    try:
        plan = ast.literal_eval(body) if sep else None
    except (ValueError, SyntaxError):
        plan = None
    if not isinstance(plan, dict) or plan.get("schema_version") != PLAN_SCHEMA:
        raise UserError(f"--plan {path}: not a kernel cache plan (schema {PLAN_SCHEMA}); "
                        "regenerate it with `python3 -m tools.kernel_cache plan`")
    return plan


def describe_drift(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """First difference between two plans, named by module/object/field, or None."""
    for key in ("flashinfer_version", "arch", "variant", "selection", "patched_source_digest",
                "nvcc_release"):
        if old.get(key) != new.get(key):
            return f"{key}: checked in {old.get(key)!r}, generated {new.get(key)!r}"
    om = {m["name"]: m for m in old["modules"]}
    nm = {m["name"]: m for m in new["modules"]}
    if sorted(om) != sorted(nm):
        return f"modules: checked in {sorted(om)}, generated {sorted(nm)}"
    for name in sorted(nm):
        a, b = om[name], nm[name]
        if a["gen_digest"] != b["gen_digest"]:
            return f"module {name}: generated sources differ (gen_digest)"
        ao = {o["out"]: o for o in a["objects"]}
        bo = {o["out"]: o for o in b["objects"]}
        if sorted(ao) != sorted(bo):
            return (f"module {name}: objects differ: only checked in "
                    f"{sorted(set(ao) - set(bo))[:3]}, only generated {sorted(set(bo) - set(ao))[:3]}")
        for out in sorted(bo):
            if ao[out] != bo[out]:
                diff = [x for x in bo[out]["args"] if x not in ao[out]["args"]] or \
                    [x for x in ao[out]["args"] if x not in bo[out]["args"]]
                return f"module {name} object {out}: command differs (e.g. {diff[:2]})"
        if a["link"] != b["link"]:
            return f"module {name}: link command differs"
        if a.get("kernel_selection") != b.get("kernel_selection"):
            return f"module {name}: kernel selection differs"
    return None if old == new else "plan differs outside modules"


def parse_only(values: Sequence[str]) -> list[str]:
    """--only may repeat and each value may be comma separated (the Bazel flag's form)."""
    return sorted({n.strip() for v in values for n in v.split(",") if n.strip()})


def select_modules(plan: dict[str, Any], only: Sequence[str]) -> dict[str, Any]:
    """The plan restricted to `only` (all modules when empty); unknown names are an error, so a
    typo never silently builds nothing."""
    names = parse_only(only)
    if not names:
        return plan
    known = [m["name"] for m in plan["modules"]]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"--only {','.join(unknown)}: not in the plan for arch {plan['arch']} "
                        f"(modules: {','.join(known)}); fix the name")
    return dict(plan, modules=[m for m in plan["modules"] if m["name"] in names],
                object_count=sum(len(m["objects"]) for m in plan["modules"] if m["name"] in names))


def find_module(plan: Mapping[str, Any], name: str) -> dict[str, Any]:
    for m in plan["modules"]:
        if m["name"] == name:
            return m
    raise UserError(f"--module {name}: not in the plan (has {[m['name'] for m in plan['modules']]})")
