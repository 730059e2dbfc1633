"""One stack's inventory: every compile site of its SGLang tree, which launch profiles reach it,
and whether the image ships it built (`prebuilt`) or serving compiles it at first use (`gap`).

Inputs (all data, read here, never imported): the SGLang tree, the launch profiles
(image/profiles/*.json), jit_cache/reach.json (roots, pruning, the settings SGLang resolves that
a profile leaves unset, FlashInfer APIs -> kernel-cache modules), jit_cache/checkpoint_facts.json,
image/backend_needs.json (FlashInfer modules a profile's settings need) and the stack's
kernel-cache plan (the FlashInfer modules the image ships built).
"""
from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.jsondata import ANY, TEXT, Enum, ListOf, MapOf, Object, check_json, load_json_file
from tools.jit_cache import reach as reach_mod
from tools.jit_cache.sites import KINDS, Site, dotted, scan_module
from tools.jit_cache.tree import SourceTree
from tools.jit_cache.triton_aot import kernel_sites

SCHEMA_VERSION = 1
PREBUILT, GAP = "prebuilt", "gap"


# Triton's driver module (tools/jit_cache/triton_aot.py build_driver_module): a site of Triton, not
# of SGLang's tree, reached with any Triton kernel.
TRITON_DRIVER_FILE = "triton/backends/nvidia/driver.c"
TRITON_DRIVER_SITE = f"triton:{TRITON_DRIVER_FILE}:cuda_utils"


# The inputs' types. jit_cache/reach.json and checkpoint_facts.json are this stage's own files:
# every field. Of a launch profile (image/profiles/*.json) and image/backend_needs.json, the
# fields read here; `python3 -m tools.image.profiles validate` checks the whole of those files.
REACH = Object({
    "schema_version": Enum(1),
    "entry_modules": ListOf(TEXT),
    "models_dir": TEXT,
    "pruning": Object({"other_platform_predicates": ListOf(TEXT), "cuda_predicates": ListOf(TEXT),
                       "other_platform_modules": ListOf(TEXT)}, optional={"why": TEXT}),
    "registries": MapOf(Object({"settings": ListOf(TEXT)}, optional={"why": TEXT})),
    "architectures": MapOf(Object({}, optional={
        "resolved_settings": MapOf(Object({"value": ANY}, optional={"why": TEXT}))})),
    "setting_roots": MapOf(MapOf(Object({"modules": ListOf(TEXT)}, optional={"why": TEXT}))),
    "specialization_settings": ListOf(TEXT),
    "flashinfer_apis": MapOf(TEXT),
}, optional={"description": TEXT, "entry_why": TEXT, "models_why": TEXT, "flashinfer_apis_why": TEXT})
CHECKPOINT_FACT_SCHEMA = Object({
    "schema_version": Enum(1),
    "architectures": MapOf(Object({"facts": MapOf(Object({"value": ANY, "source": TEXT}))})),
}, optional={"description": TEXT})
LAUNCH_PROFILE_READ = Object({
    "checkpoint": Object({"config": Object({"architectures": ListOf(TEXT, non_empty=True)}, other=ANY)}, other=ANY),
    "args": ListOf(TEXT),
}, other=ANY)
_NEEDS_ENTRY_READ = Object({}, optional={"modules": MapOf(ANY)}, other=ANY)
BACKEND_NEEDS_READ = Object({}, optional={"architectures": MapOf(_NEEDS_ENTRY_READ),
                                          "settings": MapOf(MapOf(_NEEDS_ENTRY_READ))}, other=ANY)
INVENTORY = Object({
    "schema_version": Enum(SCHEMA_VERSION),
    "sites": MapOf(Object({"status": Enum(PREBUILT, GAP), "reason": TEXT}, other=ANY)),
    "unreached": ListOf(TEXT),
}, other=ANY)
REGENERATE = "regenerate it with `tools/bazel run //jit_cache:update_inventory`"


def read_inventory(path: Path, what: str) -> dict[str, Any]:
    """An inventory file, read and validated (one line naming the file and the fix otherwise)."""
    return load_json_file(path, what, INVENTORY, REGENERATE)


@dataclass
class Profile:
    name: str
    architecture: str
    settings: dict[str, Any]  # ServerArgs field -> value given on the command line (True for a flag)


def parse_args(args: list[str]) -> dict[str, Any]:
    """`--tp-size 32 --trust-remote-code` -> {"tp_size": "32", "trust_remote_code": True}."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            if sep:
                out[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[key] = args[i + 1]
                i += 1
            else:
                out[key] = True
        i += 1
    return out


def load_profiles(directory: Path) -> list[Profile]:
    paths = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not paths:
        raise UserError(f"--profiles {directory}: no launch profiles (*.json) there; pass image/profiles")
    profiles = []
    for path in paths:
        data = load_json_file(path, "launch profile", LAUNCH_PROFILE_READ, "fix the profile")
        archs = data["checkpoint"]["config"]["architectures"]
        if len(archs) != 1:
            raise UserError(f"launch profile {path}: $.checkpoint.config.architectures must name one architecture; "
                            "fix the profile")
        profiles.append(Profile(name=path.stem, architecture=archs[0], settings=parse_args(data["args"])))
    return profiles


def model_modules(tree: SourceTree, models_dir: str) -> dict[str, str]:
    """Architecture -> module name, from each model module's `EntryClass = X` / `[X, Y]` (what
    SGLang's model registry reads after importing every module of the directory)."""
    out: dict[str, str] = {}
    prefix = models_dir.rstrip("/") + "/"
    for rel in tree.files:
        if not rel.startswith(prefix) or b"EntryClass" not in tree.source(rel):
            continue
        for node in tree.parse(rel).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                for v in values:
                    name = dotted(v)
                    if name:
                        out.setdefault(name.rsplit(".", 1)[-1], reach_mod.module_name(rel) or rel)
    return out


def _resolved_settings(profile: Profile, reach: Mapping[str, Any]) -> dict[str, Any]:
    """The profile's settings, plus what reach.json says SGLang resolves for the ones it leaves unset."""
    arch = reach["architectures"].get(profile.architecture)
    if arch is None:
        raise UserError(f"launch profile {profile.name}: architecture {profile.architecture} is not in "
                        f"jit_cache/reach.json 'architectures'; add it (the settings SGLang resolves for it)")
    settings = dict(profile.settings)
    for key, entry in arch.get("resolved_settings", {}).items():
        settings.setdefault(key, entry["value"])
    return settings


def _kernel_cache_modules(profile_settings: Mapping[str, Any], architecture: str, needs: Mapping[str, Any]) -> dict[str, str]:
    """FlashInfer modules image/backend_needs.json says this profile needs -> why."""
    out: dict[str, str] = {}
    for name in needs.get("architectures", {}).get(architecture, {}).get("modules", {}):
        out[name] = f"architecture {architecture}"
    for setting, values in needs.get("settings", {}).items():
        value = profile_settings.get(setting)
        if isinstance(value, str) and value in values:
            for name in values[value].get("modules", {}):
                out.setdefault(name, f"{setting}={value}")
    return out


def _specializations(profile: Profile, settings: Mapping[str, Any], reach: Mapping[str, Any],
                     facts: Mapping[str, Any]) -> dict[str, Any]:
    """What the profile fixes (or leaves to SGLang) that compiled kernels specialize on."""
    out: dict[str, Any] = {}
    for key in reach["specialization_settings"]:
        value = settings.get(key)
        if value is None:
            out[key] = {"value": None, "why": "not set by the profile: SGLang's default at startup"}
        elif isinstance(value, str) and value.startswith("${"):
            out[key] = {"value": None, "why": f"placeholder {value}, filled at launch"}
        else:
            how = "profile" if key in profile.settings else "jit_cache/reach.json resolved_settings"
            out[key] = {"value": int(value) if isinstance(value, str) and value.isdigit() else value, "from": how}
    out["checkpoint"] = facts.get(profile.architecture, {}).get("facts", {})
    return out


def _reason(site: Site, shipped: Mapping[str, str], plan_name: str, apis: Mapping[str, str],
            aot: Mapping[tuple[str, str], list[dict[str, Any]]],
            triton_aot: Mapping[tuple[str, str], list[dict[str, Any]]] = {}) -> tuple[str, str, list[dict[str, Any]]]:
    """(status, reason, what the image holds for a prebuilt site: the launch-profile check looks
    each entry up in the image; empty for a gap)."""
    d = site.details
    # Every gap says where serving compiles it and what a user can do about it: the cache to keep
    # on a persistent volume (SGLang points Triton's and inductor's under $SGLANG_CACHE_DIR when
    # it is imported), or the file that builds it ahead of time.
    keep = "; keep {} on a persistent volume so only the first start pays, or warm up with a request before serving"
    if site.kind == "flashinfer":
        module = d.get("kernel_cache_module") or apis.get(site.name)
        if module and module in shipped:
            return PREBUILT, f"FlashInfer module {module} is in the kernel cache ({plan_name})", [{"module": module}]
        if module:
            return GAP, (f"needs FlashInfer module {module}, which {plan_name} does not build (FLASHINFER_DISABLE_JIT=1: "
                         "MissingJITCacheError); add it to kernel_cache/modules.json and the kernel selection "
                         "(kernel_cache/README.md 'How to extend it')"), []
        return GAP, ("FlashInfer API not mapped to a kernel-cache module in jit_cache/reach.json: whether it "
                     "JIT-compiles (a JIT module, or its CuTe-DSL disk cache) is not determined; map it in "
                     "reach.json flashinfer_apis"), []
    if site.kind == "sglang-jit":
        if (site.file, site.name) in aot:
            args = "; ".join(json.dumps(b["args"], sort_keys=True) for b in aot[(site.file, site.name)])
            return PREBUILT, (f"SGLang JIT module built ahead of time for args {args} (jit_cache/sglang_modules.json) "
                              "and shipped by //image:layer_sglang_jit in SGLang's cache layout, which the "
                              "entrypoint links into $SGLANG_JIT_CACHE_DIR; other args compile at first call"), \
                list(aot[(site.file, site.name)])
        return GAP, ("load_jit compiles it into $SGLANG_JIT_CACHE_DIR at first call: add the call and its args to "
                     "jit_cache/sglang_modules.json to build it ahead of time" + keep.format("$SGLANG_JIT_CACHE_DIR")), []
    if site.kind == "triton":
        tune = d.get("autotune")
        cache = "$TRITON_CACHE_DIR (SGLang: $SGLANG_CACHE_DIR/triton)"
        if d.get("use") == "triton-driver":
            return PREBUILT, ("Triton's driver module, built ahead of time from the image's Triton with the pinned "
                              "gcc-12 and Python headers and keyed as the image's Triton keys it (its paths, "
                              "TRITON_LIBCUDA_PATH) by //jit_cache:triton_12_0; shipped by //image:layer_triton, "
                              "which the entrypoint links into " + cache + " (the image has no C compiler to "
                              "build it)"), [{"module": "cuda_utils"}]
        if (site.file, site.name) in triton_aot:
            calls = "; ".join(f"{c['call']} {json.dumps(c['args'], sort_keys=True)}" for c in triton_aot[(site.file, site.name)])
            return PREBUILT, (f"compiled ahead of time for SM120 through Triton's launch path by the calls {calls} "
                              "(jit_cache/triton_calls.json; every config of an autotuned kernel) and shipped by "
                              "//image:layer_triton, which the entrypoint binds into " + cache +
                              "; other specializations compile at first launch"), list(triton_aot[(site.file, site.name)])
        if tune:
            n = tune.get("configs")
            count = f"{n} configs" if n is not None else "configs not countable statically"
            return GAP, (f"autotuned ({count}, key {tune.get('key')}): every config compiled and benchmarked on the "
                         "device at first launch; no ahead-of-time build yet" + keep.format(cache)), []
        return GAP, ("Triton compiles it at first launch per specialization; no ahead-of-time build yet"
                     + keep.format(cache)), []
    if site.kind == "cute-dsl":
        if d.get("use") == "aot-cache":
            # CuTe-DSL itself compiles for sm_120a without a GPU (CUTE_DSL_ARCH=sm_120a) and this
            # cache stores and loads entries without one: what is missing is each entry's key.
            return GAP, ("SGLang's CuTe-DSL AOT cache ships empty: each entry's key holds the call's device "
                         "capability, dtypes, shapes and strides, and the cache's fingerprint the target arch "
                         "(CUTE_DSL_ARCH, else sm_<major><minor> from torch), known once a GPU run records the "
                         "calls; filled at first compile"
                         + keep.format("$SGLANG_CUTE_AOT_CACHE_DIR (default $SGLANG_CACHE_DIR/cute_aot)")), []
        return GAP, ("cute.compile at first call in each serving process, kept in that process only (no disk "
                     "cache to ship it in); warm up with a request before serving"), []
    if site.kind == "inductor":
        return GAP, ("torch.compile traces and compiles at first call; its inductor kernels cannot be enumerated "
                     "statically" + keep.format("$TORCHINDUCTOR_CACHE_DIR (SGLang: $SGLANG_CACHE_DIR/inductor)")), []
    raise AssertionError(site.kind)


def _pruning(reach: Mapping[str, Any], settings: Mapping[str, Any]) -> reach_mod.Pruning:
    registries = {}
    for decorator, entry in reach["registries"].items():
        registries[decorator] = frozenset(str(settings[s]) for s in entry["settings"] if isinstance(settings.get(s), str))
    pruning = reach["pruning"]
    return reach_mod.Pruning(frozenset(pruning["other_platform_predicates"]), frozenset(pruning["cuda_predicates"]),
                             tuple(pruning["other_platform_modules"]), registries)


def validate_reach(reach: Any, where: str) -> None:
    check_json(reach, REACH, where)


def build_inventory(stack: str, tree: SourceTree, profiles: list[Profile], reach: Mapping[str, Any],
                    facts: Mapping[str, Any], needs: Mapping[str, Any], plan: Mapping[str, Any],
                    plan_name: str, aot_modules: Sequence[Mapping[str, Any]] = (),
                    triton_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    validate_reach(reach, "jit_cache/reach.json")
    modules = tree.modules
    archs = model_modules(tree, reach["models_dir"])
    shipped = {m if isinstance(m, str) else m["name"]: plan_name for m in plan.get("modules", [])}
    apis = reach["flashinfer_apis"]
    # SGLang JIT modules built ahead of time (jit_cache/sglang_modules.json): (file, function) ->
    # the builds, each {"call", "args"} as the image's manifest records them (the profile check
    # looks them up there).
    aot: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for entry in aot_modules:
        module, _, function = entry["call"].partition(":")
        aot.setdefault((module.replace(".", "/") + ".py", function), []).append(
            {"call": entry["call"], "args": entry.get("args", [])})

    # Triton kernels built ahead of time (jit_cache/triton_calls.json): (file, function) -> the
    # calls that run them, each {"call", "args"} (the launch-profile check looks them up).
    triton_aot = kernel_sites(triton_calls)

    # Every site of the tree (the check's "gains a site" compares these ids).
    sites: dict[str, Site] = {}
    for rel in sorted(tree.files):
        if tree.may_hold_sites(rel):
            for site in scan_module(rel, tree.parse(rel)):
                sites[site.id] = site
    module_of = {rel: reach_mod.module_name(rel) for rel in tree.files}

    imports_memo: dict[tuple, list[tuple[str, tuple[str, ...]]]] = {}  # shared by every profile's closures
    reached_by: dict[str, list[str]] = {}
    startup_sites: set[str] = set()  # in a module importing the roots loads (no function run)
    profile_out: dict[str, Any] = {}
    for profile in profiles:
        settings = _resolved_settings(profile, reach)
        model = archs.get(profile.architecture)
        if model is None:
            raise UserError(f"launch profile {profile.name}: architecture {profile.architecture} has no model "
                            f"module in {reach['models_dir']} of stack {stack} (no EntryClass names it); fix the "
                            f"profile's checkpoint.config.architectures")
        roots = list(reach["entry_modules"]) + [model]
        for setting, values in reach["setting_roots"].items():
            value = settings.get(setting)
            if isinstance(value, str) and value in values:
                roots.extend(values[value]["modules"])
        missing = [r for r in roots if r not in modules]
        if missing:
            raise UserError(f"jit_cache/reach.json: root module {missing[0]} (profile {profile.name}) is not in "
                            f"stack {stack}'s SGLang tree; update reach.json for this SGLang")
        pruning = _pruning(reach, settings)
        reached = reach_mod.closure(roots, modules, tree.parse, pruning, memo=imports_memo)
        startup = reach_mod.closure(roots, modules, tree.parse, pruning, lazy=False, memo=imports_memo)
        for site_id, site in sites.items():
            module = module_of.get(site.file)
            if module in reached:
                reached_by.setdefault(site_id, []).append(profile.name)
            if module in startup:
                startup_sites.add(site_id)
        for module, why in _kernel_cache_modules(settings, profile.architecture, needs).items():
            site = Site(kind="flashinfer", file="image/backend_needs.json", name=module,
                        details={"kernel_cache_module": module, "needed_by": why})
            site.id = f"flashinfer:kernel_cache:{module}"
            sites.setdefault(site.id, site)
            reached_by.setdefault(site.id, []).append(profile.name)
            startup_sites.add(site.id)
        profile_out[profile.name] = {
            "architecture": profile.architecture,
            "model_module": model,
            "roots": sorted(set(roots)),
            "reached_modules": len(reached),
            "startup_modules": len(startup),
            "specializations": _specializations(profile, settings, reach, facts),
        }

    # Triton's own driver module: Triton builds it with the host's C compiler at the first launch
    # of any kernel, so every profile that reaches a Triton site reaches it.
    triton_reached = {sid for sid in reached_by if sites[sid].kind == "triton"}
    if triton_reached:
        site = Site(kind="triton", file=TRITON_DRIVER_FILE, name="cuda_utils",
                    details={"use": "triton-driver", "built": "at the first launch of any Triton kernel, "
                             "by Triton's CudaUtils with the host's C compiler and Python headers"})
        site.id = TRITON_DRIVER_SITE
        sites[site.id] = site
        reached_by[site.id] = sorted({p for sid in triton_reached for p in reached_by[sid]})
        if triton_reached & startup_sites:
            startup_sites.add(site.id)

    reached_sites: dict[str, Any] = {}
    counts: dict[str, dict[str, int]] = {k: {"total": 0, "reached": 0, "startup": 0, PREBUILT: 0, GAP: 0}
                                         for k in KINDS}
    for site_id in sorted(sites):
        site = sites[site_id]
        counts[site.kind]["total"] += 1
        if site_id not in reached_by:
            continue
        status, reason, holds = _reason(site, shipped, plan_name, apis, aot, triton_aot)
        counts[site.kind]["reached"] += 1
        counts[site.kind][status] += 1
        tier = "startup" if site_id in startup_sites else "lazy"
        counts[site.kind]["startup"] += tier == "startup"
        details = {k: v for k, v in site.details.items() if k != "kernel_cache_module"}
        if holds:
            details["prebuilt"] = holds
        reached_sites[site_id] = {
            "kind": site.kind,
            "file": site.file,
            "name": site.name,
            "profiles": sorted(reached_by[site_id]),
            "tier": tier,
            "status": status,
            "reason": reason,
            "specializations": details,
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "description": (f"First-use compile sites of stack {stack}'s SGLang (the patch gate's tree) that the "
                        "launch profiles reach, each prebuilt or a gap with its reason and its tier (startup: in a module that importing the "
                        "roots loads; lazy: in a module only a function's own import reaches); `unreached`: the "
                        "other sites of the tree. Written by `tools/bazel run //jit_cache:update_inventory`; how the "
                        "sites and the reach are found and what that misses: jit_cache/README.md."),
        "stack": stack,
        "sglang_version": tree.version,
        "kernel_cache_plan": plan_name,
        "counts": counts,
        "modules": {"total": len(modules), "unparsed": dict(sorted(tree.unparsed.items()))},
        "profiles": profile_out,
        "sites": reached_sites,
        "unreached": sorted(i for i in sites if i not in reached_by),
    }


def site_summary(inventory: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """site id -> (file, status) for every site the inventory lists (reached or not)."""
    out = {i: (s["file"], s["status"]) for i, s in inventory.get("sites", {}).items()}
    for i in inventory.get("unreached", []):
        parts = i.split(":")
        out[i] = (parts[1] if len(parts) > 2 else "?", "unreached")
    return out


def validate_inventory(data: Any, where: str) -> None:
    check_json(data, INVENTORY, where, REGENERATE)


def differences(built: Mapping[str, Any], checked_in: Mapping[str, Any]) -> list[str]:
    """One line per site that is new, removed or changed between the recomputed inventory and the
    checked-in one (then one line for any other difference)."""
    new, old = site_summary(built), site_summary(checked_in)
    lines = []
    for site_id in sorted(set(new) | set(old)):
        if site_id not in old:
            lines.append(f"new site {site_id} ({new[site_id][0]}, {new[site_id][1]}) is not in the inventory")
        elif site_id not in new:
            lines.append(f"site {site_id} ({old[site_id][0]}) is gone from the tree")
        elif built.get("sites", {}).get(site_id) != checked_in.get("sites", {}).get(site_id):
            lines.append(f"site {site_id} ({new[site_id][0]}) changed (status {old[site_id][1]} -> {new[site_id][1]})")
    if not lines and dict(built) != dict(checked_in):
        keys = sorted(k for k in set(built) | set(checked_in) if built.get(k) != checked_in.get(k))
        lines.append(f"fields {', '.join(keys)} differ")
    return lines


def log(message: str) -> None:
    print(f"jit_cache: {message}", file=sys.stderr, flush=True)
