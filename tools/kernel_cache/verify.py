"""Verification of a built cache: kernel_cache.json against the tree (source digest, source
markers, every declared module present), each module's sha256, its device code (cuobjdump: the
expected sm_XY ELF and nothing else), and resolution through FlashInfer's own lookup in a clean
environment with FLASHINFER_DISABLE_JIT=1 (FlashInfer must load it and refuse to compile)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_file
from tools.kernel_cache.actions import CACHE_JSON_NAME, CACHE_JSON_SCHEMA
from tools.kernel_cache.modules import check_markers, expected_sm, load_modules
from tools.kernel_cache.toolchain import Toolchain
from tools.kernel_cache.tree import AOT_SUBDIR, check_tree, flashinfer_source_digest

def find_cuobjdump(tc: Toolchain | None, explicit: str | None) -> str:
    candidates = [explicit] if explicit else []
    if tc is not None:
        candidates += [str(tc.cuda_home / "bin" / "cuobjdump")]
    spec = importlib.util.find_spec("nvidia")
    if spec and spec.submodule_search_locations:
        candidates += [str(Path(p) / "cu13" / "bin" / "cuobjdump")
                       for p in spec.submodule_search_locations]
    candidates.append(shutil.which("cuobjdump") or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise UserError("cuobjdump: not found; install the nvidia-cuda-cuobjdump wheel or pass "
                    "--cuobjdump PATH")


def elf_archs(cuobjdump: str, so: Path) -> list[str]:
    proc = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{so}: cuobjdump --list-elf failed: {proc.stderr.strip()[:200]}")
    return re.findall(r"\.(sm_\d+[a-z]?)\.cubin", proc.stdout)


def check_elf(cuobjdump: str, so: Path, arch: str) -> list[str]:
    found = elf_archs(cuobjdump, so)
    want = set(expected_sm(arch))
    if not found:
        raise UserError(f"{so}: no device ELF (cubin) inside; rebuild for arch {arch}")
    wrong = sorted(set(found) - want)
    if wrong or not want <= set(found):
        raise UserError(f"{so}: device code for {sorted(set(found))}, expected {sorted(want)} "
                        f"(arch {arch}); rebuild the cache with --arch {arch}")
    return sorted(set(found))


def merged_view(tree: Path, cache: Path, dest: Path) -> Path:
    """A package view = tree + cache's aot/, for a clean-env import. Python files are copied
    (FlashInfer finds its data dir from Path(__file__).resolve(), which would follow symlinks
    back into the tree); data/ entries are symlinked."""
    pkg = dest / "flashinfer"
    shutil.copytree(tree / "flashinfer", pkg, ignore=lambda d, names:
                    ["data"] if Path(d) == tree / "flashinfer" else
                    [n for n in names if n == "__pycache__"])
    (pkg / "data").mkdir()
    for entry in sorted((tree / "flashinfer" / "data").iterdir()):
        if entry.name != "aot":
            os.symlink(entry, pkg / "data" / entry.name)
    os.symlink((cache / AOT_SUBDIR).absolute(), pkg / "data" / "aot")
    return dest


_RESOLVE_PROBE = r"""
import importlib, json, os, sys
from pathlib import Path
req = json.loads(sys.stdin.read())
import flashinfer
from flashinfer.jit import env as jit_env
from flashinfer.jit.core import MissingJITCacheError
out = {"package": str(Path(flashinfer.__file__).parent), "aot_dir": str(jit_env.FLASHINFER_AOT_DIR),
       "modules": {}}
for m in req["modules"]:
    mod, fn = m["generator"].split(":")
    spec = getattr(importlib.import_module(mod), fn)(**m["kwargs"])
    r = {"name": spec.name, "aot_path": str(spec.aot_path), "is_aot": spec.is_aot,
         "loaded": False, "load_error": "", "jit_refused": False}
    try:
        spec.load(spec.aot_path)
        r["loaded"] = True
    except Exception as e:
        r["load_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        spec.build()  # must refuse: FLASHINFER_DISABLE_JIT=1
    except MissingJITCacheError:
        r["jit_refused"] = True
    out["modules"][m["name"]] = r
out["jit_dir_has_so"] = any(jit_env.FLASHINFER_JIT_DIR.rglob("*.so")) if jit_env.FLASHINFER_JIT_DIR.exists() else False
json.dump(out, sys.stdout)
"""


def resolve_in_clean_env(tree: Path, cache: Path, data: Mapping[str, Any], python: str,
                         cuda_home: Path, extra_lib_dirs: Sequence[str],
                         driver_stub_dir: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kc-verify-") as tmp:
        view = merged_view(tree, cache, Path(tmp) / "view")
        lib_path = [str(cuda_home / "lib64"), *extra_lib_dirs]
        lib_path += [str(driver_stub_dir)] if driver_stub_dir else []
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp,
               "PYTHONPATH": str(view), "PYTHONNOUSERSITE": "1",
               "FLASHINFER_DISABLE_JIT": "1", "FLASHINFER_CUDA_ARCH_LIST": data["arch_list"],
               "FLASHINFER_WORKSPACE_BASE": str(Path(tmp) / "ws"), "CUDA_HOME": str(cuda_home),
               "LD_LIBRARY_PATH": os.pathsep.join(lib_path)}
        req = {"modules": [{"name": n, "generator": m["generator"], "kwargs": m["kwargs"]}
                           for n, m in sorted(data["modules"].items())]}
        proc = subprocess.run([python, "-s", "-c", _RESOLVE_PROBE], input=json.dumps(req),
                              capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise UserError(f"--cache {cache}: clean-env import failed:\n{tail}")
        result = json.loads(proc.stdout)
        expected_aot = (view / AOT_SUBDIR).resolve()
        if Path(result["aot_dir"]).resolve() != expected_aot:
            raise UserError(f"--cache {cache}: FlashInfer looks up AOT modules in "
                            f"{result['aot_dir']} (a flashinfer_jit_cache package shadows the "
                            "cache?); uninstall flashinfer-jit-cache from the runtime")
        return result


def verify(cache: Path, tree: Path, modules_path: Path | None, python: str, tc: Toolchain,
           cuobjdump: str | None, require_load: bool, driver_stub: bool,
           arch: str | None = None, only: Sequence[str] = ()) -> dict[str, Any]:
    tree = check_tree(tree)
    aot = cache / AOT_SUBDIR
    try:
        data = json.loads((aot / CACHE_JSON_NAME).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--cache {cache}: no readable {AOT_SUBDIR / CACHE_JSON_NAME} ({e}); "
                        "build the cache first") from None
    if data.get("schema_version") != CACHE_JSON_SCHEMA:
        raise UserError(f"--cache {cache}: kernel_cache.json schema {data.get('schema_version')}, "
                        f"expected {CACHE_JSON_SCHEMA}; rebuild the cache")
    if arch is not None and arch != data["arch_list"]:
        raise UserError(f"--cache {cache}: built for arch {data['arch_list']}, required {arch}; "
                        f"rebuild it with --arch {arch}")
    digest = flashinfer_source_digest(tree)
    if digest != data["patched_source_digest"]:
        raise UserError(f"--cache {cache}: built from sources {data['patched_source_digest'][:16]}, "
                        f"but --flashinfer-tree is {digest[:16]}; stale or unpatched cache, rebuild "
                        "it from this tree")
    decls = load_modules(modules_path) if modules_path else []
    if only:
        unknown = sorted(set(only) - {d.name for d in decls})
        if unknown:
            raise UserError(f"--only {','.join(unknown)}: not declared in {modules_path}")
        decls = [d for d in decls if d.name in only]
    check_markers(tree, decls)
    for d in decls:
        if d.applies_to(data["arch_list"]) and d.name not in data["modules"]:
            raise UserError(f"--cache {cache}: module {d.name} (in {modules_path}) is missing; "
                            "rebuild the cache with it")
    objdump = find_cuobjdump(tc, cuobjdump)
    report: dict[str, Any] = {"modules": {}}
    for name, m in sorted(data["modules"].items()):
        so = aot / m["path"]
        if not so.is_file():
            raise UserError(f"--cache {cache}: module {name}: {m['path']} missing; rebuild")
        if sha256_file(so) != m["sha256"]:
            raise UserError(f"--cache {cache}: module {name}: sha256 differs from "
                            f"{CACHE_JSON_NAME}; the file was altered, rebuild")
        report["modules"][name] = {"elf": check_elf(objdump, so, data["arch_list"])}
    cuda_home = tc.cuda_home
    with tempfile.TemporaryDirectory(prefix="kc-driver-") as stub_tmp:
        stub_dir = None
        if driver_stub:
            # No GPU driver on CPU hosts: an empty libcuda.so.1 lets the loader resolve the
            # DT_NEEDED entry so a module that calls no driver symbol at load time can load.
            stub_dir = Path(stub_tmp)
            (stub_dir / "e.c").write_text("\n")
            cc = ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                  str(stub_dir / "libcuda.so.1"), str(stub_dir / "e.c")]
            proc = tc.run(cc)
            if proc.returncode != 0:
                raise UserError(f"--driver-stub: cc failed: {proc.stderr.strip()[-300:]}")
        # The CUDA root's libraries (nvrtc, cublas: the modules' DT_NEEDED beside libcuda).
        extra_libs = [str(cuda_home / "lib")] if (cuda_home / "lib").is_dir() else []
        res = resolve_in_clean_env(tree, cache, data, python, cuda_home, extra_libs, stub_dir)
    for name, r in sorted(res["modules"].items()):
        if not r["is_aot"]:
            raise UserError(f"--cache {cache}: module {name} does not resolve to the cache "
                            f"(FlashInfer looked at {r['aot_path']}); rebuild with this module")
        if not r["jit_refused"]:
            raise UserError(f"module {name}: FlashInfer did not refuse to compile with "
                            "FLASHINFER_DISABLE_JIT=1")
        if require_load and not r["loaded"]:
            raise UserError(f"module {name}: resolved but failed to load: {r['load_error']}")
        report["modules"][name].update(r)
    if res["jit_dir_has_so"]:
        raise UserError(f"--cache {cache}: FlashInfer compiled something in the clean env")
    report["arch_list"] = data["arch_list"]
    return report
