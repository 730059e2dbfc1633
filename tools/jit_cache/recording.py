"""What serving compiled at first use, recorded on a real server: the per-process records
tools/jit_cache/first_use_hooks.py writes (DIR/<pid>.json), merged into one recording per stack
and arch (`jit_cache/recordings/<stack>.<arch>.json`), data reviewed like a lock: canonical JSON,
no timestamps or pids, entries in a fixed order, one entry per compile however many processes
saw it.

    python3 -m tools.jit_cache.recording merge --records DIR --meta META.json --out FILE
    python3 -m tools.jit_cache.recording check FILE

META.json says what the run was (the hooks cannot: they run inside the server):
    {"stack": "pypi", "arch": "9.0",
     "recorded_on": {"gpu", "capability": [9, 0], "driver", "image": "sha256:..." or null,
                     "profile", "args": [the resolved server args]},
     "workload": {... copied as it is ...}}
The recording adds recorded_on.triton_key and recorded_on.env (from the records), `counts`
(compiles, that is misses, per phase and kind) and `entries` (fields: jit_cache/README.md
"Recording what serving compiles"). A malformed record, meta file or recording is refused in one
line naming the file, the entry (its JSON path and name) and the fix.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import write_bytes_atomic
from tools.common.jsondata import (ANY, BOOLEAN, INTEGER, STRING, TEXT, Enum, ListOf, MapOf, Nullable, Object,
                                   Schema, check_json, load_json_file)
from tools.common.jsonfmt import canonical_json, review_json

SCHEMA_VERSION = 1
PHASES = ("before_ready", "after_ready")
KINDS = ("cute-dsl", "flashinfer", "inductor", "sglang-jit", "triton", "triton-autotune")
PHASE = Enum(*PHASES)

RECORD_FIX = ("records are written by tools/jit_cache/first_use_hooks.py: record the run again into an "
              "empty directory with this checkout's hooks")
RECORDING_FIX = ("regenerate it with `python3 -m tools.jit_cache.recording merge` from the run's records "
                 "(it is not edited by hand)")
META_FIX = "fix the meta file (its fields: tools/jit_cache/recording.py)"

# One schema per kind; each entry is checked against its kind's after the document's shape.
TRITON_KEY_PARTS = Object({}, optional={
    "triton": STRING, "source": STRING, "fn": STRING, "signature": STRING, "constexprs": MapOf(ANY),
    "constants": STRING, "attrs": STRING, "backend": STRING, "options": STRING, "env": STRING,
    "unrecorded": STRING})
ENTRY_SCHEMAS: dict[str, Schema] = {
    "triton": Object({"kind": Enum("triton"), "kernel": TEXT, "key": TEXT, "key_parts": Nullable(TRITON_KEY_PARTS),
                      "specialization": ANY, "phase": PHASE, "cache_hit": BOOLEAN}),
    "triton-autotune": Object({"kind": Enum("triton-autotune"), "kernel": TEXT, "tuning_key": ANY,
                               "configs": ListOf(STRING), "winner": MapOf(ANY), "cache_key": Nullable(TEXT),
                               "cacheable": BOOLEAN, "cache_hit": Nullable(BOOLEAN), "phase": PHASE}),
    "sglang-jit": Object({"kind": Enum("sglang-jit"), "module": TEXT, "build_key": TEXT, "call": MapOf(ANY),
                          "hit": BOOLEAN, "phase": PHASE}),
    "cute-dsl": Object({"kind": Enum("cute-dsl"), "function": TEXT, "key": Nullable(TEXT), "phase": PHASE}),
    "flashinfer": Object({"kind": Enum("flashinfer"), "module": TEXT, "built": BOOLEAN, "phase": PHASE}),
    "inductor": Object({"kind": Enum("inductor"), "graph": TEXT, "key": Nullable(TEXT), "phase": PHASE}),
}
NAME_FIELD = {"triton": "kernel", "triton-autotune": "kernel", "sglang-jit": "module", "cute-dsl": "function",
              "flashinfer": "module", "inductor": "graph"}
KEY_FIELD = {"triton": "key", "triton-autotune": "cache_key", "sglang-jit": "build_key", "cute-dsl": "key",
             "flashinfer": None, "inductor": "key"}
ANY_ENTRY = Object({"kind": Enum(*KINDS)}, other=ANY)

PROCESS_RECORD_SCHEMA = Object({
    "schema_version": Enum(SCHEMA_VERSION), "pid": INTEGER, "root": TEXT, "argv": ListOf(STRING),
    "ready": BOOLEAN, "expects_own_ready": BOOLEAN, "triton_key": Nullable(STRING), "env": MapOf(STRING),
    "violations": ListOf(STRING), "entries": ListOf(ANY_ENTRY)})
RECORDED_ON = {"gpu": TEXT, "capability": ListOf(INTEGER, non_empty=True), "driver": TEXT, "image": Nullable(TEXT),
               "profile": TEXT, "args": ListOf(STRING)}
META_SCHEMA = Object({"stack": TEXT, "arch": TEXT, "recorded_on": Object(RECORDED_ON), "workload": ANY})
COUNTS = Object({kind: INTEGER for kind in KINDS})
RECORDING_SCHEMA = Object({
    "schema_version": Enum(SCHEMA_VERSION), "stack": TEXT, "arch": TEXT,
    "recorded_on": Object({**RECORDED_ON, "triton_key": Nullable(STRING), "env": MapOf(ANY)}),
    "workload": ANY, "counts": Object({phase: COUNTS for phase in PHASES}), "entries": ListOf(ANY_ENTRY)})


def entry_name(entry: Any) -> str:
    """`<kind> <name>` of an entry as messages name it, whatever shape it has."""
    if not isinstance(entry, dict):
        return "(not an object)"
    kind = entry.get("kind")
    name = entry.get(NAME_FIELD.get(kind, ""), "?") if isinstance(kind, str) else "?"
    return f"{kind} {name}"


def check_entries(entries: list[dict[str, Any]], where: str, fix: str) -> None:
    for i, entry in enumerate(entries):
        check_json(entry, ENTRY_SCHEMAS[entry["kind"]], f"{where} (entry {entry_name(entry)})", fix,
                   at=["entries", i])


def compiled(entry: dict[str, Any]) -> bool:
    """Whether the entry is a compile (a miss) rather than a hit or a load."""
    kind = entry["kind"]
    if kind in ("triton", "triton-autotune"):
        return entry["cache_hit"] is False
    if kind == "sglang-jit":
        return not entry["hit"]
    if kind == "flashinfer":
        return entry["built"]
    return True  # a cute.compile call, an inductor codegen: each is a compile


def identity(entry: dict[str, Any]) -> tuple[str, ...]:
    """What makes two entries one compile, across processes."""
    kind = entry["kind"]
    name = entry[NAME_FIELD[kind]]
    if kind == "triton-autotune":  # a scanned winner has no disk key: its tuning key and configs say it
        return (kind, name, entry["cache_key"] or "", json.dumps(entry["tuning_key"], sort_keys=True),
                json.dumps(entry["configs"]))
    key_field = KEY_FIELD[kind]
    return (kind, name, (entry[key_field] or "") if key_field else "")


def sort_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    return identity(entry)[:3] + (canonical_json(entry),)


def merge_same(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry from the processes' entries of one compile: the earliest phase; a hit only if
    every process hit (a compile anywhere is a compile); built if any built; every other field
    the first non-null one in canonical order, so the result does not depend on process order."""
    ordered = sorted(entries, key=canonical_json)
    merged = dict(ordered[0])
    for field in merged:
        values = [e.get(field) for e in ordered]
        present = [v for v in values if v is not None]
        if field == "phase":
            merged[field] = min(values, key=PHASES.index)
        elif field in ("cache_hit", "hit"):
            merged[field] = all(present) if present else None
        elif field == "built":
            merged[field] = any(present)
        elif merged[field] is None and present:
            merged[field] = present[0]
    return merged


def counts_of(entries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts = {phase: {kind: 0 for kind in KINDS} for phase in PHASES}
    for entry in entries:
        if compiled(entry):
            counts[entry["phase"]][entry["kind"]] += 1
    return counts


def load_records(records: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every DIR/<pid>.json, checked; one run's only."""
    if not records.is_dir():
        raise UserError(f"--records {records}: not a directory; pass the directory KIMI_K3_FIRST_USE_RECORD named")
    paths = sorted((p for p in records.iterdir() if p.suffix == ".json" and p.stem.isdigit()),
                   key=lambda p: int(p.stem))
    if not paths:
        raise UserError(f"--records {records}: no <pid>.json records; run the server with "
                        f"KIMI_K3_FIRST_USE_RECORD={records} and tools/jit_cache/first_use_site first on "
                        f"PYTHONPATH (jit_cache/README.md \"Recording what serving compiles\")")
    loaded = []
    for path in paths:
        value = load_json_file(path, "--records record", PROCESS_RECORD_SCHEMA, RECORD_FIX)
        check_entries(value["entries"], f"--records record {path}", RECORD_FIX)
        loaded.append((path, value))
    roots = sorted({v["root"] for _, v in loaded})
    if len(roots) > 1:
        first = {v["root"]: p for p, v in reversed(loaded)}
        raise UserError(f"--records {records}: records of {len(roots)} server runs ({first[roots[0]].name} of run "
                        f"{roots[0]}, {first[roots[1]].name} of run {roots[1]}); record each run into an empty directory")
    keys: dict[str, Path] = {}
    for path, value in loaded:
        if value["triton_key"] is not None:
            keys.setdefault(value["triton_key"], path)
    if len(keys) > 1:
        a, b = list(keys.values())[:2]
        raise UserError(f"--records {records}: {a.name} and {b.name} ran different Tritons (triton_key differs); "
                        f"record with one image")
    return loaded


# SGLang's Triton constexprs whose value comes from a pool SGLang sizes to the GPU's free memory
# unless a server argument pins the pool: constexpr -> (the argument, the constexpr less the
# argument's value). An entry keyed on such a value gets another key on a host with other free
# memory (another GPU, driver or environment), so its shipped kernel is missed there and compiled
# at first use. num_cache_lines: the KDA/Mamba conv-state pool's rows, its size plus a padding row
# (sglang/srt/mem_cache/memory_pool.py); the causal_conv1d kernels take it as a tl.constexpr.
MEMORY_FITTED = {"num_cache_lines": ("--max-mamba-cache-size", 1)}


def server_arg(args: Sequence[str], name: str) -> str | None:
    """NAME's value in a server command line (`NAME V` or `NAME=V`; the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def memory_fitted_problems(recording: dict[str, Any]) -> list[str]:
    """One line per Triton entry keyed on a memory-fitted pool size that the recorded server's
    arguments (recorded_on.args) do not pin to that size: such an entry cannot be shipped."""
    args = recording["recorded_on"].get("args") or []
    profile = recording["recorded_on"].get("profile") or "the recorded launch profile"
    problems = []
    for i, entry in enumerate(recording["entries"]):
        constexprs = (entry.get("key_parts") or {}).get("constexprs") if entry["kind"] == "triton" else None
        if not isinstance(constexprs, dict):
            continue
        for name, (arg, extra) in MEMORY_FITTED.items():
            value = constexprs.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            pinned = server_arg(args, arg)
            where = f"$.entries[{i}] {entry['kernel']}: keyed on {name}={value}"
            if pinned is None:
                problems.append(f"{where}, a pool size SGLang fits to the free GPU memory since the recorded server "
                                f"gave no {arg}: a host with other free memory keys the kernel otherwise and "
                                f"compiles it at first use; add `{arg} {value - extra}` to {profile}'s args and "
                                "record again")
            elif not pinned.isdigit() or int(pinned) + extra != value:
                problems.append(f"{where}, yet the recorded server gave {arg} {pinned}, which keys it "
                                f"{name}={pinned}+{extra}; record again with this profile")
    return problems


# Variables a server sets afresh at each launch: SGLang's run id holds the launch time. A recording
# keeps their names and drops the values, so that two runs of one image give the same bytes.
PER_RUN_ENV = {"SGLANG_RUN_ID": "<set per run>"}


def merged_env(loaded: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """Each variable's value, or the sorted list of its values where processes differ."""
    values: dict[str, set[str]] = {}
    for _, record in loaded:
        for name, value in record["env"].items():
            values.setdefault(name, set()).add(PER_RUN_ENV.get(name, value))
    return {name: (next(iter(v)) if len(v) == 1 else sorted(v)) for name, v in sorted(values.items())}


def merge(records: Path, meta_path: Path) -> dict[str, Any]:
    meta = load_json_file(meta_path, "--meta", META_SCHEMA, META_FIX)
    loaded = load_records(records)
    for path, record in loaded:
        for violation in record["violations"]:
            print(f"recording: {path.name}: {violation}", file=sys.stderr)
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for _, record in loaded:
        for entry in record["entries"]:
            groups.setdefault(identity(entry), []).append(entry)
    entries = sorted((merge_same(group) for group in groups.values()), key=sort_key)
    triton_keys = [r["triton_key"] for _, r in loaded if r["triton_key"] is not None]
    return {
        "schema_version": SCHEMA_VERSION, "stack": meta["stack"], "arch": meta["arch"],
        "recorded_on": {**meta["recorded_on"], "triton_key": triton_keys[0] if triton_keys else None,
                        "env": merged_env(loaded)},
        "workload": meta["workload"], "counts": counts_of(entries), "entries": entries,
    }


def check_recording(path: Path) -> dict[str, Any]:
    """A merged recording, as merge writes it: its shape, each entry's, the order, one entry per
    compile, the counts, and its bytes canonical."""
    what = "recording"
    value = load_json_file(path, what, RECORDING_SCHEMA, RECORDING_FIX)
    where = f"{what} {path}"
    check_entries(value["entries"], where, RECORDING_FIX)
    seen: dict[tuple[str, ...], int] = {}
    previous = None
    for i, entry in enumerate(value["entries"]):
        ident = identity(entry)
        if ident in seen:
            raise UserError(f"{where} (entry {entry_name(entry)}): $.entries[{i}]: the same compile as "
                            f"$.entries[{seen[ident]}]; {RECORDING_FIX}")
        seen[ident] = i
        if previous is not None and sort_key(entry) < previous:
            raise UserError(f"{where} (entry {entry_name(entry)}): $.entries[{i}]: out of order (sorted by kind, "
                            f"name, key); {RECORDING_FIX}")
        previous = sort_key(entry)
    if value["counts"] != counts_of(value["entries"]):
        raise UserError(f"{where}: $.counts: not the entries' compiles per phase and kind "
                        f"({json.dumps(counts_of(value['entries']), sort_keys=True)}); {RECORDING_FIX}")
    if path.read_bytes() != review_json(value):
        raise UserError(f"{where}: not in canonical form (sorted keys, 2-space indent, ASCII); {RECORDING_FIX}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.recording",
                                     description="merge and check recordings of what serving compiles at first use")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge a run's per-process records into one recording")
    m.add_argument("--records", type=Path, required=True, help="the directory KIMI_K3_FIRST_USE_RECORD named")
    m.add_argument("--meta", type=Path, required=True, help="what the run was (stack, arch, recorded_on, workload)")
    m.add_argument("--out", type=Path, required=True, help="jit_cache/recordings/<stack>.<arch>.json")
    c = sub.add_parser("check", help="check a recording")
    c.add_argument("file", type=Path)
    a = parser.parse_args(argv)
    if a.command == "merge":
        recording = merge(a.records, a.meta)
        write_bytes_atomic(a.out, review_json(recording))
        # Written all the same: the recording is a true account of the run. The build from it
        # (tools/jit_cache/triton_recorded.py) refuses these entries.
        for problem in memory_fitted_problems(recording):
            print(f"recording: warning: {a.out}: {problem}", file=sys.stderr)
        counts = recording["counts"]
        print(f"{a.out}: {len(recording['entries'])} entries; compiles before ready "
              f"{sum(counts['before_ready'].values())}, after ready {sum(counts['after_ready'].values())}",
              file=sys.stderr)
        return 0
    value = check_recording(a.file)
    print(f"{a.file}: {len(value['entries'])} entries, canonical", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
