"""Triton kernels of SGLang's serving path built ahead of time, in Triton's cache layout (issue #27).

    python3 -m tools.jit_cache.triton_aot build-triton --stack S --arch 12.0 --calls FILE
        --base-tar BASE.tar --site-tree DIR... --site-packages /usr/local/lib/python3.X/dist-packages --out OUT
    python3 -m tools.jit_cache.triton_aot check-triton (the same inputs) --cache OUT
    python3 -m tools.jit_cache.triton_aot bind --cache OUT --triton-cache-dir DIR

How: tools/jit_cache/triton_worker.py runs each call of FILE (jit_cache/triton_calls.json: SGLang's
own functions with tensors of the serving call's dtypes and shapes) under the image's python3.11
over the image's installed trees, with Triton's launch path against a stand-in device of the arch,
each call in a fresh process: Triton computes every key and compiles every config an autotuner
keeps. The image's tree sits at one fixed path for every build and the sources' mtimes are one
constant (the kernels' line info holds each source's path, mtime and size), so two output roots
give the same bytes.

OUT holds, per Triton cache entry, `<key>/<kernel>.cubin` and `<key>/<kernel>.json` (what a cache
hit reads) and `kimi-k3-triton.json` (entries, their files' sha256, the calls, the stand-in
device). Not shipped: Triton's group files (`__grp__<kernel>.json`, absolute paths: `bind` writes
them where the runtime's TRITON_CACHE_DIR is, pointing into OUT wherever it lies), the IR files a
hit does not read, and autotune results (the stand-in's timings are not a GPU's: the runtime's
autotuner benchmarks every config, each one a cache hit).

check-triton: the same calls in a fresh process over a TRITON_CACHE_DIR bound to a read-only copy
of OUT must compile nothing and hit every entry.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically, read_only_copy, write_bytes_atomic
from tools.common.hashing import sha256_file
from tools.common.jsonfmt import loads_unique_keys, review_json

WORKER = Path(__file__).with_name("triton_worker.py")
MANIFEST = "kimi-k3-triton.json"
SCHEMA_VERSION = 1
# The stand-in devices: what Triton and SGLang's FLA helpers read of a GPU (target, opt-in shared
# memory per block, SM count: autotune pruning and block sizes). 12.0: an RTX PRO 6000 Blackwell.
DEVICES = {
    "12.0": {"capability": [12, 0], "device_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition",
             "device_properties": {"max_shared_mem": 101376, "max_num_regs": 65536,
                                   "multiprocessor_count": 188, "warpSize": 32,
                                   "sm_clock_rate": 2400000, "mem_clock_rate": 14001000,
                                   "mem_bus_width": 512}},
}
CALLS = ("sglang_kda_prefill",)  # triton_worker.py CALLS
# Where every build puts the image's tree (see the module docstring); one build at a time holds it.
FIXED_ROOT = Path("/tmp/kimi-k3-triton-build")
# The packages whose Python sources a kernel's line info names: their .py files are copied into
# the build's tree with one fixed mtime, since the debug line table records each source's mtime
# and size (the installed trees' mtimes are whenever a layer action ran).
SOURCE_PACKAGES = ("sglang", "triton")
SHIPPED_SUFFIXES = (".cubin", ".json")


def log(msg: str) -> None:
    print(f"jit_cache: {msg}", file=sys.stderr, flush=True)


def load_calls(path: Path, stack: str) -> list[dict[str, Any]]:
    """The stack's entries of jit_cache/triton_calls.json, checked: each a `call` of
    triton_worker.py, its `args` object, the `kernels` it runs (`module:function`, sorted; the
    build checks them, the inventory marks their sites prebuilt) and a `why`."""
    try:
        data = loads_unique_keys(path.read_text(), str(path))
    except OSError as e:
        raise UserError(f"--calls {path}: cannot read ({e.strerror})") from None
    stacks = data.get("stacks") if isinstance(data, dict) else None
    if not isinstance(stacks, dict) or stack not in stacks:
        raise UserError(f"--calls {path}: no stacks.{stack}; add it (a list of calls, [] for none)")
    entries = stacks[stack]
    if not isinstance(entries, list):
        raise UserError(f"--calls {path}: stacks.{stack} is not a list")
    seen = set()
    for i, entry in enumerate(entries):
        where = f"--calls {path}: stacks.{stack}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"call", "args", "kernels", "why"}:
            raise UserError(f"{where}: an object of call, args, kernels, why")
        kernels = entry["kernels"]
        if not isinstance(kernels, list) or not kernels or kernels != sorted(set(kernels)) or not all(
                isinstance(k, str) and k.count(":") == 1 and all(k.split(":")) for k in kernels):
            raise UserError(f"{where}: kernels must be the sorted \"module:function\" list of the Triton "
                            "kernels the call runs (build-triton names them when they differ)")
        if entry["call"] not in CALLS:
            raise UserError(f"{where}: call {entry['call']!r} is not one of {', '.join(CALLS)} "
                            "(tools/jit_cache/triton_worker.py CALLS)")
        if not isinstance(entry["args"], dict):
            raise UserError(f"{where}: args is not an object")
        if not isinstance(entry["why"], str) or not entry["why"].strip():
            raise UserError(f"{where}: why is empty: say which serving path makes this call")
        key = json.dumps([entry["call"], entry["args"]], sort_keys=True)
        if key in seen:
            raise UserError(f"{where}: listed twice; delete one")
        seen.add(key)
    return entries


def kernel_sites(calls: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(file in the SGLang tree, function) of each listed kernel -> the calls that run it, each
    {"call", "args"}: the inventory marks these sites prebuilt, the launch-profile check looks
    them up."""
    sites: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for entry in calls:
        for kernel in entry["kernels"]:
            module, _, function = kernel.partition(":")
            sites.setdefault((module.replace(".", "/") + ".py", function), []).append(
                {"call": entry["call"], "args": entry["args"]})
    return sites


def _device(arch: str) -> dict[str, Any]:
    if arch not in DEVICES:
        raise UserError(f"--arch {arch}: not one of {', '.join(DEVICES)}")
    return DEVICES[arch]


@contextmanager
def fixed_root() -> Iterator[Path]:
    """FIXED_ROOT, emptied, held for this build (concurrent builds wait for it)."""
    FIXED_ROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{FIXED_ROOT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(FIXED_ROOT, ignore_errors=True)
        FIXED_ROOT.mkdir()
        try:
            yield FIXED_ROOT
        finally:
            shutil.rmtree(FIXED_ROOT, ignore_errors=True)


def fix_source_mtimes(site: Path, epoch: int, packages: Sequence[str] = SOURCE_PACKAGES) -> int:
    """Replace each package's link in the merged site by a tree of its own: .py files copied with
    mtime `epoch`, every other file a link to the installed one; returns the files copied."""
    copied = 0
    for package in packages:
        top = site / package
        if not top.exists():
            raise UserError(f"--site-tree: no {package} package in the image's trees")
        fixed = site / f".{package}.fixed"
        for dirpath, _dirnames, filenames in os.walk(top, followlinks=True):
            rel = Path(dirpath).relative_to(top)
            (fixed / rel).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                src, dst = Path(dirpath) / name, fixed / rel / name
                if name.endswith(".py"):
                    shutil.copyfile(src, dst)
                    os.utime(dst, (epoch, epoch))
                    copied += 1
                else:
                    os.symlink(src.resolve(), dst)
        if top.is_symlink():
            top.unlink()
        else:  # a directory merged from several trees: links only
            shutil.rmtree(top)
        fixed.rename(top)
    return copied


def run_calls(image: Any, device: dict[str, Any], calls: Sequence[dict[str, Any]], cache_dir: Path,
              what: str) -> list[dict[str, Any]]:
    """Each call in a fresh worker process (a server process starts with no autotune results in
    memory) over one TRITON_CACHE_DIR; returns the worker's rows."""
    rows = []
    for i, entry in enumerate(calls):
        request = dict(device, calls=[{"call": entry["call"], **entry["args"]}],
                       result=str(image.scratch / f"{what}-{i}.json"))
        path = image.scratch / f"{what}-{i}-request.json"
        path.write_text(json.dumps(request))
        proc = subprocess.run([str(image.python), str(WORKER), str(path)],
                              env=dict(image.env, TRITON_CACHE_DIR=str(cache_dir)),
                              capture_output=True, text=True)
        if proc.returncode != 0 or not Path(request["result"]).is_file():
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
            raise UserError(f"{what}: the Triton worker failed on {entry['call']} {entry['args']} "
                            f"(exit {proc.returncode}); see its output above")
        [row] = json.loads(Path(request["result"]).read_text())["passes"][0]
        if "error" in row:
            sys.stderr.write(row.get("traceback", ""))
            raise UserError(f"{what}: {entry['call']} {entry['args']}: {row['error']}")
        rows.append(row)
    return rows


def shipped_entries(cache_dir: Path) -> dict[str, dict[str, Any]]:
    """{key: {"kernel", "files": {name: sha256}}} of Triton's cache: each entry's group file
    names its kernel; only the files a hit reads are kept; autotune results are left out."""
    entries: dict[str, dict[str, Any]] = {}
    for key_dir in sorted(p for p in cache_dir.iterdir() if p.is_dir()):
        groups = sorted(key_dir.glob("__grp__*.json"))
        if not groups:
            continue  # an autotune result (<fn>.autotune.json) or an unfinished entry
        if len(groups) != 1:
            raise UserError(f"{key_dir}: {len(groups)} group files; expected one per cache entry")
        kernel = groups[0].name[len("__grp__"):-len(".json")]
        children = json.loads(groups[0].read_text())["child_paths"]
        files = {}
        for name in sorted(children):
            if name.endswith(SHIPPED_SUFFIXES) and name != f"{kernel}.autotune.json":
                files[name] = sha256_file(key_dir / name)
        if {f"{kernel}.cubin", f"{kernel}.json"} - set(files):
            raise UserError(f"{key_dir}: {kernel} has no .cubin and .json; not a compiled kernel")
        entries[key_dir.name] = {"kernel": kernel, "files": files}
    return entries


def bind(cache: Path, triton_cache_dir: Path) -> int:
    """Write, for every entry of CACHE's manifest, TRITON_CACHE_DIR/<key>/__grp__<kernel>.json
    naming CACHE's files by absolute path: Triton then takes CACHE's files as its own hits. An
    entry the directory already has is left as it is; returns how many were written."""
    manifest = read_manifest(cache)
    root = cache.absolute()
    written = 0
    for key, entry in manifest["entries"].items():
        group = triton_cache_dir / key / f"__grp__{entry['kernel']}.json"
        if group.exists():
            continue
        group.parent.mkdir(parents=True, exist_ok=True)
        children = {name: str(root / key / name) for name in entry["files"]}
        write_bytes_atomic(group, json.dumps({"child_paths": children}).encode())
        written += 1
    return written


def read_manifest(cache: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((cache / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--cache {cache}: no readable {MANIFEST} ({e}); pass build-triton's "
                        "output") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"--cache {cache}: {MANIFEST} is not schema {SCHEMA_VERSION}; rebuild it")
    return manifest


def _image(scratch: Path, base_tar: Path, site_trees: Sequence[Path], site_packages: str, arch: str) -> Any:
    from tools.jit_cache.sglang_aot import ImagePython

    return ImagePython(scratch, base_tar, site_trees, site_packages, arch)



def build_triton(stack: str, arch: str, calls_file: Path, base_tar: Path, site_trees: Sequence[Path],
                 site_packages: str, out: Path, source_date_epoch: int = 0) -> int:
    device = _device(arch)
    calls = load_calls(calls_file, stack)
    t0 = time.monotonic()
    with fixed_root() as scratch:
        image = _image(scratch, base_tar, site_trees, site_packages, arch)
        fix_source_mtimes(image.site, source_date_epoch)
        cache_dir = scratch / "triton-cache"
        log(f"stack {stack}, arch {arch}: {len(calls)} call(s) through Triton's launch path "
            "(stand-in device, each call in a fresh process)")
        rows = run_calls(image, device, calls, cache_dir, "build-triton")
        for entry, row in zip(calls, rows):
            ran = sorted(set(row["compiled"]) | set(row["hits"]))
            if ran != entry["kernels"]:
                missing = sorted(set(ran) - set(entry["kernels"]))
                extra = sorted(set(entry["kernels"]) - set(ran))
                raise UserError(f"--calls {calls_file}: {entry['call']} {entry['args']} runs "
                                f"{', '.join(missing) or 'no kernel'} not in its kernels, and not "
                                f"{', '.join(extra) or 'every listed one'}; set its kernels to {json.dumps(ran)}")
        entries = shipped_entries(cache_dir)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "description": "Triton cache entries built ahead of time by tools/jit_cache/triton_aot.py "
                           "(SGLang's own calls through Triton's launch path, stand-in device); "
                           "bind them into TRITON_CACHE_DIR with `python3 -m "
                           "tools.jit_cache.triton_aot bind`.",
            "stack": stack,
            "arch": arch,
            "device": device,
            "calls": [dict(c, compiled=len(r["compiled"])) for c, r in zip(calls, rows)],
            "entries": entries,
        }
        with dir_replaced_atomically(out, "--out") as tmp:
            for key, entry in entries.items():
                (tmp / key).mkdir()
                for name in entry["files"]:
                    shutil.copyfile(cache_dir / key / name, tmp / key / name)
                    (tmp / key / name).chmod(0o644)
            (tmp / MANIFEST).write_bytes(review_json(manifest))
    total = sum(r_len for r_len in (len(r["compiled"]) for r in rows))
    log(f"built {len(entries)} Triton cache entries ({total} compiles) for {arch} in "
        f"{time.monotonic() - t0:.0f} s; wrote {out}")
    return 0


def check_triton(stack: str, arch: str, calls_file: Path, base_tar: Path, site_trees: Sequence[Path],
                 site_packages: str, cache: Path) -> int:
    device = _device(arch)
    calls = load_calls(calls_file, stack)
    from tools.jit_cache.sglang_aot import check_built_for

    manifest = read_manifest(cache)
    check_built_for(manifest, cache, stack, arch)
    with tempfile.TemporaryDirectory(prefix="triton-check-") as scratch_dir:
        scratch = Path(scratch_dir)
        image = _image(scratch, base_tar, site_trees, site_packages, arch)
        with read_only_copy(cache, scratch / "shipped") as shipped:
            triton_cache_dir = scratch / "triton-cache"
            bind(shipped, triton_cache_dir)
            rows = run_calls(image, device, calls, triton_cache_dir, "check-triton")
    failed = 0
    for entry, row in zip(calls, rows):
        if row["compiled"]:
            print(f"jit_cache: {entry['call']} {entry['args']}: Triton compiled "
                  f"{', '.join(sorted(set(row['compiled'])))}, which the cache lacks", file=sys.stderr)
            failed += 1
        else:
            log(f"{entry['call']} {entry['args']}: {len(row['hits'])} kernels, every one a hit")
    hit = sum(len(r["hits"]) for r in rows)
    if failed:
        raise UserError(f"check-triton: {failed} of {len(calls)} call(s) compiled; rebuild the cache "
                        "(build-triton) from the same trees and calls")
    if hit < len(manifest["entries"]):
        raise UserError(f"check-triton: the calls hit {hit} entries, the cache ships "
                        f"{len(manifest['entries'])}; rebuild it from the same calls")
    log(f"{len(calls)} call(s): {hit} Triton cache hits, 0 compiles ({arch})")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack", required=True)
    p.add_argument("--arch", required=True, help="12.0")
    p.add_argument("--calls", type=Path, default=Path("jit_cache/triton_calls.json"))
    p.add_argument("--base-tar", type=Path, required=True, help="the image's Debian rootfs tar")
    p.add_argument("--site-tree", type=Path, action="append", required=True,
                   help="an image layer's installed tree (rooted at /); repeat, bottom layer first")
    p.add_argument("--site-packages", required=True, help="image/constants.bzl SITE_PACKAGES")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.triton_aot",
                                     description="Triton kernels ahead of time")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-triton", help="compile the calls' Triton kernels into Triton's cache layout")
    _common(b)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--source-date-epoch", type=int, default=0,
                   help="the mtime given to the sources a kernel's line info names (image/constants.bzl SOURCE_DATE_EPOCH)")
    c = sub.add_parser("check-triton", help="the calls again over the bound cache: 0 compiles")
    _common(c)
    c.add_argument("--cache", type=Path, required=True)
    d = sub.add_parser("bind", help="write the group files that make TRITON_CACHE_DIR take a built cache")
    d.add_argument("--cache", type=Path, required=True)
    d.add_argument("--triton-cache-dir", type=Path, required=True)
    a = parser.parse_args(argv)
    if a.command == "build-triton":
        return build_triton(a.stack, a.arch, a.calls, a.base_tar, a.site_tree, a.site_packages, a.out,
                            a.source_date_epoch)
    if a.command == "check-triton":
        return check_triton(a.stack, a.arch, a.calls, a.base_tar, a.site_tree, a.site_packages, a.cache)
    print(f"bound {bind(a.cache, a.triton_cache_dir)} entries of {a.cache} into {a.triton_cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
