"""The probe: FlashInfer's own generators, run from the tree in a clean subprocess, give each
module's ninja text (its compile and link commands) and generated sources.

The subprocess is `python -s -m tools.kernel_cache _probe` (cli.main hands it to probe_main) with
the tree first on PYTHONPATH, so the flashinfer it imports is the tree's, never an installed one.
A UserError in the subprocess (a kernel selection naming what FlashInfer lacks, raised from inside
FlashInfer's generators, which wrap it in their own RuntimeError) comes back as that one line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.kernel_cache.modules import ModuleDecl
from tools.kernel_cache.toolchain import Toolchain
from tools.kernel_cache.tree import REPO_ROOT, dir_digest

# Environment variables that change what FlashInfer's generators emit: stripped from every
# subprocess so the plan depends only on declared inputs.
_LEAKY_ENV = ("CC", "CXX", "CUDA_PATH", "MAX_JOBS", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS")
# The probe's exit status for a UserError; its message is the last line of stdout, as JSON.
_USER_ERROR_RC = 2


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLASHINFER_") and k not in _LEAKY_ENV and k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def run_probe(tree: Path, decls: Sequence[ModuleDecl], arch: str, variant: str,
              tc: Toolchain, gen_out: Path | None = None, python: str | None = None,
              selections: Mapping[str, Mapping[str, Any]] | None = None) -> dict:
    """Call each generator from the tree; return paths and per-module ninja text and digests.
    With gen_out, each module's generated sources are also copied to gen_out/<module>/.
    selections: {module: its kernel selection} (tools/kernel_cache/selection.py); modules not
    named there are probed as FlashInfer writes them."""
    work = Path(tempfile.mkdtemp(prefix="kc-probe-"))
    try:
        request = {"modules": [{"name": d.name, "generator": d.generator,
                                "kwargs": d.kwargs_for(variant),
                                **({"kernel_selection": selections[d.name]}
                                   if selections and d.name in selections else {})}
                               for d in decls],
                   "work": str(work), "gen_out": str(gen_out) if gen_out else None}
        env = clean_env({
            # The tree first; the caller's own entries after it (hosts that bring
            # FlashInfer's dependencies, e.g. tvm-ffi, on PYTHONPATH rather than site-packages).
            "PYTHONPATH": os.pathsep.join([str(tree), str(REPO_ROOT)] + [
                p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            "FLASHINFER_CUDA_ARCH_LIST": arch,
            "FLASHINFER_WORKSPACE_BASE": str(work / "ws"),
            "CUDA_HOME": str(tc.cuda_home),
            "HOME": str(work),
        })
        proc = subprocess.run(
            [python or sys.executable, "-s", "-m", "tools.kernel_cache", "_probe"],
            input=json.dumps(request), capture_output=True, text=True, env=env, cwd=work)
        if proc.returncode == _USER_ERROR_RC:
            reported = _reported_user_error(proc.stdout)
            if reported is not None:
                raise UserError(reported)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise UserError(f"--flashinfer-tree {tree}: FlashInfer generator probe failed "
                            f"(is the tree a flashinfer wheel and torch/tvm_ffi installed?):\n{tail}")
        return json.loads(proc.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _reported_user_error(stdout: str) -> str | None:
    lines = stdout.strip().splitlines()
    try:
        reported = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return reported.get("user_error") if isinstance(reported, dict) else None


def _user_error_in(exc: BaseException) -> UserError | None:
    """The UserError that caused exc, if any (FlashInfer re-raises generator errors as
    RuntimeError(...) from the original)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, UserError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def probe_main() -> int:
    """Runs inside the subprocess with the tree first on sys.path."""
    try:
        return _probe()
    except Exception as e:
        user_error = _user_error_in(e)
        if user_error is None:
            raise
        print("\n" + json.dumps({"user_error": str(user_error)}))
        return _USER_ERROR_RC


def _probe() -> int:
    import contextlib
    import importlib

    from tools.kernel_cache import selection

    req = json.loads(sys.stdin.read())
    import flashinfer
    from flashinfer.jit import cpp_ext
    from flashinfer.jit import env as jit_env

    tree = Path(flashinfer.__file__).resolve().parents[1]
    expected = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    # Compared file by file: a sandbox may present the tree as a forest of file symlinks, so the
    # directories' resolved paths differ while the package is the same.
    if Path(flashinfer.__file__).resolve() != (expected / "flashinfer" / "__init__.py").resolve():
        print(f"flashinfer imported from {tree}, not from the tree {expected}", file=sys.stderr)
        return 3
    import tvm_ffi
    result: dict[str, Any] = {
        "flashinfer_version": flashinfer.__version__,
        "paths": {"tree": str(tree), "cuda_home": cpp_ext.get_cuda_path(),
                  "py_include": sysconfig.get_path("include"),
                  "tvm_ffi": str(Path(tvm_ffi.__file__).resolve().parent)},
        "modules": [],
    }
    work = Path(req["work"])
    default_gen = jit_env.FLASHINFER_GEN_SRC_DIR
    for m in req["modules"]:
        # Each generator writes into its own directory so a module's generated sources are
        # exactly what it produced (FlashInfer reads these jit_env attributes at call time).
        gen_dir = (work / "gen" / m["name"]).resolve()
        jit_dir = (work / "jit").resolve()
        jit_env.FLASHINFER_GEN_SRC_DIR = gen_dir
        jit_env.FLASHINFER_JIT_DIR = jit_dir
        mod_name, fn_name = m["generator"].split(":")
        ms = m.get("kernel_selection")
        with (selection.kernel_filter(ms, m["name"]) if ms else contextlib.nullcontext()) as kernel_counts:
            spec = getattr(importlib.import_module(mod_name), fn_name)(**m["kwargs"])
        if spec.name != m["name"]:
            print(f"generator {m['generator']} returned module {spec.name!r}, modules.json says "
                  f"{m['name']!r}", file=sys.stderr)
            return 4
        sources, summary = list(spec.sources), None
        if ms:
            stubs = kernel_counts.pop("_stubs", None)
            sources, summary = selection.select_sources(
                [Path(s) for s in spec.sources], ms, spec.name,
                Path(jit_env.FLASHINFER_CSRC_DIR), gen_dir, stubs)
            summary["generated_operations"] = kernel_counts
        ninja = cpp_ext.generate_ninja_build_for_op(
            name=spec.name, sources=sources, extra_cflags=spec.extra_cflags,
            extra_cuda_cflags=spec.extra_cuda_cflags, extra_ldflags=spec.extra_ldflags,
            extra_include_dirs=spec.extra_include_dirs,
            needs_device_linking=spec.needs_device_linking)
        gen_dir.mkdir(parents=True, exist_ok=True)
        files = sorted(p.relative_to(gen_dir).as_posix() for p in gen_dir.rglob("*") if p.is_file())
        for rel in files:
            if str(work) in (gen_dir / rel).read_text(errors="replace"):
                print(f"generated source {rel} of {spec.name} embeds a host path", file=sys.stderr)
                return 5
        if req["gen_out"]:
            shutil.copytree(gen_dir, Path(req["gen_out"]) / spec.name, dirs_exist_ok=True)
        result["modules"].append({
            "name": spec.name, "generator": m["generator"], "kwargs": m["kwargs"],
            "ninja": ninja, "gen_dir": str(gen_dir), "build_dir": str(jit_dir / spec.name),
            "gen_files": files, "gen_digest": dir_digest(gen_dir),
            **({"kernel_selection": summary} if summary else {})})
    if default_gen.exists() and any(default_gen.rglob("*.cu")):
        print("a generator wrote into the default FLASHINFER_GEN_SRC_DIR", file=sys.stderr)
        return 6
    json.dump(result, sys.stdout)
    return 0
