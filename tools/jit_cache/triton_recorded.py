"""First-use caches rebuilt from a recording of a GPU run (issue #38).

    python3 -m tools.jit_cache.triton_recorded build-from-recording --recording FILE --stack S
        --arch 9.0 --base-tar BASE.tar --site-tree DIR... --site-packages /usr/local/lib/python3.X/dist-packages
        [--sglang-manifest DIR] [--kernel-plan PLAN.bzl] [--runtime FILE --host-triton WHEEL] --out OUT

A recording (jit_cache/recordings/<stack>.<arch>.json, tools/jit_cache/first_use_hooks.py) lists
what a server compiled at first use. Every `triton` entry is replayed with Triton's own
JITFunction.preload of its recorded specialization, under the image's python3.11 over the image's
installed trees (tools/jit_cache/triton_recorded_worker.py), against a stand-in device answering
as the recorded target, exactly as triton_aot.py runs its calls (the tree at one fixed path, the
sources' mtimes SOURCE_DATE_EPOCH, so two output roots give the same bytes). The key Triton
computes must be the recorded one; else the build fails, one line per entry naming the kernel and
the key part that differs (Triton itself, the kernel's source, a constexpr, the signature, attrs,
the backend, an option, the environment). Every cacheable `triton-autotune` entry becomes Triton's
autotune disk-cache file holding the recorded winner, under the key Triton's autotuner recomputes
(which must be the recorded one), so a server with TRITON_CACHE_AUTOTUNING=1 does not benchmark.

The other kinds are checked, not built here: each `sglang-jit` module must be in the SGLang JIT
build (--sglang-manifest, its kimi-k3-sglang-jit.json), each `flashinfer` module in the stack's
kernel-cache plan (--kernel-plan); `cute-dsl` and `inductor` entries are listed as not yet built.

OUT is Triton's cache layout as triton_aot.py writes it (`<key>/<kernel>.cubin/.json`, and
`<key>/<kernel>.autotune.json`), with kimi-k3-triton.json listing every file's sha256, the
autotune results, what is not shippable and why, and the other kinds' verdicts;
`python3 -m tools.jit_cache.triton_aot bind` makes a TRITON_CACHE_DIR take it.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically
from tools.common.hashing import sha256_file
from tools.common.jsondata import (ANY, BOOLEAN, INTEGER, TEXT, Enum, ListOf, MapOf, Nullable, Object, check_json,
                                   json_path, load_json_file)
from tools.common.jsonfmt import review_json
from tools.jit_cache import triton_aot
from tools.jit_cache.recording import memory_fitted_problems

WORKER = Path(__file__).with_name("triton_recorded_worker.py")
PHASE = Enum("before_ready", "after_ready")
# The entries of a recording this module reads, by kind (tools/jit_cache/recording.py writes them;
# fields it adds later are allowed).
ENTRY_SCHEMAS = {
    "triton": Object({
        "kind": TEXT, "kernel": TEXT, "key": TEXT, "phase": PHASE,
        # null: the compile was not a @triton.jit launch (an IR file given to triton.compile), or
        # its specialization was not seen; such an entry is listed as not shippable.
        "key_parts": Nullable(Object({name: ANY for name in ("triton", "source", "backend", "options", "env")},
                                     other=ANY)),
        "specialization": Nullable(Object({name: ANY for name in (
            "name", "signature", "constant_keys", "constant_vals", "attrs_keys", "attrs_vals", "options", "key",
            "target")}, other=ANY)),
    }, other=ANY),
    "triton-autotune": Object({
        "kind": TEXT, "kernel": TEXT, "tuning_key": ListOf(ANY), "configs": ListOf(TEXT),
        "winner": Object({"kwargs": MapOf(ANY)}, other=ANY), "cache_key": Nullable(TEXT), "cacheable": BOOLEAN,
        "phase": PHASE,
    }, other=ANY),
    "sglang-jit": Object({"kind": TEXT, "module": TEXT, "build_key": TEXT, "phase": PHASE}, other=ANY),
    "flashinfer": Object({"kind": TEXT, "module": TEXT, "phase": PHASE}, other=ANY),
    "cute-dsl": Object({"kind": TEXT, "phase": PHASE}, other=ANY),
    "inductor": Object({"kind": TEXT, "phase": PHASE}, other=ANY),
}
RECORDING = Object({
    "schema_version": Enum(1), "stack": TEXT, "arch": TEXT,
    "recorded_on": Object({"capability": ListOf(INTEGER)}, other=ANY),
    "entries": ListOf(Object({"kind": TEXT}, other=ANY)),
}, other=ANY)
FIX = "record it again (tools/jit_cache/first_use_hooks.py) or fix the entry"
KERNEL = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def log(msg: str) -> None:
    print(f"jit_cache: {msg}", file=sys.stderr, flush=True)


def load_recording(path: Path, flag: str = "--recording") -> dict[str, Any]:
    """The recording at PATH with every entry checked against its kind's schema: a malformed
    entry is one line naming the file, the entry's JSON path and what is wrong."""
    recording = load_json_file(path, flag, RECORDING, FIX)
    for i, entry in enumerate(recording["entries"]):
        where = f"{flag} {path}"
        kind = entry["kind"]
        if kind not in ENTRY_SCHEMAS:
            raise UserError(f"{where}: {json_path(['entries', i, 'kind'])}: {kind!r} is not one of "
                            f"{', '.join(ENTRY_SCHEMAS)}; {FIX}")
        check_json(entry, ENTRY_SCHEMAS[kind], f"{where}: {json_path(['entries', i])}", FIX)
        kernel = entry.get("kernel")
        if replayable(entry) and not KERNEL.fullmatch(kernel):
            raise UserError(f"{where}: {json_path(['entries', i, 'kernel'])}: {kernel!r} is not "
                            f"\"module:qualname\"; {FIX}")
        if kind == "triton" and hex_key(entry["key"]) is None:
            raise UserError(f"{where}: {json_path(['entries', i, 'key'])}: {entry['key']!r} is not a "
                            f"Triton cache key (64 hex digits); {FIX}")
    return recording


def replayable(entry: dict[str, Any]) -> bool:
    """A triton entry with its specialization and key parts, or an autotune entry with its key."""
    if entry["kind"] == "triton":
        return entry["specialization"] is not None and entry["key_parts"] is not None
    return entry["kind"] == "triton-autotune" and entry["cache_key"] is not None


def hex_key(key: str) -> str | None:
    """A Triton cache key as its sha256 hex digest (the form Triton computes), from that or from its
    cache directory's name (base32); None when it is neither."""
    if re.fullmatch(r"[0-9a-f]{64}", key):
        return key
    if re.fullmatch(r"[A-Z2-7]{52}", key):
        return base64.b32decode(key + "====").hex()
    return None


def cache_dir_name(key: str) -> str:
    """The directory Triton's FileCacheManager keeps a key's files in (runtime/cache.py _base32)."""
    return base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")


def recorded_target(recording: dict[str, Any], arch: str, flag: str, path: Path) -> dict[str, Any]:
    """The one Triton target every triton entry was recorded for; it must be the --arch's."""
    targets = {json.dumps(e["specialization"]["target"], sort_keys=True)
               for e in recording["entries"] if e["kind"] == "triton" and replayable(e)}
    major, minor = recording["recorded_on"]["capability"]
    if f"{major}.{minor}" != arch or recording["arch"] != arch:
        raise UserError(f"{flag} {path}: recorded on capability {major}.{minor} (arch {recording['arch']}), "
                        f"not --arch {arch}; build it for its arch")
    if len(targets) > 1:
        raise UserError(f"{flag} {path}: triton entries for {len(targets)} targets ({', '.join(sorted(targets))}); "
                        "one recording is one device")
    if targets:
        return json.loads(targets.pop())
    return {"backend": "cuda", "arch": major * 10 + minor, "warp_size": 32}


def stand_in_device(recording: dict[str, Any], arch: str, runtime: dict[str, Any] | None) -> dict[str, Any]:
    """What the stand-in answers for the device: the runtime's (--device-of, --runtime), else
    triton_aot's for the arch, else the recorded capability and name (no properties)."""
    if runtime is not None:
        return runtime["device"]
    if arch in triton_aot.DEVICES:
        return triton_aot.DEVICES[arch]
    return {"capability": recording["recorded_on"]["capability"],
            "device_name": recording["recorded_on"].get("gpu") or f"capability {arch}", "device_properties": {}}


def _recorded_env(recording: dict[str, Any], flag: str, path: Path) -> dict[str, str]:
    """The cache-invalidating environment Triton keyed the entries with (key_parts.env, one for
    the whole recording): the worker runs with it."""
    import ast

    envs = {e["key_parts"]["env"] for e in recording["entries"] if e["kind"] == "triton" and replayable(e)}
    if len(envs) > 1:
        raise UserError(f"{flag} {path}: triton entries keyed under {len(envs)} environments; record one server run")
    if not envs:
        return {}
    try:
        pairs = ast.literal_eval(envs.pop())
        return {str(k): str(v) for k, v in pairs}
    except (ValueError, SyntaxError, TypeError):
        raise UserError(f"{flag} {path}: key_parts.env is not Triton's str(sorted(env.items())); {FIX}") from None


def replay(interp: Any, recording: dict[str, Any], path: Path, target: dict[str, Any], device: dict[str, Any],
           cache_dir: Path, sglang: bool, identity: Path | None = None) -> dict[str, Any]:
    """The worker over the recording's triton and triton-autotune entries (interp: .python, .env,
    .scratch: triton_aot's image, or the tests' interpreter); returns its result."""
    triton = [dict(e, key=hex_key(e["key"])) for e in recording["entries"] if e["kind"] == "triton"]
    autotune = [e for e in recording["entries"] if e["kind"] == "triton-autotune"]
    request = {"target": target, "device": device, "sglang": sglang, "triton": triton, "autotune": autotune,
               "triton_identity": str(identity) if identity else None,
               "result": str(interp.scratch / "recorded-result.json")}
    request_file = interp.scratch / "recorded-request.json"
    request_file.write_text(json.dumps(request))
    # SGLang's MoE and attention-residual modules import deep_gemm, whose import asserts that a
    # CUDA home exists (CUDA_HOME, else nvcc's, else /usr/local/cuda). The replay compiles nothing
    # with it: an empty stand-in directory answers, and no compiler becomes reachable.
    no_cuda = interp.scratch / "no-cuda"
    no_cuda.mkdir(exist_ok=True)
    env = dict(interp.env, TRITON_CACHE_DIR=str(cache_dir), CUDA_HOME=str(no_cuda),
               **_recorded_env(recording, "--recording", path))
    proc = subprocess.run([str(interp.python), str(WORKER), str(request_file)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not Path(request["result"]).is_file():
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
        raise UserError(f"build-from-recording: the Triton worker failed (exit {proc.returncode}); see its output above")
    return json.loads(Path(request["result"]).read_text())


def triton_verdicts(recording: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """One line per triton or autotune entry whose rebuild failed or whose key differs."""
    failures = []
    triton = [e for e in recording["entries"] if e["kind"] == "triton"]
    for entry, row in zip(triton, result["triton"]):
        if "error" in row:
            sys.stderr.write(row.get("traceback", ""))
            failures.append(f"{entry['kernel']}: the replay failed: {row['error']}")
        elif row["differs"]:
            failures.append(f"{entry['kernel']}: Triton keys it {row['key'][:12]}..., the recording "
                            f"{hex_key(entry['key'])[:12]}...: differs in {'; '.join(row['differs'])}")
    autotune = [e for e in recording["entries"] if e["kind"] == "triton-autotune"]
    for entry, row in zip(autotune, result["autotune"]):
        if "error" in row:
            failures.append(f"{entry['kernel']} (autotune): {row['error']}")
        elif entry["cacheable"] and row["why"] is None and row["cache_key"] != hex_key(entry["cache_key"]):
            failures.append(f"{entry['kernel']} (autotune, tuning key {entry['tuning_key']}): Triton's autotuner "
                            f"keys it {row['cache_key'][:12]}..., the recording {entry['cache_key'][:12]}...: Triton, "
                            "the kernel's source, the backend or the environment differs (its triton entries name which)")
    return failures


def autotune_file(entry: dict[str, Any]) -> bytes:
    """Triton's autotune disk-cache file for the recorded winner (Autotuner.check_disk_cache reads
    {"key", "configs_timings": [[Config.__dict__, timings]]} and takes the fastest): the winner
    alone, its timing null (a rebuild measures nothing; with one config nothing is compared)."""
    winner = {k: v for k, v in entry["winner"].items() if k != "pre_hook"}
    return review_json({"key": entry["tuning_key"], "configs_timings": [[winner, None]]})


def positional_args(recorded: Any) -> list:
    """The recorded call's arguments (name -> value, in the function's order; a torch dtype as
    "torch.NAME") as jit_cache/sglang_modules.json writes them: positional, a dtype {"dtype": NAME}."""
    values = list(recorded.values()) if isinstance(recorded, dict) else list(recorded or [])
    return [{"dtype": v[len("torch."):]} if isinstance(v, str) and v.startswith("torch.") else v for v in values]


def check_sglang_jit(entries: Sequence[dict[str, Any]], manifest_dir: Path | None, stack: str) -> tuple[list, list]:
    """(verdicts, failures) of the recorded SGLang JIT modules against the SGLang JIT build."""
    if not entries:
        return [], []
    if manifest_dir is None:
        return [], [f"{len(entries)} sglang-jit entries recorded: pass --sglang-manifest (the SGLang JIT "
                    "build of jit_cache/sglang_modules.json, //jit_cache:sglang_jit_<arch>)"]
    from tools.jit_cache.sglang_aot import MANIFEST

    built = load_json_file(manifest_dir / MANIFEST, "--sglang-manifest", Object({"modules": ListOf(
        Object({"module": TEXT, "build_key": TEXT}, other=ANY))}, other=ANY))["modules"]
    keys: dict[str, set[str]] = {}
    module_args: dict[str, list] = {}
    for m in built:
        keys.setdefault(m["module"], set()).add(m["build_key"])
        module_args.setdefault(m["module"], []).append(m.get("module_args"))
    verdicts, failures = [], []
    for e in entries:
        if e["module"] not in keys:
            call = e.get("call") or {}
            add = json.dumps({"call": call.get("call") or call.get("function", "package.module:_jit_..._module"),
                              "args": positional_args(call.get("args", {})), "why": "recorded at first use"},
                             sort_keys=True)
            failures.append(f"sglang-jit module {e['module']}: not in the SGLang JIT build; add to "
                            f"jit_cache/sglang_modules.json stacks.{stack}: {add}")
        elif e["build_key"] not in keys[e["module"]]:
            # SGLang's build key holds the compilers' `--version` text. A record run has compilers
            # (it compiles what it records); the image has none, and the build keys its modules
            # for that runtime. So a recorded key is comparable only where the recording ran the
            # build's own runtime; elsewhere the module is matched by its name and arguments, and
            # the replay in verify mode (compilers hidden, a miss fails) proves the key.
            recorded_args = (e.get("call") or {}).get("module_args")
            if recorded_args is not None and list(recorded_args) in module_args[e["module"]]:
                verdicts.append({"module": e["module"], "build_key": sorted(keys[e["module"]])[0], "prebuilt": True,
                                 "recorded_build_key": e["build_key"],
                                 "key": "matched by module arguments: the record run keyed with its own compilers"})
            else:
                failures.append(f"sglang-jit module {e['module']}: recorded build_key {e['build_key']} with module "
                                f"arguments {recorded_args}, the build has {', '.join(sorted(keys[e['module']]))} "
                                f"with {module_args[e['module']]}: rebuild jit_cache/sglang_modules.json's entry "
                                "with the recorded call and arguments")
        else:
            verdicts.append({"module": e["module"], "build_key": e["build_key"], "prebuilt": True})
    return verdicts, failures


def check_flashinfer(entries: Sequence[dict[str, Any]], plan_path: Path | None) -> tuple[list, list]:
    """(verdicts, failures) of the recorded FlashInfer modules against the kernel-cache plan."""
    if not entries:
        return [], []
    if plan_path is None:
        return [], [f"{len(entries)} flashinfer entries recorded: pass --kernel-plan (kernel_cache/plan_*.bzl)"]
    from tools.kernel_cache.plan import read_plan

    plan = read_plan(plan_path)
    modules = {m if isinstance(m, str) else m["name"] for m in plan.get("modules", [])}
    verdicts, failures = [], []
    for e in entries:
        if e["module"] in modules:
            verdicts.append({"module": e["module"], "prebuilt": True})
        else:
            failures.append(f"flashinfer module {e['module']}: {plan_path.name} does not build it; add it to "
                            f"kernel_cache/selections.json selections.{plan.get('selection')} and regenerate the "
                            "plan (tools/bazel run //kernel_cache:update_plans)")
    return verdicts, failures


class HostPython:
    """An interpreter with Triton importable, for the tests (the build uses the image's)."""

    def __init__(self, python: str, pythonpath: Sequence[str], scratch: Path):
        self.python, self.scratch = python, scratch
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "PYTHONPATH": os.pathsep.join(pythonpath),
                    "PYTHONDONTWRITEBYTECODE": "1", "LC_ALL": "C"}


def build(recording_path: Path, stack: str, arch: str, interp: Any, scratch: Path, out: Path,
          sglang: bool = True, sglang_manifest: Path | None = None, kernel_plan: Path | None = None,
          runtime: dict[str, Any] | None = None, identity: Path | None = None,
          device_of: dict[str, Any] | None = None,
          driver_module: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rebuild RECORDING's first-use caches into OUT (nothing written on any failure); returns the
    manifest. driver_module(cache_dir) builds Triton's driver module there (the Bazel build's
    triton_aot.build_driver_module): the image has no C compiler, so a cache without it compiles
    cuda_utils at the first launch."""
    recording = load_recording(recording_path)
    if recording["stack"] != stack:
        raise UserError(f"--recording {recording_path}: recorded for stack {recording['stack']}, not --stack {stack}")
    fitted = memory_fitted_problems(recording)
    if fitted:
        for line in fitted:
            print(f"jit_cache: {recording_path}: {line}", file=sys.stderr)
        raise UserError(f"--recording {recording_path}: {len(fitted)} Triton entr{'y is' if len(fitted) == 1 else 'ies are'} "
                        "keyed on a pool size fitted to the recording host's free memory (one line each above); "
                        "pin it in the launch profile and record again")
    target = recorded_target(recording, arch, "--recording", recording_path)
    device = stand_in_device(recording, arch, device_of or runtime)
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in ENTRY_SCHEMAS}
    not_shippable = []
    for e in recording["entries"]:
        if e["kind"].startswith("triton") and not replayable(e):
            not_shippable.append({"kind": e["kind"], "kernel": e["kernel"], "tuning_key": e.get("tuning_key"),
                                  "why": "no specialization recorded (not a @triton.jit launch)"
                                  if e["kind"] == "triton" else "no autotune key recorded"})
        else:
            by_kind[e["kind"]].append(e)
    recording = dict(recording, entries=by_kind["triton"] + by_kind["triton-autotune"])
    cache_dir = scratch / "triton-cache"
    log(f"{recording_path.name}: {len(by_kind['triton'])} Triton specializations, {len(by_kind['triton-autotune'])} "
        f"autotune results replayed against a stand-in {device.get('device_name')} ({target})")
    result = replay(interp, recording, recording_path, target, device, cache_dir, sglang, identity)
    failures = triton_verdicts(recording, result)
    sglang_jit, more = check_sglang_jit(by_kind["sglang-jit"], sglang_manifest, stack)
    failures += more
    flashinfer, more = check_flashinfer(by_kind["flashinfer"], kernel_plan)
    failures += more
    if failures:
        for line in failures:
            print(f"jit_cache: {recording_path}: {line}", file=sys.stderr)
        raise UserError(f"build-from-recording: {len(failures)} recorded entr{'y' if len(failures) == 1 else 'ies'} "
                        "cannot be prebuilt as recorded (one line each above)")
    keys = {cache_dir_name(row["key"]) for row in result["triton"]}
    cache_dir.mkdir(parents=True, exist_ok=True)  # a recording of no Triton compile wrote none
    entries = {k: v for k, v in triton_aot.shipped_entries(cache_dir).items() if k in keys}
    if len(entries) != len(keys):
        raise UserError(f"build-from-recording: Triton wrote {len(entries)} of {len(keys)} cache entries; "
                        "see the worker's output")
    autotune, files = [], {}
    for e, row in zip(by_kind["triton-autotune"], result["autotune"]):
        why = row["why"] or (None if e["cacheable"] else "recorded as not cacheable")
        if why:
            not_shippable.append({"kind": "triton-autotune", "kernel": e["kernel"], "tuning_key": e["tuning_key"],
                                  "why": why})
            continue
        data = autotune_file(e)
        rel = f"{cache_dir_name(row['cache_key'])}/{row['file']}"
        if files.get(rel, data) != data:
            raise UserError(f"--recording {recording_path}: {e['kernel']} tuning key {e['tuning_key']}: recorded "
                            "twice with different winners; record one server run")
        files[rel] = data
        autotune.append({"kernel": e["kernel"], "key": cache_dir_name(row["cache_key"]), "file": row["file"],
                         "tuning_key": e["tuning_key"], "sha256": None})
    for a in autotune:
        a["sha256"] = hashlib.sha256(files[f"{a['key']}/{a['file']}"]).hexdigest()
    autotune = sorted({json.dumps(a, sort_keys=True): a for a in autotune}.values(),
                      key=lambda a: (a["key"], a["file"]))
    not_built = {k: len(by_kind[k]) for k in ("cute-dsl", "inductor") if by_kind[k]}
    modules = [driver_module(cache_dir)] if driver_module else []
    manifest = {
        "schema_version": triton_aot.SCHEMA_VERSION,
        "description": "First-use caches rebuilt from a recording by tools/jit_cache/triton_recorded.py "
                       "(Triton's JITFunction.preload of each recorded specialization, stand-in device); "
                       "bind them into TRITON_CACHE_DIR with `python3 -m tools.jit_cache.triton_aot bind`.",
        "stack": stack,
        "arch": arch,
        "device": device,
        "target": target,
        "recording": {"file": recording_path.name, "sha256": sha256_file(recording_path),
                      "recorded_on": recording["recorded_on"]},
        "runtime": runtime,
        "entries": entries,
        "recorded": sorted({(e["kernel"], cache_dir_name(hex_key(e["key"]))): {
            "kernel": e["kernel"], "key": cache_dir_name(hex_key(e["key"])), "phase": e["phase"]}
            for e in by_kind["triton"]}.values(), key=lambda r: (r["kernel"], r["key"])),
        "autotune": autotune,
        "not_shippable": sorted(not_shippable, key=lambda n: (n["kind"], n["kernel"], json.dumps(n["tuning_key"]))),
        "sglang_jit": sorted(sglang_jit, key=lambda v: (v["module"], v["build_key"])),
        "flashinfer": sorted(flashinfer, key=lambda v: v["module"]),
        "not_built": not_built,
        "modules": modules,
    }
    with dir_replaced_atomically(out, "--out", tool=None) as tmp:
        for key, entry in entries.items():
            (tmp / key).mkdir()
            for name in entry["files"]:
                shutil.copyfile(cache_dir / key / name, tmp / key / name)
                (tmp / key / name).chmod(0o644)
        for module in modules:
            (tmp / module["key"]).mkdir(exist_ok=True)
            shutil.copyfile(cache_dir / module["key"] / module["file"], tmp / module["key"] / module["file"])
            (tmp / module["key"] / module["file"]).chmod(0o755)
        for rel, data in files.items():
            (tmp / rel).parent.mkdir(exist_ok=True)
            (tmp / rel).write_bytes(data)
            (tmp / rel).chmod(0o644)
        (tmp / triton_aot.MANIFEST).write_bytes(review_json(manifest))
    log(f"{len(entries)} Triton cache entries (every key the recorded one), {len(autotune)} autotune results, "
        f"{len(not_shippable)} not shippable; not yet built: {not_built or 'none'}; wrote {out}")
    return manifest


def build_from_recording(a: argparse.Namespace) -> int:
    runtime = triton_aot.load_runtime(a.runtime)
    if runtime is not None and a.host_triton is None:
        raise UserError("--runtime: give --host-triton (its Triton wheel) too")
    device = triton_aot.load_runtime(a.device_of or a.runtime)
    with triton_aot.fixed_root() as scratch:
        image = triton_aot._image(scratch, a.base_tar, a.site_tree, a.site_packages, a.arch)
        triton_aot.fix_source_mtimes(image.site, a.source_date_epoch)
        identity = None
        if runtime is not None:
            identity = triton_aot.unpack_host_triton(a.host_triton, runtime, scratch / "host-triton")
            triton_aot.check_key_as(image, identity)
        t0 = time.monotonic()
        driver_module = None
        if a.userland:
            if runtime is not None:
                raise UserError("--userland: Triton's driver module is built for the image's Python; "
                                "drop it with --runtime")
            if not a.libcuda_path.startswith("/") or not a.cuda_home:
                raise UserError("--userland: give --cuda-home and an absolute --libcuda-path too "
                                "(image/constants.bzl TRITON_LIBCUDA_PATH)")

            def driver_module(cache_dir: Path) -> dict[str, Any]:
                module = triton_aot.build_driver_module(image, cache_dir, a.cuda_home, a.userland,
                                                        a.libcuda_path, a.site_packages)
                log(f"Triton's driver module {module['file']} ({module['key'][:12]}...) built with {module['compiler']}")
                return module
        build(a.recording, a.stack, a.arch, image, scratch, a.out, True, a.sglang_manifest, a.kernel_plan,
              runtime, identity, device, driver_module)
    log(f"rebuilt from {a.recording} in {time.monotonic() - t0:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.triton_recorded",
                                     description="first-use caches rebuilt from a recording")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-from-recording", help="Triton cache entries and autotune results of a recording")
    b.add_argument("--recording", type=Path, required=True, help="jit_cache/recordings/<stack>.<arch>.json")
    b.add_argument("--stack", required=True)
    b.add_argument("--arch", required=True, help="the recorded device's capability, X.Y")
    b.add_argument("--base-tar", type=Path, required=True, help="the image's Debian rootfs tar")
    b.add_argument("--site-tree", type=Path, action="append", required=True,
                   help="an image layer's installed tree (rooted at /); repeat, bottom layer first")
    b.add_argument("--site-packages", required=True, help="image/constants.bzl SITE_PACKAGES")
    b.add_argument("--sglang-manifest", type=Path, help="the SGLang JIT build the image ships (its directory)")
    b.add_argument("--kernel-plan", type=Path, help="the stack's kernel-cache plan (kernel_cache/plan_*.bzl)")
    b.add_argument("--runtime", type=Path, help="the recording ran another host's Triton: a JSON file with a "
                   "triton_runtime object (tools/gpu_suite/gpu_host.json)")
    b.add_argument("--host-triton", type=Path, help="with --runtime: its Triton wheel")
    b.add_argument("--device-of", type=Path, help="the stand-in answers as this file's triton_runtime device "
                   "(tools/gpu_suite/gpu_host.json; SGLang's kernels read its properties at import), keying "
                   "for the image's Triton")
    b.add_argument("--source-date-epoch", type=int, default=0,
                   help="the mtime given to the sources a kernel's line info names (image/constants.bzl)")
    b.add_argument("--cuda-home", help="with --userland: the pinned CUDA root (@kimi_cuda; its libcuda link stub)")
    b.add_argument("--userland", help="build Triton's driver module (cuda_utils) with the pinned compiler userland "
                   "(@kimi_cxx_userland), as the image needs it")
    b.add_argument("--libcuda-path", default="", help="with --userland: the image's TRITON_LIBCUDA_PATH")
    b.add_argument("--out", type=Path, required=True)
    a = parser.parse_args(argv)
    return build_from_recording(a)


if __name__ == "__main__":
    sys.exit(run_cli(main))
