"""The build without Bazel: every object of the plan, in parallel within a memory budget,
content-addressed in a shared cache directory (each file reused only when it matches its sha256
record), so an interrupted build resumes; then link and assemble as the Bazel actions do."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.files import check_replaceable_dir, write_text_atomic
from tools.common.hashing import sha256_bytes, sha256_file
from tools.common.progress import ItemProgress
from tools.kernel_cache.actions import Fill, assemble, check_nvcc, compile_one, link_one
from tools.kernel_cache.plan import describe_drift, make_plan, read_plan, select_modules
from tools.kernel_cache.selection import FULL
from tools.kernel_cache.toolchain import Toolchain, write_cuda_stubs
from tools.kernel_cache.tree import AOT_SUBDIR, check_tree, log

# Every object and module in the build cache has a record beside it, <file>.sha256 (JSON: size
# and sha256), written atomically after the file itself. A file is reused only when it matches
# its record: a file without one (a run killed between the two renames, a cache from before
# records) or one that differs (truncated, corrupted, overwritten) is rebuilt, never linked.
RECORD_SUFFIX = ".sha256"
# The Bazel-free build's --out is its own output (marked): a rerun (the GPU host's) replaces it.
BUILD_TOOL = "tools.kernel_cache build"


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def write_record(path: Path) -> None:
    write_text_atomic(record_path(path), json.dumps(
        {"size": path.stat().st_size, "sha256": sha256_file(path)}, sort_keys=True) + "\n")


def cached_file_ok(path: Path) -> bool:
    """True when `path` exists and matches its record; otherwise says why it is rebuilt."""
    if not path.exists():
        return False
    try:
        want = json.loads(record_path(path).read_text())
        size, digest = int(want["size"]), str(want["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        log(f"cached {path.name}: no valid {RECORD_SUFFIX} record beside it; rebuilding it")
        return False
    have = path.stat().st_size
    if have != size:
        log(f"cached {path.name}: {have} bytes, its record says {size} (truncated or corrupt); "
            "rebuilding it")
        return False
    if sha256_file(path) != digest:
        log(f"cached {path.name}: sha256 differs from its record (corrupt); rebuilding it")
        return False
    return True


def compile_to_cache(module: Mapping[str, Any], obj: Mapping[str, Any], fill: Fill, out: Path,
                     nice: int) -> float:
    secs = compile_one(module, obj, fill, out, nice)
    write_record(out)
    return secs


def object_key(plan: Mapping[str, Any], module: Mapping[str, Any], obj: Mapping[str, Any],
               tc_digest: str) -> str:
    """Content address of one object: its command (host-independent, with placeholders), the
    whole patched tree (covers every header), the module's generated sources, the toolchain."""
    material = {"args": obj["args"], "src": obj["src"],
                "patched_source_digest": plan["patched_source_digest"],
                "gen_digest": module["gen_digest"], "toolchain": tc_digest}
    return sha256_bytes(json.dumps(material, sort_keys=True).encode())


@dataclasses.dataclass
class Job:
    module: dict[str, Any]
    obj: dict[str, Any]
    key: str
    path: Path


def run_jobs(jobs: list[Job], fill_for: Callable[[Job], Fill], jobs_n: int, mem_budget_mb: int,
             nice: int, progress: ItemProgress) -> None:
    """Start the biggest objects first; never exceed the memory budget (one always runs)."""
    pending = sorted(jobs, key=lambda j: -j.obj["mem_mb"])
    running: dict[concurrent.futures.Future[float], Job] = {}
    used = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs_n)) as pool:
        while pending or running:
            while pending and len(running) < jobs_n:
                fit = next((j for j in pending if not running or
                            used + j.obj["mem_mb"] <= mem_budget_mb), None)
                if fit is None:
                    break
                pending.remove(fit)
                used += fit.obj["mem_mb"]
                running[pool.submit(compile_to_cache, fit.module, fit.obj, fill_for(fit),
                                    fit.path, nice)] = fit
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                job = running.pop(fut)
                used -= job.obj["mem_mb"]
                progress.tick(f"{job.module['name']}/{job.obj['out']}", fut.result())


def build(tree: Path, modules_path: Path, arch: str, variant: str, out: Path, jobs_n: int,
          cache_dir: Path, tc: Toolchain, mem_budget_mb: int, nice: int,
          plan_path: Path | None = None, only: Sequence[str] = (), selection: str = FULL,
          selections_path: Path | None = None) -> dict[str, Any]:
    """Objects and modules are shared through cache_dir (content-addressed, each checked against
    its record before reuse); generated sources and link stubs are this run's own: another build
    may be using the same cache (and tree) at the same time."""
    check_replaceable_dir(out, "--out", BUILD_TOOL)  # before any compile
    tree = check_tree(tree)
    (cache_dir / "gen").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{sha256_bytes(str(tree).encode())[:16]}-",
                                    dir=cache_dir / "gen"))
    try:
        return _build_in(tree, modules_path, arch, variant, out, jobs_n, cache_dir, tc,
                         mem_budget_mb, nice, plan_path, only, run_dir, selection,
                         selections_path)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _build_in(tree: Path, modules_path: Path, arch: str, variant: str, out: Path, jobs_n: int,
              cache_dir: Path, tc: Toolchain, mem_budget_mb: int, nice: int,
              plan_path: Path | None, only: Sequence[str], run_dir: Path, selection: str,
              selections_path: Path | None) -> dict[str, Any]:
    gen_root = run_dir / "gen"
    plan = make_plan(tree, modules_path, arch, variant, tc, gen_out=gen_root,
                     selection=selection, selections_path=selections_path)
    if plan_path is not None:
        drift = describe_drift(read_plan(plan_path), plan)
        if drift:
            raise UserError(f"--plan {plan_path}: drift from the tree: {drift}; regenerate it")
    plan = select_modules(plan, only)
    check_nvcc(plan, tc)
    tc_digest = tc.digest()
    jobs: list[Job] = []
    for m in plan["modules"]:
        for o in m["objects"]:
            key = object_key(plan, m, o, tc_digest)
            jobs.append(Job(m, o, key, cache_dir / "objects" / key[:2] / f"{key}.o"))
    todo = [j for j in jobs if not cached_file_ok(j.path)]
    log(f"{len(jobs)} objects in {len(plan['modules'])} modules; {len(jobs) - len(todo)} cached, "
        f"{len(todo)} to compile with -j {jobs_n} (memory budget {mem_budget_mb} MiB)")
    # One line per compiled object: `[kernel_cache] n/total objects  what secs  elapsed  ETA`.
    progress = ItemProgress("[kernel_cache] ", len(jobs), already=len(jobs) - len(todo),
                            unit="objects")
    run_jobs(todo, lambda j: Fill(tree, gen_root / j.module["name"], tc), jobs_n, mem_budget_mb,
             nice, progress)
    stub_dir = write_cuda_stubs(tc, run_dir / "stubs")
    sos: dict[str, Path] = {}
    for m in plan["modules"]:
        objs = [j.path for j in jobs if j.module is m]
        # The objects' keys, not only their names: a kernel selection's objects share names
        # with the full plan's (e.g. the binding) while their contents differ.
        link_key = sha256_bytes(json.dumps(
            {"link": m["link"], "objects": [p.name for p in objs], "tc": tc_digest,
             "object_keys": [j.key for j in jobs if j.module is m]},
            sort_keys=True).encode())
        so = cache_dir / "modules" / link_key[:2] / f"{link_key}.so"
        if not cached_file_ok(so):
            log(f"linking {m['name']} ({len(objs)} objects)")
            link_one(m, Fill(tree, gen_root / m["name"], tc), objs, so, stub_dir)
            write_record(so)
        sos[m["name"]] = so
    data = assemble(plan, tc, sos, out, tool=BUILD_TOOL)
    log(f"wrote {out / AOT_SUBDIR} ({len(sos)} modules) in {time.monotonic() - progress.t0:.0f}s")
    return data
