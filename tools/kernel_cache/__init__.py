"""FlashInfer JIT modules compiled ahead of time from the patched tree (the SM120 kernel cache).

FlashInfer describes each JIT module as a JitSpec whose ninja file lists one compile command per
object plus one link command. This stage asks FlashInfer's own generators (run from the patched
tree, in a subprocess) for that ninja text, parses it, and turns it into a *plan*: per module, per
object, the exact compiler argv with every machine-specific absolute path replaced by a
placeholder. The plan is checked in (kernel_cache/plan_<arch>_<variant>.bzl, like a lock) so
Bazel knows every object at analysis time and runs one cached action per object.

Subcommands (all print progress to stderr):
  plan            generate (or --check) the plan from a tree + modules.json
  gen-sources     write one module's generated sources (FlashInfer writes some .cu files itself)
  compile-object  one object: the plan's command with tree/CUDA paths filled in   (Bazel action)
  link-module     one module .so from its objects                                (Bazel action)
  assemble        AOT layout flashinfer/data/aot/<m>/<m>.so + kernel_cache.json  (Bazel action)
  build           everything without Bazel: parallel, per-object content-addressed (reuse checked
                  against each file's sha256 record), resumable
  verify          ELF arch, digests, and resolution through FlashInfer's lookup with JIT disabled
  cuda-stubs      the link-time stub dir (libcuda.so stub, unversioned lib*.so links)

Placeholders in plan arguments:
  @TREE@       the patched tree (directory holding flashinfer/)
  @GEN@        the module's generated-sources directory (output of gen-sources)
  @CUDA_HOME@  the pinned CUDA root
  @PY_INCLUDE@ the interpreter's C include dir       @TVM_FFI@  the tvm_ffi package directory
  @INPUT@ / @OUTPUT@ / @OBJECTS@   the action's source, output, and (link) objects

Where the commands deliberately differ from FlashInfer's ninja file (none changes generated code):
  - nvcc gets -Xcudafe --orig_src_path_name=<the source's fixed /kimi-k3/... path>: cudafe++
    hashes the source's absolute path into internal device symbol names;
  - depfile flags (-MMD/-MF, --generate-dependencies-with-compile) are dropped: every object
    already depends on the whole tree;
  - -ffile-prefix-map maps the host paths of tree, generated sources, CUDA, tvm_ffi, Python
    include and wheel roots to fixed /kimi-k3/... paths, and the pid in nvcc's temp file name is
    zeroed in the object: the same inputs give byte-identical objects and modules on any host;
  - compilers run chrooted into the host root when Bazel runs from tools/bazel's sealed sid root
    (--host-root, DEFAULT_HOST_ROOT says why); outside Bazel they run directly;
  - nvcc gets the nvidia/cu13 wheel include dirs after CUDA's (headers CUDA 13.0 here lacks), the
    link gets a stub dir (libcuda.so stub, unversioned lib*.so links).
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

if __package__ in (None, ""):
    # Run as a script (`python3 -m tools.kernel_cache`, or the probe subprocess): make
    # `from tools import ...` work the same way it does under Bazel and pytest.
    sys.path.insert(0, str(Path(__file__).absolute().parents[2]))

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_file

PLAN_SCHEMA = 1
CACHE_JSON_SCHEMA = 1
CACHE_JSON_NAME = "kernel_cache.json"
AOT_SUBDIR = Path("flashinfer/data/aot")
VARIANTS = ("lean", "full")
REPO_ROOT = Path(__file__).absolute().parents[2]
# nvcc emits e.g. "sm_120" for compute_120f; the ELF check compares the numeric part.
ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-z]?)$")
# Environment variables that change what FlashInfer's generators emit: stripped from every
# subprocess so the plan depends only on declared inputs.
_LEAKY_ENV = ("CC", "CXX", "CUDA_PATH", "MAX_JOBS", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS")
# Rough peak RSS per object (MiB), used for the memory budget and Bazel resource hints. Measured
# with nvcc 13.0 for 120f: SM120 grouped GEMM 7.6-8.6 GB, SM80 grouped GEMM 6.9 GB, SM90 GEMM
# (guarded off for 120f) 1.2 GB, small modules <= 1.2 GB; the other entries are estimates.
# For 9.x the 210 SM90 (grouped) GEMM objects are real code: 16 fused_moe_90 compiles at once
# (10 biggest-first + 6 of these) peaked at 80 GB on the H200 host, so they get 4 GB there.
_MEM_HINTS_BY_ARCH_MB: dict[str, tuple[tuple[str, int], ...]] = {
    "9": (("gemm_grouped_sm90", 4000), ("gemm_sm90", 4000)),
}
_MEM_HINTS_MB: tuple[tuple[str, int], ...] = (
    ("gemm_grouped_sm120", 9000),
    ("gemm_grouped_sm100", 9000),
    ("gemm_grouped_sm80", 7500),
    ("moe_gemm_kernels_", 4000),
    ("cutlass_fused_moe_instantiation", 4000),
    ("flashinfer_cutlass_fused_moe_binding", 3000),
)
_DEFAULT_MEM_MB = 1500


def log(msg: str) -> None:
    print(f"[kernel_cache] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Digests
# --------------------------------------------------------------------------------------------

def _tree_files(root: Path, skip: Callable[[Path], bool]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = sorted(n for n in dirnames if not skip(d / n))
        for n in sorted(filenames):
            if not skip(d / n):
                yield d / n


def dir_digest(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> str:
    """sha256 over (relative path, content sha256) of every file, in sorted order. File modes
    are left out: they don't change compiled code, and wheel unpackers disagree on them."""
    h = hashlib.sha256()
    for p in _tree_files(root, skip):
        rel = p.relative_to(root).as_posix()
        h.update(f"{rel}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def flashinfer_source_digest(tree: Path) -> str:
    """Digest of the patched FlashInfer package: every file under flashinfer/ except build
    outputs (aot/ is where this stage writes; caches and bytecode are not sources)."""
    pkg = tree / "flashinfer"
    aot = tree / AOT_SUBDIR

    def skip(p: Path) -> bool:
        return p == aot or p.name == "__pycache__" or p.suffix == ".pyc"

    return dir_digest(pkg, skip)


def check_tree(tree: Path) -> Path:
    tree = tree.absolute()
    if not (tree / "flashinfer" / "__init__.py").is_file():
        raise UserError(
            f"--flashinfer-tree {tree}: no flashinfer/__init__.py there; pass the patched tree "
            "(the unpacked wheel directory that holds flashinfer/)")
    if not (tree / "flashinfer" / "data" / "csrc").is_dir():
        raise UserError(f"--flashinfer-tree {tree}: no flashinfer/data/csrc; pass an unpacked "
                        "flashinfer-python wheel tree (it ships csrc/ under flashinfer/data/)")
    return tree


# --------------------------------------------------------------------------------------------
# modules.json
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SourceMarker:
    """A fact the tree must contain (e.g. the SiTU enum of #4460): refuses unpatched trees."""
    path: str
    regex: str
    why: str


@dataclasses.dataclass(frozen=True)
class ModuleDecl:
    name: str
    generator: str  # "package.module:function"
    kwargs: Mapping[str, Any]
    variant_kwargs: Mapping[str, Mapping[str, Any]]
    archs: tuple[str, ...]  # arch lists this module applies to; empty = all
    markers: tuple[SourceMarker, ...]

    def kwargs_for(self, variant: str) -> dict[str, Any]:
        return {**self.kwargs, **self.variant_kwargs.get(variant, {})}

    def applies_to(self, arch: str) -> bool:
        return not self.archs or arch in self.archs


def load_modules(path: Path) -> list[ModuleDecl]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--modules {path}: cannot read JSON ({e}); fix the file") from None
    if data.get("schema_version") != 1 or not isinstance(data.get("modules"), list):
        raise UserError(f"--modules {path}: expected schema_version 1 and a 'modules' list")
    decls: list[ModuleDecl] = []
    for i, m in enumerate(data["modules"]):
        where = f"--modules {path}: modules[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("name"), str) \
                or not re.fullmatch(r"[\w.]+:\w+", str(m.get("generator", ""))):
            raise UserError(f"{where}: needs 'name' and 'generator' as 'package.module:function'")
        markers = tuple(SourceMarker(path=k["path"], regex=k["regex"], why=k.get("why", ""))
                        for k in m.get("source_markers", []))
        decls.append(ModuleDecl(
            name=m["name"], generator=m["generator"], kwargs=m.get("kwargs", {}),
            variant_kwargs=m.get("variant_kwargs", {}), archs=tuple(m.get("archs", [])),
            markers=markers))
    names = [d.name for d in decls]
    if len(set(names)) != len(names):
        raise UserError(f"--modules {path}: duplicate module names {sorted(names)}")
    return decls


def check_markers(tree: Path, decls: Iterable[ModuleDecl]) -> list[dict[str, str]]:
    """Every declared source marker must match: a tree without them is unpatched."""
    seen: list[dict[str, str]] = []
    for d in decls:
        for mk in d.markers:
            f = tree / mk.path
            text = f.read_text(errors="replace") if f.is_file() else ""
            if not re.search(mk.regex, text, re.MULTILINE):
                raise UserError(
                    f"--flashinfer-tree {tree}: {mk.path} lacks /{mk.regex}/ required by module "
                    f"{d.name} ({mk.why}); build from the patched tree (patch gate output)")
            seen.append({"module": d.name, "path": mk.path, "regex": mk.regex})
    return seen


def check_arch(arch: str) -> str:
    for a in arch.split():
        if not ARCH_RE.match(a):
            raise UserError(f"--arch {arch!r}: expected FLASHINFER_CUDA_ARCH_LIST entries like "
                            "12.0f or 9.0a (space separated)")
    return arch


def arch_slug(arch: str) -> str:
    return "_".join(a.replace(".", "") for a in arch.split())


def expected_sm(arch: str) -> list[str]:
    """ELF names cuobjdump should show, e.g. 12.0f -> sm_120, 9.0a -> sm_90a."""
    out = []
    for a in arch.split():
        major, minor, suffix = ARCH_RE.match(a).groups()  # type: ignore[union-attr]
        # Family ("f") targets produce plain sm_XY cubins; arch-specific ("a") keep the suffix.
        out.append(f"sm_{major}{minor}{'a' if suffix == 'a' else ''}")
    return out


# --------------------------------------------------------------------------------------------
# Toolchain
# --------------------------------------------------------------------------------------------

# Where tools/bazel mounts the host's own root inside its sealed Debian sid root. Bazel 7 is
# only packaged for sid, but nvcc 13.0 refuses sid's gcc 16 (host_config.h: "gcc versions later
# than 15 are not supported") and, even with -allow-unsupported-compiler, fails on glibc 2.43's
# math headers (rsqrt's exception specification). So compilers run in the host userland the CUDA
# install was made for (chroot), the same one a build without Bazel uses: same bytes either way.
DEFAULT_HOST_ROOT = Path("/run/kimi-k3-host")
# Everything a compiler needs inside that root; checked so a half-mounted root fails clearly.
_HOST_ROOT_PROBE = ("bin/sh", "etc/os-release")


def resolve_host_root(value: str | None) -> Path | None:
    """--host-root: a directory to chroot compilers into, 'none' (run them here) or 'auto'
    (default: $KIMI_K3_HOST_ROOT, else DEFAULT_HOST_ROOT when it exists, else none)."""
    value = value or os.environ.get("KIMI_K3_HOST_ROOT") or "auto"
    if value == "none":
        return None
    if value == "auto":
        return DEFAULT_HOST_ROOT if (DEFAULT_HOST_ROOT / "etc" / "os-release").is_file() else None
    root = Path(value).absolute()
    missing = [r for r in _HOST_ROOT_PROBE if not (root / r).exists()]
    if missing:
        raise UserError(f"--host-root {root}: no {missing[0]} there; pass the host's root as "
                        "mounted by tools/bazel (/run/kimi-k3-host), or 'none' to run compilers "
                        "directly")
    if root == Path("/"):
        return None
    return root


def in_root(root: Path | None, argv: Sequence[str]) -> list[str]:
    """argv to run `argv` inside `root` (chroot) from the current directory; every path this
    tool passes exists at the same place there (tools/bazel mounts workspace, output root,
    /tmp and the interpreter at their own paths)."""
    if root is None:
        return list(argv)
    return ["chroot", str(root), "/bin/sh", "-c", 'cd "$0" && exec "$@"', os.getcwd(), *argv]


def os_release(root: Path | None) -> str:
    path = (root or Path("/")) / "etc" / "os-release"
    text = path.read_text() if path.is_file() else ""
    m = re.search(r'^PRETTY_NAME="?([^"\n]*)"?$', text, re.MULTILINE)
    return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    extra_roots: tuple[Path, ...]  # wheel roots (nvidia/cu13) that add include/ and lib/
    nvcc_release: str
    nvcc_version_text: str
    cxx_version: str
    python_version: str
    tvm_ffi_dir: Path
    tvm_ffi_version: str
    host_root: Path | None  # compilers run chrooted here (None: directly)
    userland: str  # os-release of where compilers run: its glibc/libstdc++ headers are inputs

    def run_argv(self, argv: Sequence[str]) -> list[str]:
        return in_root(self.host_root, argv)

    def cuda_realpath(self) -> str:
        """Resolved where nvcc runs (readlink in the host root): tools/bazel bind-mounts
        /usr/local/cuda into its sealed root, which hides the host's absolute link
        /usr/local/cuda -> /usr/local/cuda-13.0."""
        if self.host_root is None:
            return os.path.realpath(self.cuda_home)
        return _first_line(self.run_argv(["readlink", "-f", str(self.cuda_home)]))

    def identity(self) -> dict[str, Any]:
        """What the compiled bytes depend on besides sources and flags (goes into every key)."""
        return {
            "cuda_home": str(self.cuda_home),
            "cuda_home_realpath": self.cuda_realpath(),
            "nvcc_version": self.nvcc_version_text,
            "cxx_version": self.cxx_version,
            # Where compilers ran, by content not path: the host directly and the host root
            # mounted into Bazel's sealed root are the same userland and give the same bytes.
            "userland": self.userland,
            "python": self.python_version,
            "tvm_ffi_version": self.tvm_ffi_version,
            "tvm_ffi_include_digest": dir_digest(self.tvm_ffi_dir / "include"),
            # By content, not path: the venv holding the wheels lives at a machine-specific path
            # and this identity is written into the image.
            "extra_roots": [{"name": "/".join(r.parts[-2:]), "include_digest":
                             dir_digest(r / "include") if (r / "include").is_dir() else ""}
                            for r in self.extra_roots],
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()


def _first_line(cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"{cmd[0]}: cannot run ({e}); install it or fix PATH") from None
    return out.strip().splitlines()[0] if out.strip() else ""


def find_tvm_ffi() -> tuple[Path, str]:
    # Located without importing it: importing loads libtvm_ffi, which compile actions don't need.
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("python package tvm_ffi: not importable; install apache-tvm-ffi in the "
                        "interpreter that runs this tool")
    from importlib import metadata
    return Path(list(spec.submodule_search_locations)[0]), metadata.version("apache-tvm-ffi")


def load_toolchain(cuda_home: str | None, extra_roots: Sequence[str] = (),
                   host_root: str | None = None) -> Toolchain:
    home = Path(cuda_home or os.environ.get("KIMI_CUDA_HOME") or "/usr/local/cuda").absolute()
    root = resolve_host_root(host_root)
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise UserError(f"--cuda-home {home} (KIMI_CUDA_HOME): no bin/nvcc there; point it at "
                        "the CUDA root")
    if root is not None and not (root / str(nvcc).lstrip("/")).is_file():
        raise UserError(f"--cuda-home {home}: {nvcc} is not in the host root {root} where "
                        "compilers run; install CUDA on the host at that path")
    try:
        text = subprocess.run(in_root(root, [str(nvcc), "--version"]), capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"--cuda-home {home}: bin/nvcc --version failed ({e})") from None
    m = re.search(r"release (\d+\.\d+), (V[\d.]+)", text)
    if not m:
        raise UserError(f"--cuda-home {home}: cannot parse nvcc --version output")
    roots = tuple(Path(r).absolute() for r in extra_roots)
    for r in roots:
        if not (r / "include").is_dir() and not (r / "lib").is_dir():
            raise UserError(f"--cuda-extra {r}: expected include/ or lib/ inside (e.g. "
                            "site-packages/nvidia/cu13 of the nvidia-cuda-nvrtc wheel)")
    tvm_dir, tvm_version = find_tvm_ffi()
    return Toolchain(
        cuda_home=home, extra_roots=roots, nvcc_release=m.group(1),
        nvcc_version_text=f"{m.group(1)} {m.group(2)}",
        cxx_version=_first_line(in_root(root, ["c++", "--version"])),
        python_version=".".join(map(str, sys.version_info[:3])), tvm_ffi_dir=tvm_dir,
        tvm_ffi_version=tvm_version, host_root=root, userland=os_release(root))


def default_extra_roots() -> list[str]:
    """nvidia/cu13 from the nvrtc/cublas wheels when installed: CUDA 13 here lacks their headers."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    roots = [Path(p) / "cu13" for p in spec.submodule_search_locations]
    return [str(r) for r in roots if (r / "include" / "nvrtc.h").is_file()]


def write_cuda_stubs(tc: Toolchain, out: Path) -> Path:
    """Link-time stub dir: a libcuda.so stub (no driver on build hosts; soname libcuda.so.1 like
    the real stub) and unversioned lib*.so links into the extra roots (wheels ship only .so.N,
    and FlashInfer links with -lnvrtc)."""
    tmp = Path(tempfile.mkdtemp(prefix=".stubs-", dir=out.parent))
    try:
        real_stub = tc.cuda_home / "lib64" / "stubs" / "libcuda.so"
        if not real_stub.exists():
            src = tmp / "empty.c"
            src.write_text("/* link-time stand-in for the CUDA driver */\n")
            subprocess.run(tc.run_argv(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                                        "-o", str(tmp / "libcuda.so"), str(src)]), check=True)
            src.unlink()
            os.symlink("libcuda.so", tmp / "libcuda.so.1")
        for root in tc.extra_roots:
            for lib in sorted((root / "lib").glob("lib*.so.*")):
                base = lib.name.split(".so.")[0] + ".so"
                if ".alt." in lib.name or (tmp / base).exists() \
                        or (tc.cuda_home / "lib64" / base).exists():
                    continue
                os.symlink(lib, tmp / base)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------------------------
# Ninja parsing (FlashInfer's build description)
# --------------------------------------------------------------------------------------------

_NINJA_VAR = re.compile(r"\$(\$|:| |\{[\w-]+\}|[\w-]+)")


def _ninja_eval(value: str, scope: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        tok = m.group(1)
        if tok in ("$", ":", " "):
            return tok
        return scope.get(tok.strip("{}"), "")
    return _NINJA_VAR.sub(sub, value)


@dataclasses.dataclass
class NinjaBuild:
    outputs: list[str]
    rule: str
    inputs: list[str]
    command: str  # fully expanded


def parse_ninja(text: str) -> list[NinjaBuild]:
    """The subset of ninja that FlashInfer's generate_ninja_build_for_op writes: top-level
    variables, rules with `command`, and build statements (no nested scopes beyond that)."""
    joined = re.sub(r"\$\n[ \t]*", "", text)  # `$` at end of line continues it
    top: dict[str, str] = {}
    rules: dict[str, dict[str, str]] = {}
    builds: list[tuple[list[str], str, list[str], dict[str, str]]] = []
    current: dict[str, str] | None = None
    for raw in joined.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        indented = raw[0] in " \t"
        line = raw.strip()
        if indented:
            if current is None:
                raise UserError(f"FlashInfer ninja: indented line outside a block: {line!r}")
            k, _, v = line.partition("=")
            current[k.strip()] = v.strip()
            continue
        if line.startswith("rule "):
            current = rules.setdefault(line[5:].strip(), {})
        elif line.startswith("build "):
            outs, _, rest = line[6:].partition(":")
            parts = rest.split()
            current = {}
            builds.append((outs.split(), parts[0], parts[1:], current))
        elif line.startswith("default ") or line.startswith("ninja_required_version"):
            current = None
        else:
            k, _, v = line.partition("=")
            top[k.strip()] = _ninja_eval(v.strip(), top)
            current = None
    result = []
    for outputs, rule, ins, local in builds:
        if rule not in rules or "command" not in rules[rule]:
            raise UserError(f"FlashInfer ninja: build uses unknown rule {rule!r}")
        scope = {**top, **{k: _ninja_eval(v, top) for k, v in local.items()},
                 "in": " ".join(ins), "out": " ".join(outputs)}
        result.append(NinjaBuild(outputs, rule, ins, _ninja_eval(rules[rule]["command"], scope)))
    return result


def _drop_depfile_flags(argv: list[str]) -> list[str]:
    # Depfiles feed ninja's header tracking. Here every object already depends on the whole tree
    # (digest / Bazel inputs), and an extra .d output would be undeclared in a Bazel action.
    out: list[str] = []
    skip_next = False
    for a in argv:
        if skip_next:
            skip_next = False
        elif a in ("-MMD", "--generate-dependencies-with-compile"):
            continue
        elif a == "-MF":
            skip_next = True
        else:
            out.append(a)
    return out


def _mem_hint(obj_name: str, arch: str) -> int:
    for needle, mb in _MEM_HINTS_BY_ARCH_MB.get(arch.split(".")[0], ()) + _MEM_HINTS_MB:
        if needle in obj_name:
            return mb
    return _DEFAULT_MEM_MB


_ABS_PATH = re.compile(r"(?:^|[=,:]|^-[IL]|^-isystem)(/[^\s]*)")


def placeholderize(arg: str, replacements: Sequence[tuple[str, str]]) -> str:
    for real, ph in replacements:
        arg = arg.replace(real, ph)
    return arg


def plan_module(probe: Mapping[str, Any], mod: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """One module's plan entry from the probe's ninja text, with placeholders for host paths."""
    name = mod["name"]
    paths = probe["paths"]
    replacements = sorted([
        (mod["gen_dir"], "@GEN@"),
        (mod["build_dir"] + "/", ""),  # objects are named relative to the module
        (paths["tree"], "@TREE@"),
        (paths["cuda_home"], "@CUDA_HOME@"),
        (paths["py_include"], "@PY_INCLUDE@"),
        (paths["tvm_ffi"], "@TVM_FFI@"),
    ], key=lambda kv: -len(kv[0]))
    objects: list[dict[str, Any]] = []
    link: dict[str, Any] | None = None
    for b in parse_ninja(mod["ninja"]):
        argv = _drop_depfile_flags(shlex.split(b.command))
        if b.rule in ("compile", "cuda_compile"):
            (src,), (out,) = b.inputs, b.outputs
            argv = [{src: "@INPUT@", out: "@OUTPUT@"}.get(a, a) for a in argv]
            argv = [placeholderize(a, replacements) for a in argv]
            obj = Path(out).name
            objects.append({"out": obj, "src": placeholderize(src, replacements),
                            "kind": "cuda" if b.rule == "cuda_compile" else "cxx",
                            "mem_mb": _mem_hint(obj, arch), "args": argv})
        elif b.rule in ("link", "nvcc_link"):
            ins = set(b.inputs)
            argv = [a for a in argv if a not in ins]
            pos = argv.index(b.outputs[0])
            argv = [placeholderize(a, replacements) for a in argv]
            argv[pos] = "@OUTPUT@"
            # The objects go where FlashInfer put $in (right after the linker).
            argv[1:1] = ["@OBJECTS@"]
            link = {"kind": b.rule, "args": argv}
        else:
            raise UserError(f"FlashInfer ninja for {name}: unknown rule {b.rule!r}; update "
                            "tools/kernel_cache for this FlashInfer version")
    if link is None or not objects:
        raise UserError(f"FlashInfer ninja for {name}: no link or no objects")
    for entry in [*objects, link]:
        for a in entry["args"]:
            m = _ABS_PATH.search(a)
            if m and not m.group(1).startswith(("/usr/include", "/usr/lib")):
                raise UserError(f"module {name}: argument {a!r} keeps a host path no placeholder "
                                "covers; extend placeholderize() in tools/kernel_cache")
    names = [o["out"] for o in objects]
    if len(set(names)) != len(names):
        raise UserError(f"module {name}: two sources map to one object name; FlashInfer's own "
                        "ninja build would collide too")
    # rglob order (generated .cu files) depends on the filesystem: sort so plans and link
    # order are reproducible.
    objects.sort(key=lambda o: o["out"])
    return {"name": name, "generator": mod["generator"], "kwargs": mod["kwargs"],
            "gen_digest": mod["gen_digest"], "gen_files": mod["gen_files"],
            "objects": objects, "link": link}


_MOE_INSTANCE = re.compile(r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(([^;]*?)\);", re.S)


def moe_instantiations(gen_dir: Path) -> list[str]:
    """The CUTLASS MoE GEMM template instantiations in a module's generated sources, one
    normalized argument string each (arch, activation type, weight type, output type, ...)."""
    found = set()
    for f in sorted(gen_dir.rglob("*.generated.cu")):
        for m in _MOE_INSTANCE.finditer(f.read_text()):
            found.add(", ".join(a.strip() for a in m.group(1).split(",")))
    return sorted(found)


# --------------------------------------------------------------------------------------------
# The probe: FlashInfer's generators, run from the tree in a clean subprocess
# --------------------------------------------------------------------------------------------

def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLASHINFER_") and k not in _LEAKY_ENV and k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def run_probe(tree: Path, decls: Sequence[ModuleDecl], arch: str, variant: str,
              tc: Toolchain, gen_out: Path | None = None, python: str | None = None) -> dict:
    """Call each generator from the tree; return paths and per-module ninja text and digests.
    With gen_out, each module's generated sources are also copied to gen_out/<module>/."""
    work = Path(tempfile.mkdtemp(prefix="kc-probe-"))
    try:
        request = {"modules": [{"name": d.name, "generator": d.generator,
                                "kwargs": d.kwargs_for(variant)} for d in decls],
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
            [python or sys.executable, "-s", "-m", "tools.kernel_cache", "_probe"], input=json.dumps(request), capture_output=True, text=True, env=env,
            cwd=work)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise UserError(f"--flashinfer-tree {tree}: FlashInfer generator probe failed "
                            f"(is the tree a flashinfer wheel and torch/tvm_ffi installed?):\n{tail}")
        return json.loads(proc.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _probe_main() -> int:
    """Runs inside the subprocess with the tree first on sys.path."""
    import importlib

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
        spec = getattr(importlib.import_module(mod_name), fn_name)(**m["kwargs"])
        if spec.name != m["name"]:
            print(f"generator {m['generator']} returned module {spec.name!r}, modules.json says "
                  f"{m['name']!r}", file=sys.stderr)
            return 4
        ninja = cpp_ext.generate_ninja_build_for_op(
            name=spec.name, sources=spec.sources, extra_cflags=spec.extra_cflags,
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
            "gen_files": files, "gen_digest": dir_digest(gen_dir)})
    if default_gen.exists() and any(default_gen.rglob("*.cu")):
        print("a generator wrote into the default FLASHINFER_GEN_SRC_DIR", file=sys.stderr)
        return 6
    json.dump(result, sys.stdout)
    return 0


# --------------------------------------------------------------------------------------------
# Plan (a checked-in Starlark file)
# --------------------------------------------------------------------------------------------

def make_plan(tree: Path, modules_path: Path, arch: str, variant: str, tc: Toolchain,
              python: str | None = None, gen_out: Path | None = None,
              enforce_markers: bool = True) -> dict[str, Any]:
    """enforce_markers=False only for comparing commands against an unpatched wheel."""
    tree = check_tree(tree)
    decls = [d for d in load_modules(modules_path) if d.applies_to(arch)]
    if not decls:
        raise UserError(f"--modules {modules_path}: no module applies to arch {arch}")
    markers = check_markers(tree, decls) if enforce_markers else []
    log(f"probing {len(decls)} FlashInfer generators for arch {arch} ({variant})")
    probe = run_probe(tree, decls, arch, variant, tc, gen_out=gen_out, python=python)
    modules = [plan_module(probe, m, arch) for m in probe["modules"]]
    return {
        "schema_version": PLAN_SCHEMA,
        "flashinfer_version": probe["flashinfer_version"],
        "arch": arch,
        "variant": variant,
        "patched_source_digest": flashinfer_source_digest(tree),
        "nvcc_release": tc.nvcc_release,
        "source_markers": markers,
        "modules": modules,
        "object_count": sum(len(m["objects"]) for m in modules),
    }


def starlark_literal(value: Any, indent: int = 0) -> str:
    """A value as a Starlark (= Python) literal, laid out like json.dumps(indent=1, sort_keys).
    Not JSON itself: Starlark spells booleans and null True/False/None (kwargs such as
    use_fast_build are booleans). Strings use JSON escapes, which Starlark reads the same way
    for the ASCII text plans hold."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, (int, str)):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {starlark_literal(v, indent + 1)}"
                 for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        items = [f"{inner}{starlark_literal(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    raise TypeError(f"plan value of type {type(value).__name__} has no Starlark literal")


def render_plan(plan: Mapping[str, Any]) -> str:
    # One file for both sides: Bazel loads it (objects known at analysis time), the tool reads
    # it back with ast.literal_eval (Starlark's literal subset is Python's).
    body = starlark_literal(plan)
    return ("# Generated by `tools/kernel_cache plan`; do not edit. Checked in like a lock:\n"
            "# a CPU test regenerates it from the patched tree and fails on any drift.\n"
            f"KERNEL_CACHE_PLAN = {body}\n")


def read_plan(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"--plan {path}: cannot read ({e}); generate it with "
                        "`tools/kernel_cache plan`") from None
    _, sep, body = text.partition("KERNEL_CACHE_PLAN = ")
    try:
        plan = ast.literal_eval(body) if sep else None
    except (ValueError, SyntaxError):
        plan = None
    if not isinstance(plan, dict) or plan.get("schema_version") != PLAN_SCHEMA:
        raise UserError(f"--plan {path}: not a kernel cache plan (schema {PLAN_SCHEMA}); "
                        "regenerate it with `tools/kernel_cache plan`")
    return plan


def describe_drift(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """First difference between two plans, named by module/object/field, or None."""
    for key in ("flashinfer_version", "arch", "variant", "patched_source_digest", "nvcc_release"):
        if old.get(key) != new.get(key):
            return f"{key}: checked in {old.get(key)!r}, generated {new.get(key)!r}"
    om = {m["name"]: m for m in old["modules"]}
    nm = {m["name"]: m for m in new["modules"]}
    if sorted(om) != sorted(nm):
        return f"modules: checked in {sorted(om)}, generated {sorted(nm)}"
    for name in sorted(nm):
        a, b = om[name], nm[name]
        if a["gen_digest"] != b["gen_digest"]:
            return f"module {name}: generated sources differ (gen_digest)"
        ao = {o["out"]: o for o in a["objects"]}
        bo = {o["out"]: o for o in b["objects"]}
        if sorted(ao) != sorted(bo):
            return (f"module {name}: objects differ: only checked in "
                    f"{sorted(set(ao) - set(bo))[:3]}, only generated {sorted(set(bo) - set(ao))[:3]}")
        for out in sorted(bo):
            if ao[out] != bo[out]:
                diff = [x for x in bo[out]["args"] if x not in ao[out]["args"]] or \
                    [x for x in ao[out]["args"] if x not in bo[out]["args"]]
                return f"module {name} object {out}: command differs (e.g. {diff[:2]})"
        if a["link"] != b["link"]:
            return f"module {name}: link command differs"
    return None if old == new else "plan differs outside modules"


# --------------------------------------------------------------------------------------------
# Commands from the plan
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fill:
    """Values for the plan's placeholders on this host."""
    tree: Path
    gen_dir: Path
    tc: Toolchain

    def prefix_maps(self) -> list[tuple[str, str]]:
        """Host path -> fixed path, for -ffile-prefix-map: objects must not embed where the tree,
        generated sources, CUDA or the venv happened to live (Bazel sandboxes differ per run)."""
        maps = [(str(self.tree), "/kimi-k3/flashinfer-tree"), (str(self.gen_dir), "/kimi-k3/gen"),
                (str(self.tc.cuda_home), "/kimi-k3/cuda"),
                (str(self.tc.tvm_ffi_dir), "/kimi-k3/tvm_ffi"),
                (sysconfig.get_path("include"), "/kimi-k3/python-include")]
        maps += [(str(r), f"/kimi-k3/extra{i}") for i, r in enumerate(self.tc.extra_roots)]
        return sorted(maps, key=lambda kv: -len(kv[0]))

    def apply(self, arg: str) -> str:
        return (arg.replace("@TREE@", str(self.tree)).replace("@GEN@", str(self.gen_dir))
                .replace("@CUDA_HOME@", str(self.tc.cuda_home))
                .replace("@PY_INCLUDE@", sysconfig.get_path("include"))
                .replace("@TVM_FFI@", str(self.tc.tvm_ffi_dir)))


def _check_nvcc(plan: Mapping[str, Any], tc: Toolchain) -> None:
    # FlashInfer picks some nvcc flags by CUDA release (e.g. -static-global-template-stub).
    if plan["nvcc_release"] != tc.nvcc_release:
        raise UserError(f"--cuda-home {tc.cuda_home}: nvcc {tc.nvcc_release}, but the plan was "
                        f"made for nvcc {plan['nvcc_release']}; regenerate the plan or pin CUDA")


def fixed_path(path: str, fill: Fill) -> str:
    """A host path as the prefix maps rewrite it (e.g. /kimi-k3/flashinfer-tree/...)."""
    for real, fixed in fill.prefix_maps():
        if path == real or path.startswith(real + "/"):
            return fixed + path[len(real):]
    return path


def compile_argv(obj: Mapping[str, Any], fill: Fill, out: Path) -> list[str]:
    maps = [f"-ffile-prefix-map={real}={fixed}" for real, fixed in fill.prefix_maps()]
    if obj["kind"] == "cuda":
        maps = [f"-Xcompiler={m}" for m in maps]  # nvcc hands these to every gcc step
        # cudafe++ derives the "module id" in internal-linkage device symbol names
        # (_INTERNAL_<hash>_7_norm_cu_...) from the source's real absolute path; no prefix map
        # reaches it. Naming the source by its fixed path makes the id (and so the object)
        # independent of where the tree lives (measured: norm's csrc_norm.cuda.o differed
        # between two tree paths without this; identical with it).
        maps += ["-Xcudafe", "--orig_src_path_name=" + fixed_path(fill.apply(obj["src"]), fill)]
    argv: list[str] = []
    for i, a in enumerate(obj["args"]):
        if i == 1:
            argv += maps
        argv.append({"@INPUT@": fill.apply(obj["src"]), "@OUTPUT@": str(out)}.get(a) or
                    fill.apply(a))
        # Wheel roots (nvrtc, cublas headers) come right after CUDA's own include dir.
        if a == "@CUDA_HOME@/include" and argv[-2:-1] == ["-isystem"]:
            for r in fill.tc.extra_roots:
                if (r / "include").is_dir():
                    argv += ["-isystem", str(r / "include")]
    return argv


def link_argv(module: Mapping[str, Any], fill: Fill, objects: Sequence[Path], out: Path,
              stub_dir: Path) -> list[str]:
    argv: list[str] = []
    for a in module["link"]["args"]:
        if a == "@OBJECTS@":
            argv += [str(o) for o in objects]
        elif a == "@OUTPUT@":
            argv.append(str(out))
        else:
            argv.append(fill.apply(a))
    return argv + [f"-L{stub_dir}"]


def object_key(plan: Mapping[str, Any], module: Mapping[str, Any], obj: Mapping[str, Any],
               tc_digest: str) -> str:
    """Content address of one object: its command (host-independent, with placeholders), the
    whole patched tree (covers every header), the module's generated sources, the toolchain."""
    material = {"args": obj["args"], "src": obj["src"],
                "patched_source_digest": plan["patched_source_digest"],
                "gen_digest": module["gen_digest"], "toolchain": tc_digest}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def run_tool(argv: Sequence[str], nice: int, what: str, tc: Toolchain) -> float:
    cmd = (["nice", "-n", str(nice)] if nice else []) + tc.run_argv(argv)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        if "unsupported GNU version" in proc.stderr and tc.host_root is None:
            raise UserError(f"{what}: nvcc refuses this host compiler (e.g. gcc 16 in tools/bazel's "
                            "sealed sid root); run compilers in the host root: --host-root DIR "
                            "(tools/bazel mounts the host at /run/kimi-k3-host)")
        raise UserError(f"{what}: compiler failed (exit {proc.returncode}); see output above")
    return time.monotonic() - t0


def atomic_output(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would leak into checked-in plans and the image
    return Path(tmp)


def parse_only(values: Sequence[str]) -> list[str]:
    """--only may repeat and each value may be comma separated (the Bazel flag's form)."""
    return sorted({n.strip() for v in values for n in v.split(",") if n.strip()})


def select_modules(plan: dict[str, Any], only: Sequence[str]) -> dict[str, Any]:
    """The plan restricted to `only` (all modules when empty); unknown names are an error, so a
    typo never silently builds nothing."""
    names = parse_only(only)
    if not names:
        return plan
    known = [m["name"] for m in plan["modules"]]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"--only {','.join(unknown)}: not in the plan for arch {plan['arch']} "
                        f"(modules: {','.join(known)}); fix the name")
    return dict(plan, modules=[m for m in plan["modules"] if m["name"] in names],
                object_count=sum(len(m["objects"]) for m in plan["modules"] if m["name"] in names))


def find_module(plan: Mapping[str, Any], name: str) -> dict[str, Any]:
    for m in plan["modules"]:
        if m["name"] == name:
            return m
    raise UserError(f"--module {name}: not in the plan (has {[m['name'] for m in plan['modules']]})")


# Per-action specs. A Bazel compile action reads only its own object's entry (not the whole
# plan file), so its key is that object's command: lean and full plans share every identical
# object, and regenerating a plan (a new module, a changed memory hint) recompiles only what
# changed. mem_mb is left out: it schedules, it does not change bytes.
SPEC_SCHEMA = 1


def object_spec(plan: Mapping[str, Any], module_name: str, object_name: str) -> dict[str, Any]:
    module = find_module(plan, module_name)
    for o in module["objects"]:
        if o["out"] == object_name:
            return {"spec": "object", "schema_version": SPEC_SCHEMA, "module": module_name,
                    "nvcc_release": plan["nvcc_release"],
                    "object": {k: v for k, v in o.items() if k != "mem_mb"}}
    raise UserError(f"--object {object_name}: not an object of {module_name}")


def link_spec(plan: Mapping[str, Any], module_name: str) -> dict[str, Any]:
    module = find_module(plan, module_name)
    return {"spec": "link", "schema_version": SPEC_SCHEMA, "module": module_name,
            "nvcc_release": plan["nvcc_release"], "link": module["link"],
            "objects": [o["out"] for o in module["objects"]]}


def read_spec(path: Path, kind: str) -> dict[str, Any]:
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--spec {path}: unreadable ({e}); it is written by kernel_cache/defs.bzl")
    if not isinstance(spec, dict) or spec.get("spec") != kind or spec.get("schema_version") != SPEC_SCHEMA:
        raise UserError(f"--spec {path}: not a {kind} spec of schema {SPEC_SCHEMA}; rebuild with "
                        "this checkout's kernel_cache/defs.bzl")
    return spec


def _need(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    if value is None:
        raise UserError(f"{args.cmd}: pass --spec, or --{name} (with --plan/--module"
                        f"{'/--object' if args.cmd == 'compile-object' else ''})")
    return value


_NVCC_TEMP_NAME = re.compile(rb"tmpxft_[0-9a-f]{8}_")


def zero_nvcc_temp_names(obj_file: Path) -> None:
    """nvcc compiles host code from a temp file tmpxft_<pid>_..., and that name lands in the
    object (an STT_FILE symbol and the _GLOBAL__sub_I_ static-init symbol). Both are local
    symbol names, so the pid is zeroed in place (same length): identical inputs then give
    identical objects. No nvcc flag fixes the name."""
    data = obj_file.read_bytes()
    fixed = _NVCC_TEMP_NAME.sub(b"tmpxft_00000000_", data)
    if fixed != data:
        obj_file.write_bytes(fixed)


def compile_one(module: Mapping[str, Any], obj: Mapping[str, Any], fill: Fill, out: Path,
                nice: int) -> float:
    tmp = atomic_output(out)
    try:
        secs = run_tool(compile_argv(obj, fill, tmp), nice, f"{module['name']}/{obj['out']}",
                        fill.tc)
        if obj["kind"] == "cuda":
            zero_nvcc_temp_names(tmp)
        os.replace(tmp, out)
        return secs
    finally:
        tmp.unlink(missing_ok=True)


def link_one(module: Mapping[str, Any], fill: Fill, objects: Sequence[Path], out: Path,
             stub_dir: Path) -> None:
    tmp = atomic_output(out)
    try:
        run_tool(link_argv(module, fill, objects, tmp, stub_dir), 0, f"link {module['name']}",
                 fill.tc)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_cache_json(plan: Mapping[str, Any], tc: Toolchain, module_sos: Mapping[str, Path],
                     aot_dir: Path) -> dict[str, Any]:
    data = {
        "schema_version": CACHE_JSON_SCHEMA,
        "flashinfer_version": plan["flashinfer_version"],
        "patched_source_digest": plan["patched_source_digest"],
        "arch_list": plan["arch"],
        "variant": plan["variant"],
        "source_markers": plan["source_markers"],
        "toolchain": tc.identity(),
        "toolchain_digest": tc.digest(),
        "plan_digest": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest(),
        "modules": {
            m["name"]: {
                "path": f"{m['name']}/{m['name']}.so",
                "sha256": sha256_file(module_sos[m["name"]]),
                "generator": m["generator"], "kwargs": m["kwargs"],
                "objects": len(m["objects"]),
                "flags": {"compile": sorted({" ".join(o["args"]) for o in m["objects"]}),
                          "link": " ".join(m["link"]["args"])},
            } for m in plan["modules"]},
    }
    (aot_dir / CACHE_JSON_NAME).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def assemble(plan: Mapping[str, Any], tc: Toolchain, module_sos: Mapping[str, Path],
             out: Path) -> dict[str, Any]:
    """Write OUT/flashinfer/data/aot/<m>/<m>.so and kernel_cache.json, atomically."""
    missing = [m["name"] for m in plan["modules"] if m["name"] not in module_sos]
    if missing:
        raise UserError(f"assemble: no .so given for modules {missing}; pass --module-so NAME=PATH")
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        aot = tmp / AOT_SUBDIR
        for name, so in module_sos.items():
            (aot / name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, aot / name / f"{name}.so")
        data = write_cache_json(plan, tc, {n: aot / n / f"{n}.so" for n in module_sos}, aot)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return data
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# The non-Bazel build: parallel within a memory budget, content-addressed, resumable
# --------------------------------------------------------------------------------------------

# Every object and module in the build cache has a record beside it, <file>.sha256 (JSON: size
# and sha256), written atomically after the file itself. A file is reused only when it matches
# its record: a file without one (a run killed between the two renames, a cache from before
# records) or one that differs (truncated, corrupted, overwritten) is rebuilt, never linked.
RECORD_SUFFIX = ".sha256"


def record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def write_record(path: Path) -> None:
    rec = record_path(path)
    tmp = atomic_output(rec)
    try:
        tmp.write_text(json.dumps({"size": path.stat().st_size, "sha256": sha256_file(path)},
                                  sort_keys=True) + "\n")
        os.replace(tmp, rec)
    finally:
        tmp.unlink(missing_ok=True)


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


@dataclasses.dataclass
class Job:
    module: dict[str, Any]
    obj: dict[str, Any]
    key: str
    path: Path


class Progress:
    def __init__(self, total: int, already: int) -> None:
        self.total, self.done, self.t0 = total, already, time.monotonic()
        self.compiled = 0
        self.lock = threading.Lock()

    def tick(self, what: str, secs: float) -> None:
        with self.lock:
            self.done += 1
            self.compiled += 1
            el = time.monotonic() - self.t0
            left = self.total - self.done
            eta = el / self.compiled * left if self.compiled else 0.0
            log(f"{self.done}/{self.total} objects  {what} {secs:.1f}s  elapsed {el:.0f}s  "
                f"ETA {eta:.0f}s")


def run_jobs(jobs: list[Job], fill_for: Callable[[Job], Fill], jobs_n: int, mem_budget_mb: int,
             nice: int, progress: Progress) -> None:
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
          plan_path: Path | None = None, only: Sequence[str] = ()) -> dict[str, Any]:
    """Objects and modules are shared through cache_dir (content-addressed, each checked against
    its record before reuse); generated sources and link stubs are this run's own: another build
    may be using the same cache (and tree) at the same time."""
    tree = check_tree(tree)
    (cache_dir / "gen").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(
        prefix=f"{hashlib.sha256(str(tree).encode()).hexdigest()[:16]}-", dir=cache_dir / "gen"))
    try:
        return _build_in(tree, modules_path, arch, variant, out, jobs_n, cache_dir, tc,
                         mem_budget_mb, nice, plan_path, only, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _build_in(tree: Path, modules_path: Path, arch: str, variant: str, out: Path, jobs_n: int,
              cache_dir: Path, tc: Toolchain, mem_budget_mb: int, nice: int,
              plan_path: Path | None, only: Sequence[str], run_dir: Path) -> dict[str, Any]:
    gen_root = run_dir / "gen"
    plan = make_plan(tree, modules_path, arch, variant, tc, gen_out=gen_root)
    if plan_path is not None:
        drift = describe_drift(read_plan(plan_path), plan)
        if drift:
            raise UserError(f"--plan {plan_path}: drift from the tree: {drift}; regenerate it")
    plan = select_modules(plan, only)
    _check_nvcc(plan, tc)
    tc_digest = tc.digest()
    jobs: list[Job] = []
    for m in plan["modules"]:
        for o in m["objects"]:
            key = object_key(plan, m, o, tc_digest)
            jobs.append(Job(m, o, key, cache_dir / "objects" / key[:2] / f"{key}.o"))
    todo = [j for j in jobs if not cached_file_ok(j.path)]
    log(f"{len(jobs)} objects in {len(plan['modules'])} modules; {len(jobs) - len(todo)} cached, "
        f"{len(todo)} to compile with -j {jobs_n} (memory budget {mem_budget_mb} MiB)")
    progress = Progress(len(jobs), len(jobs) - len(todo))
    run_jobs(todo, lambda j: Fill(tree, gen_root / j.module["name"], tc), jobs_n, mem_budget_mb,
             nice, progress)
    stub_dir = write_cuda_stubs(tc, run_dir / "stubs")
    sos: dict[str, Path] = {}
    for m in plan["modules"]:
        objs = [j.path for j in jobs if j.module is m]
        link_key = hashlib.sha256(json.dumps(
            {"link": m["link"], "objects": [p.name for p in objs], "tc": tc_digest},
            sort_keys=True).encode()).hexdigest()
        so = cache_dir / "modules" / link_key[:2] / f"{link_key}.so"
        if not cached_file_ok(so):
            log(f"linking {m['name']} ({len(objs)} objects)")
            link_one(m, Fill(tree, gen_root / m["name"], tc), objs, so, stub_dir)
            write_record(so)
        sos[m["name"]] = so
    data = assemble(plan, tc, sos, out)
    log(f"wrote {out / AOT_SUBDIR} ({len(sos)} modules) in {time.monotonic() - progress.t0:.0f}s")
    return data


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------

def find_cuobjdump(tc: Toolchain | None, explicit: str | None) -> str:
    candidates = [explicit] if explicit else []
    if tc is not None:
        candidates += [str(tc.cuda_home / "bin" / "cuobjdump")]
        candidates += [str(r / "bin" / "cuobjdump") for r in tc.extra_roots]
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


def verify(cache: Path, tree: Path, modules_path: Path | None, python: str, tc: Toolchain | None,
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
    cuda_home = tc.cuda_home if tc else Path(os.environ.get("KIMI_CUDA_HOME", "/usr/local/cuda"))
    with tempfile.TemporaryDirectory(prefix="kc-driver-") as stub_tmp:
        stub_dir = None
        if driver_stub:
            # No GPU driver on CPU hosts: an empty libcuda.so.1 lets the loader resolve the
            # DT_NEEDED entry so a module that calls no driver symbol at load time can load.
            stub_dir = Path(stub_tmp)
            (stub_dir / "e.c").write_text("\n")
            subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                            str(stub_dir / "libcuda.so.1"), str(stub_dir / "e.c")], check=True)
        extra_libs = [str(r / "lib") for r in tc.extra_roots] if tc else []
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


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _add_common(p: argparse.ArgumentParser, tree: bool = True) -> None:
    if tree:
        p.add_argument("--flashinfer-tree", type=Path, required=True,
                       help="patched tree (directory holding flashinfer/)")
    p.add_argument("--cuda-home", default=None,
                   help="CUDA root (default $KIMI_CUDA_HOME or /usr/local/cuda)")
    p.add_argument("--cuda-extra", action="append", default=None,
                   help="extra root with include/ and lib/ (nvidia/cu13 of the nvrtc/cublas "
                        "wheels); default: found in the running interpreter")
    p.add_argument("--nice", type=int, default=10, help="niceness of compiler processes")
    p.add_argument("--host-root", default=None,
                   help="root filesystem to run compilers in (chroot): a path, 'none', or 'auto' "
                        "(default: $KIMI_K3_HOST_ROOT, else /run/kimi-k3-host if tools/bazel "
                        "mounted the host there, else none)")


def _toolchain(args: argparse.Namespace) -> Toolchain:
    extra = args.cuda_extra if args.cuda_extra is not None else default_extra_roots()
    return load_toolchain(args.cuda_home, extra, args.host_root)


def _parse_kv(items: Sequence[str], what: str) -> dict[str, Path]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise UserError(f"{what} {it!r}: expected NAME=PATH")
        out[k] = Path(v)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_probe"]:
        return _probe_main()
    ap = argparse.ArgumentParser(prog="kernel_cache", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="generate the per-object plan (.bzl) from the tree")
    _add_common(p)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--arch", default="12.0f")
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="full (default): FlashInfer's own flags; lean: use_fast_build=True")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing")

    p = sub.add_parser("gen-sources", help="one module's generated sources (Bazel action)")
    _add_common(p)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--module", required=True)
    p.add_argument("--out", type=Path, required=True, help="directory to create")

    p = sub.add_parser("compile-object", help="compile one object of the plan (Bazel action)")
    _add_common(p)
    p.add_argument("--spec", type=Path,
                   help="the object's own entry (written by defs.bzl; see object_spec) instead of "
                        "--plan/--module/--object")
    p.add_argument("--plan", type=Path)
    p.add_argument("--module")
    p.add_argument("--object", help="object name as in the plan")
    p.add_argument("--gen-dir", type=Path, help="the module's gen-sources output")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("link-module", help="link one module .so (Bazel action)")
    _add_common(p, tree=False)
    p.add_argument("--spec", type=Path,
                   help="the module's link entry (written by defs.bzl; see link_spec) instead of "
                        "--plan/--module")
    p.add_argument("--plan", type=Path)
    p.add_argument("--module")
    p.add_argument("--objects-dir", type=Path, required=True,
                   help="directory holding the module's objects under their plan names")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("assemble", help="write the AOT layout + kernel_cache.json (Bazel action)")
    _add_common(p, tree=False)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--module-so", action="append", default=[], help="NAME=PATH")
    p.add_argument("--only", action="append", default=[],
                   help="assemble only these modules (comma separated or repeated)")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("build", help="build everything without Bazel (resumable)")
    _add_common(p)
    p.add_argument("--modules", type=Path, required=True)
    p.add_argument("--arch", default="12.0f")
    p.add_argument("--variant", choices=VARIANTS, default="full",
                   help="full (default): FlashInfer's own flags; lean: use_fast_build=True")
    p.add_argument("--plan", type=Path, help="fail if this checked-in plan drifted")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("-j", "--jobs", type=int, default=1)
    p.add_argument("--mem-budget-mb", type=int, default=16000)
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("KIMI_K3_CACHE") or Path(os.environ.get(
                       "XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-k3-build") / "kernels")
    p.add_argument("--only", action="append", default=[], help="build only these modules")

    p = sub.add_parser("verify", help="check ELF arch, digests and clean-env resolution")
    _add_common(p)
    p.add_argument("--cache", type=Path, required=True, help="output of build/assemble")
    p.add_argument("--modules", type=Path)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cuobjdump")
    p.add_argument("--arch", help="required arch list (default: the one in kernel_cache.json)")
    p.add_argument("--only", action="append", default=[],
                   help="require only these modules of --modules (a subset build)")
    p.add_argument("--no-load", action="store_true",
                   help="only check resolution, not dlopen (hosts without a CUDA driver)")
    p.add_argument("--driver-stub", action="store_true",
                   help="put an empty libcuda.so.1 on LD_LIBRARY_PATH for the load check")

    p = sub.add_parser("cuda-stubs", help="write the link-time stub dir")
    _add_common(p, tree=False)
    p.add_argument("--out", type=Path, required=True)

    args = ap.parse_args(argv)
    if args.cmd == "plan":
        check_arch(args.arch)
        tc = _toolchain(args)
        plan = make_plan(args.flashinfer_tree, args.modules, args.arch, args.variant, tc)
        if args.check:
            drift = describe_drift(read_plan(args.out), plan)
            if drift:
                raise UserError(f"--out {args.out}: plan drifted from the tree: {drift}; "
                                "regenerate it with `tools/kernel_cache plan`")
            log(f"{args.out}: up to date ({plan['object_count']} objects)")
            return 0
        tmp = atomic_output(args.out)
        tmp.write_text(render_plan(plan))
        os.replace(tmp, args.out)
        log(f"wrote {args.out}: {len(plan['modules'])} modules, {plan['object_count']} objects")
        return 0
    if args.cmd == "gen-sources":
        plan = read_plan(args.plan)
        tc = _toolchain(args)
        decls = [d for d in load_modules(args.modules) if d.name == args.module]
        if not decls:
            raise UserError(f"--module {args.module}: not in {args.modules}")
        module = find_module(plan, args.module)
        tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.absolute().parent))
        try:
            run_probe(check_tree(args.flashinfer_tree), decls, plan["arch"], plan["variant"], tc,
                      gen_out=tmp)
            got = dir_digest(tmp / args.module)
            if got != module["gen_digest"]:
                raise UserError(f"module {args.module}: generated sources {got[:16]} differ from "
                                f"the plan's {module['gen_digest'][:16]}; regenerate the plan")
            if args.out.exists():
                shutil.rmtree(args.out)
            os.replace(tmp / args.module, args.out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    if args.cmd == "compile-object":
        spec = (read_spec(args.spec, "object") if args.spec else
                object_spec(read_plan(_need(args, "plan")), _need(args, "module"),
                            _need(args, "object")))
        tc = _toolchain(args)
        _check_nvcc(spec, tc)
        module, obj = {"name": spec["module"]}, spec["object"]
        args.module, args.object = spec["module"], obj["out"]
        if args.gen_dir is None and "@GEN@" in json.dumps(obj):
            raise UserError(f"--object {args.object}: uses generated sources; pass --gen-dir "
                            "(the gen-sources output of this module)")
        fill = Fill(check_tree(args.flashinfer_tree),
                    (args.gen_dir or Path("/nonexistent")).absolute(), tc)
        log(f"{args.module}: compiling {args.object}")
        secs = compile_one(module, obj, fill, args.out.absolute(), args.nice)
        log(f"{args.module}: {args.object} done in {secs:.1f}s")
        return 0
    if args.cmd == "link-module":
        spec = (read_spec(args.spec, "link") if args.spec else
                link_spec(read_plan(_need(args, "plan")), _need(args, "module")))
        tc = _toolchain(args)
        _check_nvcc(spec, tc)
        module = {"name": spec["module"], "link": spec["link"]}
        objects = [args.objects_dir.absolute() / o for o in spec["objects"]]
        missing = [o.name for o in objects if not o.is_file()]
        if missing:
            raise UserError(f"--objects-dir {args.objects_dir}: missing {missing[:3]}")
        with tempfile.TemporaryDirectory() as t:
            stubs = write_cuda_stubs(tc, Path(t) / "stubs")
            link_one(module, Fill(Path("/nonexistent"), Path("/nonexistent"), tc), objects,
                     args.out.absolute(), stubs)
        return 0
    if args.cmd == "assemble":
        plan = read_plan(args.plan)
        tc = _toolchain(args)
        assemble(select_modules(plan, args.only), tc, _parse_kv(args.module_so, "--module-so"),
                 args.out)
        return 0
    if args.cmd == "build":
        check_arch(args.arch)
        tc = _toolchain(args)
        build(args.flashinfer_tree, args.modules, args.arch, args.variant, args.out, args.jobs,
              args.cache_dir.absolute(), tc, args.mem_budget_mb, args.nice, args.plan, args.only)
        return 0
    if args.cmd == "verify":
        tc = _toolchain(args)
        report = verify(args.cache, args.flashinfer_tree, args.modules, args.python, tc,
                        args.cuobjdump, not args.no_load, args.driver_stub, args.arch,
                        only=parse_only(args.only))
        print(json.dumps(report, indent=1, sort_keys=True))
        return 0
    if args.cmd == "cuda-stubs":
        write_cuda_stubs(_toolchain(args), args.out.absolute())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(run_cli(main))
