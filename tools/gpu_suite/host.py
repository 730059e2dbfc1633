"""The GPU host's side of the bundle (tools/gpu_suite/bundle.py): `sh DIR/run.sh` runs this from
DIR/repo. It checks the bundle, builds the kernel selection for this GPU with the host's nvcc,
and runs tests/gpu:

  1. every file against DIR/manifest.json (sha256, size), the host's Python against the
     bundle's, and the modules the host itself must provide (torch, numpy, pytest);
  2. the GPU (torch): the arch list and kernel selection for it from kernel_cache/selections.json
     default_for_arch (Hopper 9.0a: gpu-test-sm90; SM120: 12.0f, kimi-k3);
  3. the CUDA root: --cuda-home, else $KIMI_CUDA_HOME, else /usr/local/cuda, whose nvcc must be
     the release the plans are made for (the manifest's nvcc_release);
  4. WORK/site: the bundle's wheels but FlashInfer, unpacked (FlashInfer's own imports, for the
     generator probe); WORK/tree: the FlashInfer wheel unpacked (the tree the cache is built from);
  5. `python3 -m tools.kernel_cache build ... --out WORK/kc`, objects cached in WORK/objcache
     (content-addressed: a second run compiles nothing);
  6. `python3 -m tools.gpu_suite` with every bundled wheel and WORK/kc: the table and
     `N passed, N failed, N skipped`;
  7. the SGLang JIT proof, where the bundle has one (its sglang_jit/): WORK/sglang-site holds the
     bundle's wheels and the stack's SGLang; tests/gpu/test_sglang_jit_gpu.py runs with no compiler
     reachable (PATH an empty directory, CUDA_HOME and TRITON_PTXAS_PATH at gpu_host.json's missing
     directory, SGLANG_CRASH_ON_JIT_COMPILE=1) over a read-only copy of the cache, then
     tools/gpu_suite/first_call.py times each module's first call with and without it.
     `--sglang-jit` runs only this step (no kernel-cache build).
  8. the Triton proof, where the bundle has one (its triton/): the stack's Triton for this Python
     installed at the site_packages its cache is keyed for (triton/cache's runtime), with a ptxas
     that only answers --version; tests/gpu/test_triton_gpu.py runs with no compiler reachable
     over the cache bound read-only into a fresh TRITON_CACHE_DIR, then
     tools/gpu_suite/triton_first_call.py times each call's first run with and without it.
     `--triton` runs only this step.
The exit status is nonzero when any step failed.

Each command is printed before it runs. WORK is DIR/work unless --work says otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import check_replaceable_dir, dir_replaced_atomically, set_tree_writable
from tools.common.hashing import sha256_file
from tools.gpu_suite.site import unpack_wheel
from tools.jit_cache.sglang_aot import load_runtime
from tools.kernel_cache.modules import ARCH_RE
from tools.kernel_cache.selection import load_selections
from tools.kernel_cache.toolchain import load_toolchain

REPO = Path(__file__).absolute().parents[2]
# The folders this runner unpacks and copies into are its own outputs: a rerun may replace them.
HOST_TOOL = "tools.gpu_suite.host"
SELECTIONS = REPO / "kernel_cache" / "selections.json"
MODULES = REPO / "kernel_cache" / "modules.json"
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")
# The bundle's manifest (written by tools/gpu_suite/bundle.py, which imports these: this module
# runs on the GPU host, where only the bundle's copy of tools/ exists).
MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
SGLANG_JIT_MANIFEST = "kimi-k3-sglang-jit.json"  # tools/jit_cache/sglang_aot.py MANIFEST
SGLANG_JIT_PROOF = REPO / "tests" / "gpu" / "test_sglang_jit_gpu.py"
TRITON_PROOF = REPO / "tests" / "gpu" / "test_triton_gpu.py"
TRITON_MANIFEST = "kimi-k3-triton.json"  # tools/jit_cache/triton_aot.py MANIFEST
# The stand-in for Triton's ptxas in the proof: the version the cache is keyed with, nothing else
# (shell builtins only: the proof's PATH is an empty directory).
PTXAS_STAND_IN = """#!/bin/sh
if [ "$#" = 1 ] && [ "$1" = "--version" ]; then printf '%s' '{version}'; exit 0; fi
echo "ptxas stand-in of the Triton proof: it compiles nothing (a Triton cache miss)" >&2
exit 1
"""
HOST_SPEC = REPO / "tools" / "gpu_suite" / "gpu_host.json"
# Of the host's available memory, what the compilers may plan to use (the rest: page cache, the
# build's own Python, the system).
MEM_FRACTION = 0.85


def verify_bundle(bundle: Path) -> dict[str, Any]:
    """The manifest, after every file it lists matched its size and sha256."""
    path = bundle / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e}); copy the whole bundle folder to this host") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: not a bundle manifest of schema {SCHEMA_VERSION}; make the bundle "
                        "with this checkout's `tools/bazel run //tools/gpu_suite:bundle`")
    for rel, want in sorted(manifest["files"].items()):
        f = bundle / rel
        if not f.is_file():
            raise UserError(f"{f}: missing from the bundle ({MANIFEST} lists it); copy the whole "
                            "bundle folder again")
        if f.stat().st_size != want["size"] or sha256_file(f) != want["sha256"]:
            raise UserError(f"{f}: differs from its {MANIFEST} entry (size {want['size']}, sha256 "
                            f"{want['sha256'][:16]}); copy the bundle again")
    return manifest


def check_python(manifest: Mapping[str, Any], version: Sequence[int] = sys.version_info[:2]) -> None:
    have = f"{version[0]}.{version[1]}"
    if manifest["python"] != have:
        raise UserError(f"this host runs CPython {have}, the bundle's wheels are for "
                        f"{manifest['python']}; make one for this host (`tools/bazel run "
                        f"//tools/gpu_suite:bundle -- --out DIR --python {have}`)")
    missing = [m for m in manifest.get("from_host", []) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{sys.executable}: cannot import {', '.join(missing)}, which the GPU host "
                        "must provide (its CUDA torch, numpy and pytest); run with PYTHON=<the "
                        "interpreter that has them> sh run.sh")


def arch_for(capability: tuple[int, int], selections: Mapping[str, Any]) -> tuple[str, str]:
    """(arch list, kernel selection) for a GPU of compute capability (major, minor): the
    default_for_arch entry that covers it ('a': that exact GPU; 'f': its family, same major and
    at least that minor)."""
    major, minor = capability
    for arch, selection in sorted(selections.get("default_for_arch", {}).items()):
        m = ARCH_RE.match(arch)
        if not m:
            continue
        a_major, a_minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        if a_major == major and (minor == a_minor or (suffix == "f" and minor >= a_minor)):
            return arch, selection
    known = ", ".join(sorted(selections.get("default_for_arch", {})))
    raise UserError(f"this GPU is sm{major}{minor}: kernel_cache/selections.json default_for_arch "
                    f"covers {known or 'no arch'}; pass --arch and --selection to build for it")


def detect_capability() -> tuple[int, int]:
    try:
        import torch
    except ImportError as e:
        raise UserError(f"{sys.executable}: cannot import torch ({e}); run with PYTHON=<the "
                        "interpreter holding the host's CUDA torch> sh run.sh") from None
    if not torch.cuda.is_available():
        raise UserError("no CUDA GPU visible to torch; run on the GPU host (or pass --arch and "
                        "--selection with --dry-run to see the commands)")
    major, minor = torch.cuda.get_device_capability(0)
    print(f"GPU: {torch.cuda.get_device_name(0)} (sm{major}{minor}), torch {torch.__version__}",
          flush=True)
    return major, minor


def cuda_home(given: str | None, environ: Mapping[str, str] = os.environ) -> Path:
    """--cuda-home, else $KIMI_CUDA_HOME, else /usr/local/cuda: named on the command line or
    printed, never guessed from PATH."""
    return Path(given or environ.get("KIMI_CUDA_HOME") or DEFAULT_CUDA_HOME)


def default_mem_budget_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(int(line.split()[1]) / 1024 * MEM_FRACTION)
    raise UserError(f"{meminfo}: no MemAvailable line; pass --mem-budget-mb")


def build_command(*, tree: Path, arch: str, selection: str, jobs: int, mem_mb: int,
                  cuda: Path, tvm_ffi: Path, out: Path, cache_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tools.kernel_cache", "build", "--flashinfer-tree", str(tree),
            "--modules", str(MODULES), "--arch", arch, "--selection", selection, "-j", str(jobs),
            "--mem-budget-mb", str(mem_mb), "--cuda-home", str(cuda), "--tvm-ffi", str(tvm_ffi),
            "--out", str(out), "--cache-dir", str(cache_dir), "--nice", "0"]


def suite_command(*, wheels: Sequence[Path], kernel_cache: Path, junit: Path,
                  keyword: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "tools.gpu_suite"]
    for w in wheels:
        cmd += ["--wheel", str(w)]
    # The SGLang JIT proof runs apart (step 7): its process has no compiler reachable.
    tests = sorted(str(t) for t in (REPO / "tests" / "gpu").glob("test_*.py") if t not in (SGLANG_JIT_PROOF, TRITON_PROOF))
    cmd += ["--kernel-cache", str(kernel_cache), "--junit", str(junit), "--tests", *tests]
    return cmd + (["-k", keyword] if keyword else [])


def sglang_jit_proof(bundle: Path, manifest: Mapping[str, Any], work: Path, cuda: Path,
                     dry_run: bool) -> int:
    """Step 7 (the module docstring): the proof's pytest, then the first-call table."""
    from tools.gpu_suite.first_call import proof_env

    cache_rel = manifest.get("sglang_jit_cache")
    if not cache_rel or not manifest.get("sglang_wheel"):
        raise UserError(f"{bundle / MANIFEST}: no SGLang JIT cache in this bundle; make it with "
                        "this checkout's `tools/bazel run //tools/gpu_suite:bundle`")
    wheels = [bundle / manifest["flashinfer_wheel"], bundle / manifest["sglang_wheel"],
              *[bundle / w for w in manifest["wheels"]]]
    ninja = [w for w in wheels if w.name.startswith("ninja-")]
    runtime = load_runtime(HOST_SPEC)
    site, cache = work / "sglang-site", work / "sglang-jit"
    env = proof_env(cache, runtime, work)
    env |= {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "PYTHONUNBUFFERED": "1",
            "KIMI_SGLANG_JIT_CACHE": str(cache), "KIMI_SGLANG_JIT_RUNTIME": str(HOST_SPEC)}
    proof = [sys.executable, "-m", "pytest", "-v", "-s", "-rs", "-p", "no:cacheprovider",
             "-o", "junit_family=xunit1", f"--junitxml={work / 'sglang-jit.xml'}", str(SGLANG_JIT_PROOF)]
    bench = [sys.executable, "-m", "tools.gpu_suite.first_call", "--cache", str(cache),
             "--runtime", str(HOST_SPEC), "--cuda-home", str(cuda),
             "--ninja-wheel", str(ninja[0] if ninja else "missing-ninja-wheel"), "--scratch", str(work)]
    shown = f"PATH={env['PATH']} CUDA_HOME={env['CUDA_HOME']} SGLANG_JIT_CACHE_DIR={cache} "
    if dry_run:
        print(f"+ {shown}{shlex.join(proof)}\n+ {shlex.join(bench)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    unpack_into(site, wheels)
    # A read-only copy: every module must be a hit (a miss would need to write there).
    if cache.exists():  # an earlier run's copy: writable again so it can be replaced
        check_replaceable_dir(cache, str(cache), HOST_TOOL)
        set_tree_writable(cache, True)
    with dir_replaced_atomically(cache, str(cache), tool=HOST_TOOL) as tmp:
        shutil.copytree(bundle / cache_rel, tmp, dirs_exist_ok=True)
    set_tree_writable(cache, False)
    print(f"unpacked {len(wheels)} wheels into {site}; SGLang JIT cache {cache} (read-only)", flush=True)
    rc = _run(proof, env, shown)
    bench_env = dict(os.environ) | {"PYTHONPATH": env["PYTHONPATH"], "PYTHONUNBUFFERED": "1"}
    bench_rc = _run(bench, bench_env)
    return rc or bench_rc


def install_triton(site_src: Path, site: Path, ptxas_version: str) -> None:
    """The bundle's Triton tree at `site` (replaced whole), its ptxas binaries the stand-in."""
    with dir_replaced_atomically(site, str(site), tool=HOST_TOOL) as tmp:
        shutil.copytree(site_src, tmp, dirs_exist_ok=True)
        bin_dir = tmp / "triton" / "backends" / "nvidia" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("ptxas", "ptxas-blackwell"):
            (bin_dir / name).write_text(PTXAS_STAND_IN.replace("{version}", ptxas_version.replace("'", "'\\''")))
            (bin_dir / name).chmod(0o755)


def triton_proof(bundle: Path, manifest: Mapping[str, Any], work: Path, cuda: Path, dry_run: bool) -> int:
    """Step 8 (the module docstring): the proof's pytest, then the first-call table."""
    from tools.jit_cache.triton_aot import bind

    triton = manifest.get("triton")
    if not triton or not manifest.get("sglang_wheel"):
        raise UserError(f"{bundle / MANIFEST}: no Triton cache in this bundle; make it with this "
                        "checkout's `tools/bazel run //tools/gpu_suite:bundle`")
    shipped_src = bundle / triton["cache"]
    keyed = json.loads((shipped_src / TRITON_MANIFEST).read_text())
    runtime = keyed["runtime"]
    site = Path(runtime["site_packages"])
    wheels = [bundle / manifest["flashinfer_wheel"], bundle / manifest["sglang_wheel"],
              *[bundle / w for w in manifest["wheels"]]]
    sglang_site, shipped, bound = work / "sglang-site", work / "triton-shipped", work / "triton-cache"
    no_tools = work / "no-compilers"
    missing = load_runtime(HOST_SPEC)["cuda_home"]
    pythonpath = os.pathsep.join([str(site), str(sglang_site), str(REPO)])
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CC", "CXX")}
    env |= {"PATH": str(no_tools), "CUDA_HOME": missing, "TRITON_PTXAS_PATH": missing + "/bin/ptxas",
            "TRITON_LIBCUDA_PATH": runtime["libcuda_path"], "TRITON_CACHE_DIR": str(bound),
            "KIMI_TRITON_CACHE": str(shipped), "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    proof = [sys.executable, "-m", "pytest", "-v", "-s", "-rs", "-p", "no:cacheprovider",
             "-o", "junit_family=xunit1", f"--junitxml={work / 'triton.xml'}", str(TRITON_PROOF)]
    bench = [sys.executable, "-m", "tools.gpu_suite.triton_first_call", "--cache", str(shipped),
             "--cuda-home", str(cuda), "--scratch", str(work)]
    shown = f"PATH={no_tools} CUDA_HOME={missing} TRITON_CACHE_DIR={bound} PYTHONPATH={pythonpath} "
    if dry_run:
        print(f"+ install {bundle / triton['site']} at {site} (ptxas: a stand-in)\n+ {shown}{shlex.join(proof)}\n"
              f"+ {shlex.join(bench)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    no_tools.mkdir(exist_ok=True)
    install_triton(bundle / triton["site"], site, keyed["ptxas_version"])
    unpack_into(sglang_site, wheels)
    if shipped.exists():  # an earlier run's copy: writable again so it can be replaced
        check_replaceable_dir(shipped, str(shipped), HOST_TOOL)
        set_tree_writable(shipped, True)
    with dir_replaced_atomically(shipped, str(shipped), tool=HOST_TOOL) as tmp:
        shutil.copytree(shipped_src, tmp, dirs_exist_ok=True)
    set_tree_writable(shipped, False)
    with dir_replaced_atomically(bound, str(bound), tool=HOST_TOOL) as tmp:
        entries = bind(shipped, tmp)  # absolute links to the shipped files: valid after the swap
    print(f"Triton {runtime['triton_wheel']} at {site} (ptxas: a stand-in); {entries} entries "
          f"of the read-only {shipped} bound into {bound}", flush=True)
    rc = _run(proof, env, shown)
    bench_env = env | {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    bench_env.pop("TRITON_CACHE_DIR")
    return _run(bench, bench_env) or rc


def unpack_into(target: Path, wheels: Sequence[Path]) -> None:
    """target replaced whole by the unpacked wheels (a rerun starts from the bundle again)."""
    with dir_replaced_atomically(target, str(target), tool=HOST_TOOL) as tmp:
        for w in wheels:
            unpack_wheel(w, tmp)


def _run(cmd: Sequence[str], env: Mapping[str, str], shown_env: str = "") -> int:
    print(f"+ {shown_env}{shlex.join(cmd)}", flush=True)
    return subprocess.run(list(cmd), env=dict(env), cwd=REPO).returncode


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="run.sh", description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="the bundle folder (run.sh passes it)")
    ap.add_argument("--work", type=Path, help="where to unpack and build (default: BUNDLE/work)")
    ap.add_argument("--cuda-home", help=f"the host's CUDA root (default: $KIMI_CUDA_HOME, else {DEFAULT_CUDA_HOME})")
    ap.add_argument("--arch", help="arch list to build for (default: the GPU's, from selections.json)")
    ap.add_argument("--selection", help="kernel selection (default: default_for_arch of the arch)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mem-budget-mb", type=int, help=f"compilers' memory plan (default: {MEM_FRACTION} of MemAvailable)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression for the suite")
    ap.add_argument("--dry-run", action="store_true", help="check and print the commands, run none")
    ap.add_argument("--sglang-jit", action="store_true", help="only the SGLang JIT proof (step 7): no kernel-cache build, no suite")
    ap.add_argument("--triton", action="store_true", help="only the Triton proof (step 8): no kernel-cache build, no suite")
    args = ap.parse_args(argv)
    bundle = args.bundle.absolute()
    work = (args.work or bundle / "work").absolute()
    manifest = verify_bundle(bundle)
    check_python(manifest)
    print(f"bundle {bundle}: stack {manifest['stack']}, {len(manifest['files'])} files match "
          f"{MANIFEST}", flush=True)
    if args.sglang_jit:
        return sglang_jit_proof(bundle, manifest, work, cuda_home(args.cuda_home), args.dry_run)
    if args.triton:
        return triton_proof(bundle, manifest, work, cuda_home(args.cuda_home), args.dry_run)
    selections = load_selections(SELECTIONS)
    if args.arch:
        arch = args.arch
        selection = args.selection or selections.get("default_for_arch", {}).get(arch, "full")
    else:
        arch, default = arch_for(detect_capability(), selections)
        selection = args.selection or default
    cuda = cuda_home(args.cuda_home)
    release = load_toolchain(str(cuda), None, str(bundle / "tvm_ffi")).nvcc_release
    if release != manifest["nvcc_release"]:
        raise UserError(f"--cuda-home {cuda}: nvcc {release}, but the kernel plans are made for "
                        f"nvcc {manifest['nvcc_release']}; pass a CUDA {manifest['nvcc_release']} "
                        "root with --cuda-home")
    print(f"build: arch {arch}, selection {selection}, nvcc {release} at {cuda}", flush=True)
    fi_wheel = bundle / manifest["flashinfer_wheel"]
    deps = [bundle / w for w in manifest["wheels"]]
    site, tree, kc = work / "site", work / "tree", work / "kc"
    build = build_command(tree=tree, arch=arch, selection=selection, jobs=args.jobs,
                          mem_mb=args.mem_budget_mb or default_mem_budget_mb(), cuda=cuda,
                          tvm_ffi=bundle / "tvm_ffi", out=kc, cache_dir=work / "objcache")
    suite = suite_command(wheels=[fi_wheel, *deps], kernel_cache=kc, junit=work / "gpu.xml",
                          keyword=args.keyword)
    pythonpath = os.pathsep.join([str(site), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])
    if args.dry_run:
        print(f"+ PYTHONPATH={pythonpath} {shlex.join(build)}\n+ {shlex.join(suite)}")
        if manifest.get("sglang_jit_cache"):
            sglang_jit_proof(bundle, manifest, work, cuda, True)
        if manifest.get("triton"):
            triton_proof(bundle, manifest, work, cuda, True)
        return 0
    work.mkdir(parents=True, exist_ok=True)
    unpack_into(site, deps)
    unpack_into(tree, [fi_wheel])
    print(f"unpacked {len(deps)} wheels into {site}, {fi_wheel.name} into {tree}", flush=True)
    t0 = time.monotonic()
    rc = _run(build, os.environ | {"PYTHONPATH": pythonpath}, f"PYTHONPATH={pythonpath} ")
    if rc != 0:
        raise UserError(f"the kernel cache build failed (exit {rc}; its output above); rerun "
                        "run.sh to resume it (finished objects are kept in WORK/objcache)")
    print(f"kernel cache {arch} {selection}: built in {time.monotonic() - t0:.0f} s", flush=True)
    rc = _run(suite, os.environ)
    if manifest.get("sglang_jit_cache"):
        rc = sglang_jit_proof(bundle, manifest, work, cuda, False) or rc
    if manifest.get("triton"):
        rc = triton_proof(bundle, manifest, work, cuda, False) or rc
    return rc


if __name__ == "__main__":
    sys.exit(run_cli(main))
