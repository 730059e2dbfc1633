"""What a recording's prebuilt caches cover of serving's first-use compiles (issue #38 deliverable 6).

    python3 -m tools.jit_cache coverage --recording FILE --inventory jit_cache/inventory.<stack>.json
        [--cache-manifest DIR/kimi-k3-triton.json]

Per kind, a printed table: the recorded entries and how many the image ships prebuilt (from the
build-from-recording manifest; without one, the inventory's status of the entry's site), the
recorded sites (kernels, modules, functions) and how many of them the inventory's reached sites
hold, and the static-only sites: reached in the inventory, never seen in the recording (an
over-approximation of the static reading, or a path the recorded workload did not take).

A recorded entry names its site as the inventory does: a Triton kernel or CuTe-DSL function
`package.module:qualname` is `<kind>:package/module.py:<last name>`; a FlashInfer module is the
inventory's `flashinfer` site of that name; an SGLang JIT module is the `sglang-jit` site of the
function its recorded call names (`call.call` or `call.function`, `module:function`); an
inductor graph has no site.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from tools.common.jsondata import ANY, MapOf, Object, TEXT, load_json_file
from tools.jit_cache.triton_recorded import cache_dir_name, hex_key, load_recording

KINDS = ("triton", "triton-autotune", "sglang-jit", "flashinfer", "cute-dsl", "inductor")
INVENTORY = Object({"sites": MapOf(Object({"kind": TEXT, "file": TEXT, "name": TEXT}, other=ANY))}, other=ANY)
# Which inventory kind a recorded kind's sites are (an autotune result is its kernel's site).
SITE_KIND = {"triton-autotune": "triton"}


def _qualified_site(kind: str, qualified: str | None) -> tuple[str, str, str] | None:
    if not qualified or qualified.count(":") != 1:
        return None
    module, _, qualname = qualified.partition(":")
    return (kind, module.replace(".", "/") + ".py", qualname.rsplit(".", 1)[-1])


def site_of(entry: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(kind, file, name) of the inventory site a recorded entry is, or None (the kind has none)."""
    kind = entry["kind"]
    if kind in ("triton", "triton-autotune"):
        return _qualified_site("triton", entry.get("kernel"))
    if kind == "cute-dsl":
        return _qualified_site("cute-dsl", entry.get("function"))
    if kind == "sglang-jit":
        call = entry.get("call") or {}
        return _qualified_site("sglang-jit", call.get("call") or call.get("function"))
    if kind == "flashinfer":
        return ("flashinfer", "*", entry["module"])
    return None


def _prebuilt_in_manifest(entry: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    kind = entry["kind"]
    if kind == "triton":
        key = hex_key(entry["key"])
        return key is not None and cache_dir_name(key) in manifest.get("entries", {})
    if kind == "triton-autotune":
        key = entry.get("cache_key")
        return any(a["key"] == key or (hex_key(key or "") and a["key"] == cache_dir_name(hex_key(key)))
                   for a in manifest.get("autotune", []))
    if kind == "sglang-jit":
        # the build's verdict: the recorded key, or (a record run's compilers in the key) the
        # module's arguments matched
        return any(v["module"] == entry["module"] and entry["build_key"] in (v["build_key"], v.get("recorded_build_key"))
                   for v in manifest.get("sglang_jit", []))
    if kind == "flashinfer":
        return any(v["module"] == entry["module"] for v in manifest.get("flashinfer", []))
    return False


def coverage(recording: Mapping[str, Any], inventory: Mapping[str, Any],
             manifest: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per kind: entries, prebuilt, sites, sites in the inventory, static-only sites."""
    sites = inventory["sites"]
    by_place = {}
    for site_id, site in sites.items():
        by_place[(site["kind"], site["file"], site["name"])] = site_id
        if site["kind"] == "flashinfer":
            by_place.setdefault(("flashinfer", "*", site["name"]), site_id)
    rows = []
    for kind in KINDS:
        entries = [e for e in recording["entries"] if e["kind"] == kind]
        seen, unmapped, prebuilt = set(), set(), 0
        for e in entries:
            place = site_of(e)
            site_id = by_place.get(place) if place else None
            if site_id:
                seen.add(site_id)
            elif place:
                unmapped.add(":".join(place))
            if manifest is not None:
                prebuilt += _prebuilt_in_manifest(e, manifest)
            else:
                prebuilt += bool(site_id) and sites[site_id].get("status") == "prebuilt"
        site_kind = SITE_KIND.get(kind, kind)
        static = sorted(i for i, s in sites.items() if s["kind"] == site_kind and i not in seen)
        rows.append({"kind": kind, "entries": len(entries), "prebuilt": prebuilt, "sites": len(seen) + len(unmapped),
                     "in_inventory": len(seen), "not_in_inventory": sorted(unmapped),
                     "static_only": static if kind != "triton-autotune" else []})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("kind", "prebuilt/recorded", "recorded sites", "in inventory", "static-only sites")
    lines = [head] + [(r["kind"], f"{r['prebuilt']}/{r['entries']}", str(r["sites"]), str(r["in_inventory"]),
                       str(len(r["static_only"])) if r["kind"] != "triton-autotune" else "-") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def cmd_coverage(args: Any) -> int:
    recording = load_recording(args.recording)
    inventory = load_json_file(args.inventory, "--inventory", INVENTORY, "pass jit_cache/inventory.<stack>.json")
    manifest = None
    if args.cache_manifest is not None:
        path = args.cache_manifest / "kimi-k3-triton.json" if args.cache_manifest.is_dir() else args.cache_manifest
        manifest = load_json_file(path, "--cache-manifest", Object({"entries": MapOf(ANY)}, other=ANY),
                                  "pass build-from-recording's output (its kimi-k3-triton.json)")
    rows = coverage(recording, inventory, manifest)
    print(f"{args.recording.name} against {args.inventory.name}"
          f"{' and ' + str(args.cache_manifest) if manifest is not None else ' (prebuilt: the inventory status)'}")
    print(table(rows))
    for r in rows:
        for place in r["not_in_inventory"]:
            print(f"recorded, not in the inventory's reached sites: {place}")
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
    return 0


def add_coverage_command(sub: Any) -> None:
    p = sub.add_parser("coverage", help="a recording's first-use compiles against the inventory and the prebuilt caches")
    p.add_argument("--recording", type=Path, required=True, help="jit_cache/recordings/<stack>.<arch>.json")
    p.add_argument("--inventory", type=Path, required=True, help="jit_cache/inventory.<stack>.json")
    p.add_argument("--cache-manifest", type=Path, help="build-from-recording's output (or its kimi-k3-triton.json)")
    p.add_argument("--json", action="store_true", help="also the rows as JSON, with the static-only site ids")
    p.set_defaults(func=cmd_coverage)
