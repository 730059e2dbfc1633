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
import re
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
from tools.common.jsondata import ANY, INTEGER, TEXT, ListOf, MapOf, Object, json_path, load_json_file
from tools.common.jsonfmt import review_json

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


# jit_cache/triton_calls.json: per stack, the calls whose Triton kernels are built ahead of time.
TRITON_CALLS = Object({
    "stacks": MapOf(ListOf(Object({"call": TEXT, "args": MapOf(ANY), "kernels": ListOf(TEXT, non_empty=True),
                                   "why": TEXT}))),
}, optional={"description": TEXT})


def load_calls(path: Path, stack: str, flag: str = "--calls", required: bool = True) -> list[dict[str, Any]]:
    """The stack's entries of jit_cache/triton_calls.json (given as `flag`), checked: each a
    `call` of triton_worker.py, its `args` object, the `kernels` it runs (`module:function`,
    sorted; the build checks them, the inventory marks their sites prebuilt) and a `why`. A
    stack the file does not list: [] unless `required`."""
    stacks = load_json_file(path, flag, TRITON_CALLS)["stacks"]
    if stack not in stacks:
        if not required:
            return []
        raise UserError(f"{flag} {path}: no stacks.{stack}; add it (a list of calls, [] for none)")
    entries = stacks[stack]
    seen = set()
    for i, entry in enumerate(entries):
        where = f"{flag} {path}: {json_path(['stacks', stack, i])}"
        kernels = entry["kernels"]
        if kernels != sorted(set(kernels)) or not all(k.count(":") == 1 and all(k.split(":")) for k in kernels):
            raise UserError(f"{where}: kernels must be the sorted \"module:function\" list of the Triton "
                            "kernels the call runs (build-triton names them when they differ)")
        if entry["call"] not in CALLS:
            raise UserError(f"{where}: call {entry['call']!r} is not one of {', '.join(CALLS)} "
                            "(tools/jit_cache/triton_worker.py CALLS)")
        if not entry["why"].strip():
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


def _device(arch: str, runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    if runtime is not None:
        device = runtime["device"]
        if f"{device['capability'][0]}.{device['capability'][1]}" != arch:
            raise UserError(f"--arch {arch}: the runtime's device is capability {device['capability']}; "
                            "build for its arch")
        return device
    if arch not in DEVICES:
        raise UserError(f"--arch {arch}: not one of {', '.join(DEVICES)} (another device: --runtime)")
    return DEVICES[arch]


RUNTIME_KEY = "triton_runtime"
# A --runtime file's (tools/gpu_suite/gpu_host.json) triton_runtime object (load_runtime says
# what each field is).
TRITON_RUNTIME = Object({
    "why": TEXT, "triton_wheel": TEXT, "python_include_deb": TEXT, "site_packages": TEXT, "libcuda_path": TEXT,
    # What Triton's driver.active.utils.get_device_properties(0) returns on the host.
    "device": Object({"capability": ListOf(INTEGER), "device_name": TEXT, "device_properties": MapOf(INTEGER)}),
})
# What this module reads of the file: its `python` and triton_runtime; the other fields are the
# GPU suite's.
RUNTIME_FILE = Object({"python": TEXT, RUNTIME_KEY: TRITON_RUNTIME}, other=ANY)


def load_runtime(path: Path | None) -> dict[str, Any] | None:
    """The `triton_runtime` object of PATH (tools/gpu_suite/gpu_host.json; None: the image's own
    runtime): another host's Triton, the same release as the image's as another CPython's build
    (triton_wheel: its file name), where it is installed (site_packages), the .deb of its
    Python's headers (python_include_deb; the Python is the file's `python`, X.Y), the
    TRITON_LIBCUDA_PATH it runs with, and its device as Triton reads it. Returned with `python`
    and its `ext_suffix` (the extension file suffix of CPython X.Y on x86-64 Linux) added."""
    if path is None:
        return None
    data = load_json_file(path, "--runtime", RUNTIME_FILE)
    python, runtime = data["python"], data[RUNTIME_KEY]
    if not re.fullmatch(r"3\.\d+", python):
        raise UserError(f"--runtime {path}: $.python: {python!r} is not a CPython X.Y; give the host's")
    for name in ("site_packages", "libcuda_path"):
        if not runtime[name].startswith("/"):
            raise UserError(f"--runtime {path}: {json_path([RUNTIME_KEY, name])}: {runtime[name]!r} is not an "
                            "absolute path")
    if len(runtime["device"]["capability"]) != 2:
        raise UserError(f"--runtime {path}: {json_path([RUNTIME_KEY, 'device', 'capability'])}: expected "
                        "[major, minor] (what Triton's driver.active.utils.get_device_properties(0) returns on "
                        "the host)")
    return dict(runtime, python=python, ext_suffix=f".cpython-{python.replace('.', '')}-x86_64-linux-gnu.so")


def unpack_host_triton(wheel: Path, runtime: dict[str, Any], out: Path) -> Path:
    """What Triton's triton_key() reads of the runtime's Triton (its compiler, backend and language
    sources and _C/libtriton.so), out of its wheel; returns OUT/triton."""
    import zipfile

    if wheel.name != runtime["triton_wheel"]:
        raise UserError(f"--host-triton {wheel}: not the runtime's Triton {runtime['triton_wheel']}")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("triton/")
                 and (n.endswith(".py") or n == "triton/_C/libtriton.so")]
        z.extractall(out, members=names)
    return out / "triton"


def unpack_python_headers(deb: Path, runtime: dict[str, Any], out: Path) -> Path:
    """The runtime Python's headers (its libpython3.X-dev .deb, dpkg-deb -x into out); returns
    out/usr/include/python3.X (the multiarch pyconfig.h it includes is below out/usr/include)."""
    from tools.fetch.debian import unpack_deb

    if deb.name != runtime["python_include_deb"]:
        raise UserError(f"--host-python-headers {deb}: not the runtime's {runtime['python_include_deb']}")
    unpack_deb(deb, out, f"--host-python-headers {deb}", "pass the runtime Python's libpython-dev .deb")
    header = out / "usr" / "include" / f"python{runtime['python']}" / "Python.h"
    if not header.is_file():
        raise UserError(f"--host-python-headers {deb}: holds no {header.relative_to(out)}; pass the "
                        "runtime Python's libpython-dev .deb")
    return header.parent


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
              what: str, identity: Path | None = None) -> list[dict[str, Any]]:
    """Each call in a fresh worker process (a server process starts with no autotune results in
    memory) over one TRITON_CACHE_DIR; returns the worker's rows. identity: another build of the
    same Triton release whose triton_key() the entries are keyed with (triton_worker.py)."""
    rows = []
    for i, entry in enumerate(calls):
        request = dict(device, calls=[{"call": entry["call"], **entry["args"]}],
                       result=str(image.scratch / f"{what}-{i}.json"),
                       triton_identity=str(identity) if identity else None)
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
    # Triton's own C modules and autotune results (triton_recorded.py): Triton looks them up as
    # <key>/<file> (no group file).
    for module in manifest.get("modules", []) + manifest.get("autotune", []):
        link = triton_cache_dir / module["key"] / module["file"]
        if link.exists():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(root / module["key"] / module["file"], link)
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



def build_driver_module(image: Any, cache_dir: Path, cuda_home: str, userland: str, libcuda_path: str,
                        site_packages: str, python_include: Path | None = None,
                        ext_suffix: str | None = None) -> dict[str, Any]:
    """Triton's driver module (`cuda_utils`, from triton/backends/nvidia/driver.c) in cache_dir,
    keyed as the image's Triton keys it: Triton builds it with the host's C compiler at the first
    launch of any kernel, and the image has no compiler and no Python headers. Built through
    Triton's own _compile_so under the image's python (triton_worker.py build_driver_module)
    with the pinned userland's gcc and Python headers and a link-time libcuda stub; the sources'
    paths are mapped to the image's, so the bytes do not depend on where the build ran."""
    from tools.jit_cache.sglang_aot import _tvm_ffi_identity
    from tools.kernel_cache.toolchain import _userland_shims, check_glibc_needed, load_toolchain, write_cuda_stubs

    tc = load_toolchain(cuda_home, userland, str(_tvm_ffi_identity(image.site, image.scratch / "tvm-ffi")))
    if tc.userland is None:
        raise UserError("--userland: not given; Triton's driver module is built with the pinned "
                        "userland's C compiler (@kimi_cxx_userland)")
    wrappers, libs = _userland_shims(tc.userland)
    stubs = write_cuda_stubs(tc, image.scratch / "cuda-stubs")
    # The stub defines no symbols, so with --as-needed (gcc's default here) the link would drop
    # libcuda.so.1 from the module's NEEDED, which a link against the real driver keeps.
    cc = image.scratch / "cc-no-as-needed"
    cc.write_text(f'#!/bin/sh\nexec "{wrappers / "cc"}" -Wl,--no-as-needed "$@"\n')
    cc.chmod(0o755)
    image_triton = site_packages.rstrip("/") + "/triton"
    maps = [*tc.prefix_maps(), (str(image.site / "triton"), image_triton)]
    if python_include is None:  # the image's python3.11: the userland's libpython3.11-dev
        includes = [f"-I{tc.python_include}"]
    else:  # another host's Python (its EXT_SUFFIX names the module); its pyconfig.h is multiarch
        includes = [f"-I{python_include}", f"-I{python_include.parent}"]
        maps.append((str(python_include.parents[2]), ""))  # the unpacked .deb's root
    maps.sort(key=lambda m: len(m[0]), reverse=True)
    compile_env = tc.env()
    request = {"driver_module": {"image_triton": image_triton, "link_dirs": [str(stubs)],
                                 "ext_suffix": ext_suffix,
                                 "ccflags": includes + [f"-ffile-prefix-map={a}={b}" for a, b in maps]}}
    result = image.run_worker(request, {
        "TRITON_CACHE_DIR": str(cache_dir), "TRITON_LIBCUDA_PATH": libcuda_path, "CC": str(cc),
        "PATH": compile_env["PATH"], "LD_LIBRARY_PATH": os.pathsep.join([image.env["LD_LIBRARY_PATH"], str(libs)]),
    }, "build-triton-driver-module", WORKER)
    if result["compiles"] != ["cuda_utils"]:
        raise UserError(f"build-triton: Triton built {result['compiles']} for its driver module, "
                        "expected exactly cuda_utils")
    so = cache_dir / result["key"] / result["file"]
    check_glibc_needed(so, tc, "build-triton driver module")
    return {"key": result["key"], "module": "cuda_utils", "file": result["file"],
            "sha256": sha256_file(so), "source": "triton/backends/nvidia/driver.c",
            "library_dirs": result["library_dirs"], "include_dirs": result["include_dirs"],
            "env": {"TRITON_LIBCUDA_PATH": libcuda_path}, "compiler": tc.cxx_version}


def check_key_as(image: Any, identity: Path) -> None:
    """The worker's key_as() gives Triton's own triton_key() when pointed at the image's Triton,
    and for the other build a key that differs from it only in libtriton.so's sha256 (the one
    file that differs between CPython builds of a release): else Triton changed what it keys on."""
    keys = image.run_worker({"triton_key_check": str(identity)}, {}, "build-triton-key-check", WORKER)
    own, other = keys["own"].split("-"), keys["other"].split("-")
    differing = [i for i, (a, b) in enumerate(zip(own, other)) if a != b]
    libtriton = sha256_file(identity / "_C" / "libtriton.so")
    if (keys["own_via_key_as"] != keys["own"] or len(own) != len(other) or len(differing) != 1
            or other[differing[0]] != libtriton):
        raise UserError(f"build-triton: Triton's key over {identity} is not this Triton's with one file's hash "
                        f"changed ({len(differing)} of {len(own)} parts differ); the runtime's Triton is not "
                        "the image's release, or Triton keys on more than its files: build on that host's Python")
    log(f"Triton key for the runtime's build: {len(own)} parts, 1 differs (libtriton.so)")


def ptxas_version(image: Any, arch: str) -> str:
    """`ptxas --version` of the image's Triton as its key holds it (the backend's hash): the
    GPU proof's stand-in ptxas answers this and compiles nothing."""
    code = ("import sys; from triton.backends.nvidia.compiler import get_ptxas_version; "
            f"sys.stdout.write(get_ptxas_version({int(arch.replace('.', ''))}))")
    proc = subprocess.run([str(image.python), "-c", code], env=image.env, capture_output=True, text=True)
    if proc.returncode != 0 or "release" not in proc.stdout:
        raise UserError(f"build-triton: the image's Triton gave no ptxas version ({proc.stderr.strip()[-300:]})")
    return proc.stdout


def build_triton(stack: str, arch: str, calls_file: Path, base_tar: Path, site_trees: Sequence[Path],
                 site_packages: str, out: Path, source_date_epoch: int = 0, cuda_home: str = "",
                 userland: str = "", libcuda_path: str = "", runtime_file: Path | None = None,
                 host_triton: Path | None = None, host_python_headers: Path | None = None) -> int:
    runtime = load_runtime(runtime_file)
    device = _device(arch, runtime)
    if runtime is not None:
        if host_triton is None or host_python_headers is None:
            raise UserError("--runtime: give --host-triton (its Triton wheel) and --host-python-headers "
                            "(its Python's libpython-dev .deb) too")
        libcuda_path = runtime["libcuda_path"]
    calls = [] if calls_file is None else load_calls(calls_file, stack)
    if not libcuda_path.startswith("/"):
        raise UserError(f"--libcuda-path {libcuda_path!r}: give the absolute TRITON_LIBCUDA_PATH the "
                        "image sets (image/constants.bzl TRITON_LIBCUDA_PATH)")
    t0 = time.monotonic()
    with fixed_root() as scratch:
        image = _image(scratch, base_tar, site_trees, site_packages, arch)
        fix_source_mtimes(image.site, source_date_epoch)
        cache_dir = scratch / "triton-cache"
        log(f"stack {stack}, arch {arch}: {len(calls)} call(s) through Triton's launch path "
            "(stand-in device, each call in a fresh process)")
        identity = None
        if runtime is not None:
            identity = unpack_host_triton(host_triton, runtime, scratch / "host-triton")
            check_key_as(image, identity)
            log(f"keyed for the runtime of {runtime_file}: Triton {host_triton.name} at "
                f"{runtime['site_packages']}, device {device['device_name']}")
        rows = run_calls(image, device, calls, cache_dir, "build-triton", identity)
        module = build_driver_module(
            image, cache_dir, cuda_home, userland, libcuda_path,
            runtime["site_packages"] if runtime else site_packages,
            unpack_python_headers(host_python_headers, runtime, scratch / "host-python") if runtime else None,
            runtime["ext_suffix"] if runtime else None)
        log(f"Triton's driver module {module['file']} ({module['key'][:12]}...) built with {module['compiler']}")
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
            "ptxas_version": ptxas_version(image, arch),
            "runtime": runtime,
            "entries": entries,
            "modules": [module],
        }
        with dir_replaced_atomically(out, "--out", tool=None) as tmp:
            for key, entry in entries.items():
                (tmp / key).mkdir()
                for name in entry["files"]:
                    shutil.copyfile(cache_dir / key / name, tmp / key / name)
                    (tmp / key / name).chmod(0o644)
            (tmp / module["key"]).mkdir()
            shutil.copyfile(cache_dir / module["key"] / module["file"], tmp / module["key"] / module["file"])
            (tmp / module["key"] / module["file"]).chmod(0o755)
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
    # Triton's driver module: whether the image's Triton finds it is checked in the image itself
    # (tools/image/triton_driver_check.py check_triton_driver: its key holds the image's paths); here, its bytes.
    for module in manifest.get("modules", []):
        so = cache / module["key"] / module["file"]
        if not so.is_file() or sha256_file(so) != module["sha256"]:
            raise UserError(f"check-triton: {so} is missing or not the sha256 {MANIFEST} records; rebuild "
                            "the cache (build-triton)")
    if [m.get("module") for m in manifest.get("modules", [])] != ["cuda_utils"]:
        raise UserError(f"check-triton: {MANIFEST} lists no cuda_utils module (Triton's driver module); "
                        "rebuild the cache (build-triton)")
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


def _common(p: argparse.ArgumentParser, calls: bool = True) -> None:
    p.add_argument("--stack", required=True)
    p.add_argument("--arch", required=True, help="12.0 (another: --runtime)")
    if calls:
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
    _common(b, calls=False)
    which = b.add_mutually_exclusive_group(required=True)
    which.add_argument("--calls", type=Path, help="jit_cache/triton_calls.json")
    which.add_argument("--driver-only", action="store_true", help="only Triton's driver module (cuda_utils)")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--cuda-home", required=True, help="the pinned CUDA root (@kimi_cuda; its libcuda link stub)")
    b.add_argument("--userland", required=True, help="the pinned compiler userland (@kimi_cxx_userland)")
    b.add_argument("--libcuda-path", required=True,
                   help="TRITON_LIBCUDA_PATH as the image sets it (image/constants.bzl): it enters the driver module's key")
    b.add_argument("--runtime", type=Path, help="key for another host's Triton: a JSON file with a "
                   "triton_runtime object (tools/gpu_suite/gpu_host.json)")
    b.add_argument("--host-triton", type=Path, help="with --runtime: its Triton wheel")
    b.add_argument("--host-python-headers", type=Path, help="with --runtime: its Python's libpython-dev .deb")
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
                            a.source_date_epoch, a.cuda_home, a.userland, a.libcuda_path, a.runtime,
                            a.host_triton, a.host_python_headers)
    if a.command == "check-triton":
        return check_triton(a.stack, a.arch, a.calls, a.base_tar, a.site_tree, a.site_packages, a.cache)
    print(f"bound {bind(a.cache, a.triton_cache_dir)} entries of {a.cache} into {a.triton_cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
