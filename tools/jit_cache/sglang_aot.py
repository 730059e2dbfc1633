"""SGLang's JIT modules built ahead of time, in SGLang's own cache layout (issue #27, deliverable 2).

    python3 -m tools.jit_cache[.sglang_aot] build-sglang --stack S --arch 12.0f|9.0a --modules FILE
        --base-tar BASE.tar --site-tree DIR... --site-packages /usr/local/lib/python3.X/dist-packages
        --cuda-home C --userland U [--runtime HOST.json] --out OUT

OUT holds `<target>/<module>/build-<build_key>/deps-<deps_key>/{sgl_deps.json,<module>.so}` (what
`$SGLANG_JIT_CACHE_DIR` holds after SGLang built them itself) and `kimi-k3-sglang-jit.json`, the
manifest: per module its call, arguments, keys, the .so's sha256, the toolchain headers it was
compiled against (not in the image, so not in its sgl_deps.json) and the toolchain's identity.

How: the image's interpreter (Debian's python3.11 from the base tar) runs
tools/jit_cache/sglang_worker.py over the image's installed site-packages trees; the worker calls
each listed `_jit_*_module` function, so SGLang's own load_jit computes every key and publishes
every leaf; only its compile step is handed the pinned toolchain (the worker's docstring says what
it changes and why none of it changes a key). Nothing of the machine is read: no GPU, no CUDA, no
compiler but the pinned ones. Bad input (an unknown stack or arch, a call that fails) is one line
per entry and leaves OUT as it was.

--runtime keys the modules for a runtime other than the image (the GPU proof's host, whose torch is
its own): the file's `sglang_jit_runtime` object gives that runtime's CUDA_HOME (a directory it does
not have, so no compiler is reachable there either) and the versions it reports of the
distributions SGLang keys by version string only (RUNTIME_DISTRIBUTIONS); the modules' bytes are
the image build's, only the build key's directory differs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically, read_only_copy
from tools.common.hashing import sha256_file
from tools.common.jsondata import ANY, TEXT, ListOf, MapOf, Nullable, Object, json_path, load_json_file
from tools.common.jsonfmt import review_json
from tools.common import cuda_home
from tools.jit_cache import bytecode_tree

WORKER = Path(__file__).with_name("sglang_worker.py")
MANIFEST = "kimi-k3-sglang-jit.json"
# arch -> (capability torch reports, device name, SGLang's cache target directory)
ARCHS = {
    "12.0f": ((12, 0), "NVIDIA RTX PRO 6000 Blackwell Server Edition", "sm120f"),
    "9.0a": ((9, 0), "NVIDIA H200", "sm90a"),
}
SCHEMA_VERSION = 1
# Distributions SGLang's build key reads by version string only and no module compiles against:
# the ones a --runtime may answer for (apache-tvm-ffi and flashinfer-python are compiled in).
RUNTIME_DISTRIBUTIONS = ("torch", "nvidia-mathdx", "deep_gemm")
RUNTIME_KEY = "sglang_jit_runtime"


def log(msg: str) -> None:
    print(f"jit_cache: {msg}", file=sys.stderr, flush=True)


# jit_cache/sglang_modules.json: per stack, the `_jit_*_module` calls built ahead of time.
SGLANG_MODULES = Object({
    "stacks": MapOf(ListOf(Object({"call": TEXT, "why": TEXT}, optional={"args": ListOf(ANY)}))),
}, optional={"description": TEXT})
# A --runtime file's (tools/gpu_suite/gpu_host.json) sglang_jit_runtime object: distribution ->
# the version the runtime reports, null when it is not installed there.
SGLANG_JIT_RUNTIME = Object({"cuda_home": TEXT}, optional={"distributions": MapOf(Nullable(TEXT)), "why": TEXT})
# What this module reads of the file; its other fields are other readers'.
RUNTIME_FILE = Object({RUNTIME_KEY: SGLANG_JIT_RUNTIME}, other=ANY)


def load_modules(path: Path, stack: str, flag: str = "--modules", required: bool = True) -> list[dict[str, Any]]:
    """The stack's entries of jit_cache/sglang_modules.json (given as `flag`), checked: each a
    `call` ("package.module:function"), `args` (JSON values; {"dtype": "bfloat16"} for a torch
    dtype) and a `why`. A stack the file does not list: [] unless `required`."""
    stacks = load_json_file(path, flag, SGLANG_MODULES, "see jit_cache/README.md")["stacks"]
    if stack not in stacks:
        if not required:
            return []
        raise UserError(f"{flag} {path}: no entry for stack {stack!r} (has: "
                        f"{', '.join(sorted(stacks))}); add stacks.{stack}")
    entries = stacks[stack]
    seen = set()
    for i, entry in enumerate(entries):
        where = f"{flag} {path}: {json_path(['stacks', stack, i])}"
        call = entry["call"]
        if call.count(":") != 1 or not all(call.split(":")):
            raise UserError(f"{where}: call {call!r} is not \"package.module:function\"")
        if not entry["why"].strip():
            raise UserError(f"{where}: why is empty: say which call site needs it")
        key = json.dumps([call, entry.get("args", [])], sort_keys=True)
        if key in seen:
            raise UserError(f"{where}: {call} with these args is listed twice; delete one")
        seen.add(key)
    return entries


def load_runtime(path: Path | None) -> dict[str, Any] | None:
    """The `sglang_jit_runtime` object of PATH (None: the image's own runtime), checked:
    {"cuda_home": an absolute path the runtime does not have, "distributions": {name: version or
    null}} with names from RUNTIME_DISTRIBUTIONS."""
    if path is None:
        return None
    runtime = load_json_file(path, "--runtime", RUNTIME_FILE, "see tools/jit_cache/sglang_aot.py")[RUNTIME_KEY]
    where = f"--runtime {path}: {json_path([RUNTIME_KEY])}"
    cuda_home = runtime["cuda_home"]
    if not cuda_home.startswith("/"):
        raise UserError(f"{where}.cuda_home: {cuda_home!r} is not an absolute path; give the "
                        "CUDA_HOME the runtime sets (a directory without nvcc)")
    dists = runtime.get("distributions", {})
    other = sorted(set(dists) - set(RUNTIME_DISTRIBUTIONS))
    if other:
        raise UserError(f"{where}.distributions: {', '.join(other)} cannot differ from the image "
                        f"(the modules compile against it); only {', '.join(RUNTIME_DISTRIBUTIONS)} may")
    return {"cuda_home": cuda_home, "distributions": dict(sorted(dists.items()))}


def _runtime_env(runtime: dict[str, Any] | None) -> dict[str, str]:
    return {"CUDA_HOME": runtime["cuda_home"]} if runtime else {}


def image_python(site_packages: str) -> str:
    """The interpreter (relative to /) that owns SITE_PACKAGES (/usr/local/lib/pythonX.Y/...)."""
    version = next((part for part in Path(site_packages).parts if re.fullmatch(r"python3\.\d+", part)), None)
    if version is None:
        raise UserError(f"--site-packages {site_packages}: names no pythonX.Y directory; pass the "
                        "image's site-packages (image/constants.bzl SITE_PACKAGES)")
    return f"usr/bin/{version}"


def extract_interpreter(base_tar: Path, root: Path, python_rel: str) -> Path:
    """The image's python3.X and its standard library out of the base rootfs tar (nothing else of
    it: the running system's glibc stays the one loaded)."""
    stdlib = f"usr/lib/{Path(python_rel).name}/"
    try:
        with tarfile.open(base_tar) as tar:
            members = [m for m in tar.getmembers()
                       if (m.name.lstrip("./") == python_rel or m.name.lstrip("./").startswith(stdlib))
                       and (m.isfile() or m.isdir() or m.issym())]
            tar.extractall(root, members=members, filter="tar")
    except (OSError, tarfile.TarError) as e:
        raise UserError(f"--base-tar {base_tar}: cannot read the base rootfs tar ({e}); rebuild "
                        "//image:debian_rootfs") from None
    python = root / python_rel
    if not python.is_file():
        raise UserError(f"--base-tar {base_tar}: holds no /{python_rel}; the image's base must "
                        "be Debian set image-base (the wheels' Python)")
    return python


def merge_site_trees(trees: Sequence[Path], site_rel: str, site: Path) -> None:
    """One site-packages of links to the layers' installed trees (each rooted at /), merged as the
    image's overlay merges them: directories in several trees (namespace packages) merge entry by
    entry, and a file of a later (upper) tree replaces an earlier one."""
    def merge(src: Path, dest: Path) -> None:
        for entry in sorted(os.listdir(src)):
            s, d = src / entry, dest / entry
            if s.is_dir() and d.is_dir():
                if d.is_symlink():  # a lower tree's directory: make it a real one, then merge
                    lower = Path(os.readlink(d))
                    d.unlink()
                    d.mkdir()
                    merge(lower, d)
                merge(s, d)
                continue
            if d.is_symlink() or d.exists():
                if d.is_dir() and not d.is_symlink():
                    shutil.rmtree(d)
                else:
                    d.unlink()
            os.symlink(s, d)

    site.mkdir(parents=True, exist_ok=True)
    for tree in trees:
        src = tree / site_rel
        if not src.is_dir():
            raise UserError(f"--site-tree {tree}: no /{site_rel} in it; pass the layers' installed "
                            "trees (rooted at /)")
        merge(src, site)


def _tvm_ffi_identity(site: Path, out: Path) -> Path:
    """The image's own tvm-ffi (its headers are what the modules compile against) in the form the
    kernel-cache toolchain names it by: include/ and its version."""
    from tools.kernel_cache.toolchain import TVM_FFI_IDENTITY_FILE
    include = site / "tvm_ffi" / "include"
    infos = sorted(site.glob("apache_tvm_ffi-*.dist-info"))
    if not include.is_dir() or len(infos) != 1:
        raise UserError("--site-tree: the stack's apache-tvm-ffi (tvm_ffi/include and one "
                        "apache_tvm_ffi-*.dist-info) is not in the trees")
    out.mkdir()
    os.symlink(include.resolve(), out / "include")
    version = infos[0].name[len("apache_tvm_ffi-"):-len(".dist-info")]
    (out / TVM_FFI_IDENTITY_FILE).write_text(json.dumps({"version": version}))
    return out


class ImagePython:
    """The image's interpreter over the image's installed site-packages, in a scratch directory,
    with the image's environment for SGLang (no compiler reachable; the image's CUDA home)."""

    def __init__(self, scratch: Path, base_tar: Path, site_trees: Sequence[Path], site_packages: str,
                 arch: str):
        self.scratch = scratch
        # Where the trees' files really are: in a Bazel sandbox a tree is a forest of links into
        # the output base, and SGLang anchors every path it keys or records by its resolved
        # location (a header would resolve outside the package it was imported from).
        from tools.kernel_cache.toolchain import real_roots
        # A bytecode tree among them (tools/jit_cache/bytecode_tree.py) is not merged into the
        # site: it is the interpreter's PYTHONPYCACHEPREFIX.
        installed, bytecode = bytecode_tree.split_trees([Path(t) for t in site_trees])
        self.site_trees = [Path(real_roots(Path(os.path.abspath(t)))[-1]) for t in installed]
        root = scratch / "root"
        self.site_rel = site_packages.strip("/")
        self.python = extract_interpreter(base_tar, root, image_python(site_packages))
        self.site = root / self.site_rel
        merge_site_trees(self.site_trees, self.site_rel, self.site)
        pycache = ({"PYTHONPYCACHEPREFIX": bytecode_tree.link_prefix(bytecode[-1], scratch / "pycache", root)}
                   if bytecode else {})
        self.root = root
        no_tools = scratch / "no-compilers"
        no_tools.mkdir()
        # The image's CUDA home (headers and libraries, no nvcc: tools/common/cuda_home.py). The
        # image leaves CUDA_HOME unset, so SGLang resolves /usr/local/cuda there; here that is
        # the scratch root's, named by CUDA_HOME. SGLang's `toolkit` anchor exists only where
        # the directory does, so the keys need it, at the same place relative to site-packages.
        self.cuda_home = cuda_home.make(root, site_packages)
        self.env = {
            "PATH": str(no_tools),
            "HOME": str(scratch / "home"),
            "TMPDIR": str(scratch),
            "LC_ALL": "C",
            "PYTHONNOUSERSITE": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            # The image's own environment (image/BUILD.bazel IMAGE_ENV).
            "LD_LIBRARY_PATH": str(self.site / "nvidia" / "cu13" / "lib"),
            "FLASHINFER_CUDA_ARCH_LIST": arch,
            # Resolved: SGLang anchors the toolkit by its resolved path and replaces that text.
            "CUDA_HOME": str(self.cuda_home.resolve()),
            **pycache,
        }

    def run_worker(self, request: dict[str, Any], extra_env: dict[str, str], what: str,
                   worker: Path = WORKER) -> dict[str, Any]:
        """`worker` (sglang_worker.py, or triton_aot's) under the image's python on REQUEST (a
        JSON file; the worker writes its result where request["result"] says); returns it."""
        request = dict(request, result=str(self.scratch / f"{what}-result.json"))
        request_file = self.scratch / f"{what}-request.json"
        request_file.write_text(json.dumps(request))
        proc = subprocess.run([str(self.python), str(worker), str(request_file)],
                              env={**self.env, **extra_env}, capture_output=True, text=True)
        result_file = Path(request["result"])
        if proc.returncode != 0 or not result_file.is_file():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise UserError(f"{what}: the worker under the image's python3.11 failed (exit "
                            f"{proc.returncode}); see its output above")
        result = json.loads(result_file.read_text())
        if result.get("fatal"):
            raise UserError(f"{what}: {result['fatal']}")
        return result


def _arch(arch: str) -> tuple[tuple[int, int], str, str]:
    if arch not in ARCHS:
        raise UserError(f"--arch {arch}: not one of {', '.join(ARCHS)}")
    return ARCHS[arch]


def _report_errors(result: dict[str, Any], modules_file: Path, stack: str, total: int, what: str,
                   fix: str) -> None:
    if not result["errors"]:
        return
    for err in result["errors"]:
        first = err["error"].splitlines()[0] if err["error"] else ""
        print(f"jit_cache: {modules_file}: stacks.{stack}: {err['call']}{tuple(err['args'])}: {first}",
              file=sys.stderr)
    raise UserError(f"{what}: {len(result['errors'])} of {total} module(s) of {modules_file} "
                    f"failed (one line each above); {fix}")


def build_sglang(stack: str, arch: str, modules_file: Path, base_tar: Path, site_trees: Sequence[Path],
                 site_packages: str, cuda_home: str, userland: str, out: Path,
                 runtime_file: Path | None = None, reuse: Path | None = None) -> int:
    from tools.kernel_cache.toolchain import _userland_shims, check_glibc_needed, load_toolchain, real_roots

    capability, device_name, target = _arch(arch)
    entries = load_modules(modules_file, stack)
    runtime = load_runtime(runtime_file)
    reused = load_reused(reuse, stack, arch) if reuse else None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglang-jit-") as scratch_dir:
        scratch = Path(scratch_dir)
        image = ImagePython(scratch, base_tar, site_trees, site_packages, arch)
        site, site_trees = image.site, image.site_trees
        tc = load_toolchain(cuda_home, userland, str(_tvm_ffi_identity(site, scratch / "tvm-ffi")))
        wrappers, _ = _userland_shims(tc.userland) if tc.userland else (None, None)
        compile_env = tc.env()
        found = [t / "usr" / "local" / "bin" for t in site_trees if (t / "usr/local/bin/ninja").is_file()]
        if not found:
            raise UserError("--site-tree: the stack's ninja wheel (/usr/local/bin/ninja) is not in "
                            "the trees; SGLang's load_jit builds through it")
        compile_env["PATH"] = os.pathsep.join([str(found[0]), compile_env["PATH"]])
        image_site = "/" + image.site_rel
        prefix_maps = [list(m) for m in tc.prefix_maps()]
        for tree in site_trees:
            for real in real_roots(tree / image.site_rel):
                prefix_maps.append([real, image_site])
        prefix_maps.append([str(site), image_site])
        # Longest first: a tree's real root may lie under another mapped directory.
        prefix_maps.sort(key=lambda m: len(m[0]), reverse=True)
        cache_dir = scratch / "cache"
        request = {
            "capability": list(capability),
            "device_name": device_name,
            "modules": entries,
            "compile_env": compile_env,
            "nvcc": str(tc.cuda_home / "bin" / "nvcc"),
            "cxx": str(wrappers / "c++") if wrappers else "c++",
            "cuda_home": str(tc.cuda_home),
            "prefix_maps": prefix_maps,
            "scratch": str(scratch / "worker"),
            "runtime": runtime,
            # Paths of this run the build file names besides the prefix maps' (compile_sha256).
            "compile_id_maps": [[str(scratch), "/kimi-k3/scratch"]] +
                               ([[str(wrappers), "/kimi-k3/cc-wrappers"]] if wrappers else []),
        }
        if reused is not None:
            request["reuse"] = {"cache": str(reuse), "modules": {
                m["module"]: {"leaf": m["leaf"], "compile_sha256": m["compile_sha256"]} for m in reused["modules"]}}
        log(f"stack {stack}, arch {arch}: " + (
            f"keying {len(entries)} SGLang JIT module(s) through SGLang's load_jit, each reusing "
            f"{reuse}'s compile once its build file is proven the same" if reused is not None else
            f"building {len(entries)} SGLang JIT module(s) through SGLang's load_jit (nvcc "
            f"{tc.nvcc_version_text}, {tc.cxx_version})"))
        result = image.run_worker(request, {"SGLANG_JIT_CACHE_DIR": str(cache_dir),
                                            **_runtime_env(runtime)}, "build-sglang")
        _report_errors(result, modules_file, stack, len(entries), "build-sglang",
                       "fix or remove those entries")
        if result["target"] != target:
            raise UserError(f"build-sglang: SGLang keyed the modules for {result['target']}, not "
                            f"{target} ({arch}); the stand-in device did not take")
        manifest = _manifest(stack, arch, result, cache_dir, tc, prefix_maps, runtime, reused)
        for m in manifest["modules"]:
            check_glibc_needed(cache_dir / m["leaf"] / (m["module"] + ".so"), tc, f"build-sglang {m['module']}")
        with dir_replaced_atomically(out, "--out", tool=None) as tmp:
            # Of each leaf only what SGLang reads back: sgl_deps.json and the module (the
            # staging's objects, depfiles and ninja log hold build paths and times).
            for m in manifest["modules"]:
                leaf = tmp / m["leaf"]
                leaf.mkdir(parents=True)
                for name in ("sgl_deps.json", m["module"] + ".so"):
                    shutil.copyfile(cache_dir / m["leaf"] / name, leaf / name)
                    (leaf / name).chmod(0o755 if name.endswith(".so") else 0o644)
            (tmp / MANIFEST).write_bytes(review_json(manifest))
    log(f"{'keyed' if reused else 'built'} {len(manifest['modules'])} module(s) for {target} in "
        f"{time.monotonic() - t0:.0f} s; wrote {out}")
    return 0


def check_built_for(manifest: dict[str, Any], cache: Path, stack: str, arch: str) -> None:
    """A first-use cache's manifest (SGLang JIT or Triton) names the stack and arch it was built for."""
    if (manifest.get("stack"), manifest.get("arch")) != (stack, arch):
        raise UserError(f"--cache {cache}: built for stack {manifest.get('stack')} arch "
                        f"{manifest.get('arch')}, not {stack} {arch}")


def check_sglang(stack: str, arch: str, modules_file: Path, base_tar: Path,
                 site_trees: Sequence[Path], site_packages: str, cache: Path,
                 runtime_file: Path | None = None) -> int:
    """SGLang's own loader, in the image's tree with no compiler reachable and
    SGLANG_CRASH_ON_JIT_COMPILE=1, over a read-only copy of CACHE: every listed module must be a
    hit on the manifest's leaf and load (tvm-ffi's dlopen). One line per module; exit 1 on a miss."""
    capability, device_name, target = _arch(arch)
    entries = load_modules(modules_file, stack)
    runtime = load_runtime(runtime_file)
    manifest_file = cache / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--cache {cache}: no readable {MANIFEST} ({e}); pass the output of "
                        "build-sglang") from None
    check_built_for(manifest, cache, stack, arch)
    with tempfile.TemporaryDirectory(prefix="sglang-jit-check-") as scratch_dir:
        scratch = Path(scratch_dir)
        image = ImagePython(scratch, base_tar, site_trees, site_packages, arch)
        request = {"mode": "check", "capability": list(capability), "device_name": device_name,
                   "modules": entries, "runtime": runtime}
        with read_only_copy(cache, scratch / "shipped") as shipped:
            result = image.run_worker(request, {"SGLANG_JIT_CACHE_DIR": str(shipped),
                                                "SGLANG_CRASH_ON_JIT_COMPILE": "1",
                                                **_runtime_env(runtime)}, "check-sglang")
        _report_errors(result, modules_file, stack, len(entries), "check-sglang",
                       "rebuild the cache (build-sglang) from the same trees and toolchain")
        if result["fingerprint"] != manifest["environment_fingerprint"] or result["target"] != target:
            raise UserError(f"check-sglang: the runtime keys on {result['target']} with environment "
                            f"{result['fingerprint']}, the cache was built for {manifest['target']} "
                            f"{manifest['environment_fingerprint']}; rebuild it")
        leaves = {m["module"]: m["leaf"] for m in manifest["modules"]}
        failed = 0
        for m in result["modules"]:
            rel = os.path.relpath(m["leaf"], shipped) if m["leaf"] != "None" else None
            rel_leaf = str(Path(rel).parent) if rel else None
            if rel_leaf != leaves.get(m["module"]):
                print(f"jit_cache: {m['call']}: SGLang looked up {m['module']} and found "
                      f"{rel_leaf}, the manifest ships {leaves.get(m['module'])}", file=sys.stderr)
                failed += 1
                continue
            log(f"hit {target}/{m['module']} -> {rel_leaf} (loaded: {m['loaded']})")
    if failed:
        raise UserError(f"check-sglang: {failed} module(s) missed; rebuild the cache")
    log(f"{len(result['modules'])} of {len(entries)} module(s) found and loaded by SGLang's own "
        f"loader with no compiler reachable ({target})")
    return 0


def _fixed(path: str, prefix_maps: Sequence[Sequence[str]]) -> str:
    for real, fixed in prefix_maps:
        if path == real or path.startswith(real + "/"):
            return (fixed or "") + path[len(real):]
    return path


def load_reused(cache: Path, stack: str, arch: str) -> dict[str, Any]:
    """The manifest of a cache whose compiles a build for another runtime reuses: the same stack
    and arch, built with compile ids (a cache from before them is rebuilt, not trusted)."""
    try:
        manifest = json.loads((cache / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--reuse {cache}: no readable {MANIFEST} ({e}); pass the output of "
                        "build-sglang") from None
    check_built_for(manifest, cache, stack, arch)
    if any("compile_sha256" not in m for m in manifest["modules"]):
        raise UserError(f"--reuse {cache}: its modules carry no compile_sha256 (built by an older "
                        "build-sglang); rebuild it")
    return manifest


def _manifest(stack: str, arch: str, result: dict[str, Any], cache_dir: Path, tc: Any,
              prefix_maps: Sequence[Sequence[str]], runtime: dict[str, Any] | None,
              reused: dict[str, Any] | None = None) -> dict[str, Any]:
    reused_by_module = {m["module"]: m for m in (reused or {}).get("modules", [])}
    modules = []
    for m in result["modules"]:
        so = Path(m["so"])
        rel = so.relative_to(cache_dir)
        modules.append({
            "call": m["call"],
            "args": m["args"],
            "module": m["module"],
            "module_args": m["module_args"],
            "build_key": m["build_key"],
            "leaf": str(rel.parent),
            "so_sha256": sha256_file(so),
            "compile_sha256": m["compile_sha256"],
            "dependencies": len(m["dependencies"]),
            # A reused compile ran no depfile scan here: the compile's own list.
            "toolchain_dependencies": (reused_by_module[m["module"]]["toolchain_dependencies"] if m["reused"] else
                                       sorted({_fixed(p, prefix_maps) for p in m["toolchain_dependencies"]})),
        } | ({"reused": True} if m["reused"] else {}))
    modules.sort(key=lambda m: (m["module"], m["build_key"]))
    return {
        "schema_version": SCHEMA_VERSION,
        "description": "SGLang JIT modules built ahead of time by tools/jit_cache (python3 -m "
                       "tools.jit_cache build-sglang), laid out as $SGLANG_JIT_CACHE_DIR: SGLang's "
                       "own load_jit computed every key in the image's installed tree with no "
                       "compiler reachable (as in the image); the pinned toolchain compiled them.",
        "stack": stack,
        "arch": arch,
        "target": result["target"],
        "environment_fingerprint": result["fingerprint"],
        "toolchain": tc.identity(),
        "modules": modules,
    } | ({
        # Keyed for another runtime than the image: what it must set and report for these keys.
        "runtime": {"cuda_home": runtime["cuda_home"], "distributions": result["distributions"]},
    } if runtime else {})


def add_sglang_commands(sub: Any) -> None:
    """build-sglang and check-sglang, for `python3 -m tools.jit_cache` and this module's own
    entry point (what the Bazel actions run: their tool inputs are this module and the worker,
    so an edit to the inventory code does not rebuild the modules)."""
    bs = sub.add_parser("build-sglang", help="SGLang JIT modules ahead of time, in SGLang's cache layout")
    bs.add_argument("--stack", required=True)
    bs.add_argument("--arch", required=True, help="12.0f (the image) or 9.0a (the H200 proof)")
    bs.add_argument("--modules", type=Path, default=Path("jit_cache/sglang_modules.json"))
    bs.add_argument("--base-tar", type=Path, required=True, help="the image's Debian rootfs tar (its python3.11)")
    bs.add_argument("--site-tree", type=Path, action="append", required=True,
                    help="an image layer's installed tree (rooted at /); repeat, bottom layer first")
    bs.add_argument("--site-packages", required=True, help="the image's site-packages (image/constants.bzl SITE_PACKAGES)")
    bs.add_argument("--cuda-home", required=True, help="the pinned CUDA root (@kimi_cuda)")
    bs.add_argument("--userland", required=True, help="the pinned compiler userland (@kimi_cxx_userland)")
    bs.add_argument("--runtime", type=Path, help="key for another runtime: a JSON file with a "
                    f"{RUNTIME_KEY} object (tools/gpu_suite/gpu_host.json)")
    bs.add_argument("--reuse", type=Path, help="another build-sglang output of the same stack, arch "
                    "and modules (keyed for the image) whose compiles to reuse: with --runtime, only "
                    "the keys differ, and each module's build file is proven the same")
    bs.add_argument("--out", type=Path, required=True)
    bs.set_defaults(func=lambda a: build_sglang(a.stack, a.arch, a.modules, a.base_tar, a.site_tree,
                                                a.site_packages, a.cuda_home, a.userland, a.out,
                                                a.runtime, a.reuse))
    cs = sub.add_parser("check-sglang", help="SGLang's own loader finds and loads every built module, no compiler reachable")
    for flag in ("--stack", "--arch"):
        cs.add_argument(flag, required=True)
    cs.add_argument("--modules", type=Path, default=Path("jit_cache/sglang_modules.json"))
    cs.add_argument("--base-tar", type=Path, required=True)
    cs.add_argument("--site-tree", type=Path, action="append", required=True)
    cs.add_argument("--site-packages", required=True, help="the image's site-packages (image/constants.bzl SITE_PACKAGES)")
    cs.add_argument("--cache", type=Path, required=True, help="build-sglang's output")
    cs.add_argument("--runtime", type=Path, help="the --runtime the cache was built with")
    cs.set_defaults(func=lambda a: check_sglang(a.stack, a.arch, a.modules, a.base_tar, a.site_tree,
                                                a.site_packages, a.cache, a.runtime))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.sglang_aot",
                                     description="SGLang JIT modules ahead of time")
    add_sglang_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
