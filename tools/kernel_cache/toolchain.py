"""The toolchain the objects are compiled with, every part of it an explicit input:

  - the CUDA root (nvcc): by default the one assembled from the lock's "cuda-13.0" wheels
    (@kimi_cuda, identified by its pins' sha256 in kimi-k3-toolchain.json); a local CUDA install
    only when named (--cuda-home, the escape hatch: identified by its path and nvcc's version);
  - the host compiler userland nvcc drives: Debian bookworm's g++-12 and binutils with glibc 2.36
    and libstdc++ headers, unpacked from pinned .debs (@kimi_cxx_userland, identified by the .debs'
    sha256), used through --sysroot and small wrapper scripts, never by chroot: nvcc 13.0 rejects
    newer compilers (gcc 16: "unsupported GNU version") and glibc 2.43's math headers, so the
    compiler cannot be whatever the machine has;
  - tvm-ffi's headers, from the stack's own apache-tvm-ffi wheel (the one the image ships);
  - Python's headers, from the userland's libpython3.11-dev (the image's interpreter).

Nothing is probed on the host: the identity that goes into kernel_cache.json and the non-Bazel
build's object keys is read from those pinned bytes.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically
from tools.common.hashing import sha256_bytes
from tools.kernel_cache.tree import dir_digest

# Written by tools/kernel_cache/private/toolchain_repos.bzl into the pinned CUDA root.
CUDA_IDENTITY_FILE = "kimi-k3-toolchain.json"
# Written by `python3 -m tools.fetch.debian extract` into an unpacked Debian set.
USERLAND_IDENTITY_FILE = ".debian-set.json"
# Written by `python3 -m tools.kernel_cache unpack-tvm-ffi` beside include/.
TVM_FFI_IDENTITY_FILE = "kimi-k3-tvm-ffi.json"
# The userland's compiler (its major version is what nvcc 13.0 accepts).
USERLAND_GCC_MAJOR = "12"
# Loader-level libraries of the userland that must not shadow the running system's own glibc and
# C++ runtime: only the compilers' private libraries (isl, mpc, mpfr, gmp, bfd, ...) are taken
# from the userland at run time. Bookworm's binaries run on any glibc >= 2.36.
_SYSTEM_LIB_PREFIXES = ("ld-linux", "libc.", "libc_", "libm.", "libmvec", "libpthread", "libdl.",
                        "librt.", "libresolv", "libutil", "libanl", "libnss", "libBrokenLocale",
                        "libthread_db", "libmemusage", "libpcprofile", "libstdc++", "libgcc_s")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable {what} identity ({e}); re-fetch it (bazel sync or "
                        "delete the repository)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: {what} identity is not a JSON object; re-fetch it")
    return data


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    cuda_identity: Mapping[str, Any] | None  # the pinned root's pins; None: a local CUDA
    nvcc_release: str
    nvcc_version_text: str
    userland: Path | None  # compiler userland (--sysroot); None: compilers from PATH
    userland_identity: Mapping[str, Any] | None
    cxx_version: str
    tvm_ffi_dir: Path  # holds include/
    tvm_ffi_version: str
    python_include: Path

    # -- running compilers -------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The environment compilers run with: the userland's wrappers and binutils first on
        PATH (gcc finds `as` and `ld` there), its private libraries on LD_LIBRARY_PATH; nothing
        of the caller's compiler settings."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FLASHINFER_", "NVCC_", "CUDA", "LD_", "GCC_", "COMPILER_PATH",
                                    "LIBRARY_PATH", "CPATH", "C_INCLUDE", "CPLUS_INCLUDE"))}
        env["LC_ALL"] = "C"
        if self.userland is None:
            return env
        wrappers, libs = _userland_shims(self.userland)
        env["PATH"] = os.pathsep.join([str(wrappers), str(self.userland / "usr" / "bin"),
                                       "/usr/bin", "/bin"])
        env["LD_LIBRARY_PATH"] = str(libs)
        return env

    def run(self, argv: Sequence[str], nice: int = 0) -> subprocess.CompletedProcess[str]:
        cmd = (["nice", "-n", str(nice)] if nice else []) + list(argv)
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env())

    def prefix_maps(self) -> list[tuple[str, str]]:
        """Where the toolchain's parts live -> fixed paths, for -ffile-prefix-map. The userland maps
        to "" so its headers keep their system paths (/usr/include/...): objects then equal those
        of a bookworm host whose compiler is the same package. Each part is mapped by the path it
        was given and by where its files really are: nvcc and gcc find their own include dirs
        from their real location (/proc/self/exe), which in a Bazel sandbox (a forest of links to
        the output base) is the output base's, different on every machine and checkout."""
        parts = [(self.cuda_home, "/kimi-k3/cuda", "bin/nvcc", 2),
                 (self.tvm_ffi_dir, "/kimi-k3/tvm_ffi", "include/tvm/ffi/c_api.h", 4),
                 (self.python_include, "/kimi-k3/python-include", "Python.h", 1)]
        if self.userland is not None:
            parts.append((self.userland, "", f"usr/bin/g++-{USERLAND_GCC_MAJOR}", 3))
        maps: dict[str, str] = {}
        for path, fixed, probe, depth in parts:
            real_file = Path(os.path.realpath(path / probe))
            candidates = [str(path), os.path.realpath(path)]
            if real_file.exists():
                candidates.append(str(real_file.parents[depth - 1]))
            for p in candidates:
                maps.setdefault(p, fixed)
        return list(maps.items())

    # -- identity ------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What the compiled bytes depend on besides sources and flags, by content: goes into
        kernel_cache.json (and so into the image) and into the non-Bazel build's object keys."""
        if self.cuda_identity is not None:
            cuda = {"pinned": dict(self.cuda_identity)}
        else:
            cuda = {"local": str(self.cuda_home), "realpath": os.path.realpath(self.cuda_home)}
        if self.userland_identity is not None:
            userland = {"debian_set": self.userland_identity.get("name", ""),
                        "packages": {p["name"]: {"version": p["version"], "sha256": p["sha256"]}
                                     for p in self.userland_identity.get("packages", [])}}
        else:
            userland = {"path": "compilers from PATH"}
        return {
            "cuda": cuda,
            "nvcc_version": self.nvcc_version_text,
            "cxx_version": self.cxx_version,
            "userland": userland,
            "tvm_ffi_version": self.tvm_ffi_version,
            "tvm_ffi_include_digest": dir_digest(self.tvm_ffi_dir / "include"),
            "python_include_digest": dir_digest(self.python_include),
        }

    def digest(self) -> str:
        return sha256_bytes(json.dumps(self.identity(), sort_keys=True).encode())


def real_roots(path: Path) -> list[str]:
    """`path` and where its files really are. In a Bazel sandbox a directory input is a forest of
    links into the output base; tools that resolve a file's real path (cudafe++ for every file
    it reads, nvcc and gcc for their own location) then name the output base, which differs on
    every machine and checkout. The real root is read off the first file found under `path`."""
    roots = [str(path), os.path.realpath(path)]
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        if filenames:
            first = Path(dirpath) / sorted(filenames)[0]
            rel = first.relative_to(path)
            real = Path(os.path.realpath(first))
            if real.parts[-len(rel.parts):] == rel.parts:
                roots.append(str(Path(*real.parts[:-len(rel.parts)])))
            break
    return list(dict.fromkeys(roots))


# glibc's linker scripts: libc.so names libc.so.6 and libc_nonshared.a, libm.so names libm.so.6,
# each by an absolute path (/lib/x86_64-linux-gnu/...).
_LINKER_SCRIPT = Path("usr/lib/x86_64-linux-gnu/libc.so")


def userland_sysroot(userland: Path) -> Path:
    """The directory the userland's files really are in, for --sysroot. ld looks up a linker
    script's absolute paths inside the sysroot only when the script's real path lies inside the
    sysroot's real path; otherwise it takes them from the running system. In a Bazel sandbox the
    userland is a tree of links into the output base, so with the sandbox's path the link took the
    running root's libc.so.6, libm.so.6 and libc_nonshared.a: FlashInfer modules built in the sealed
    root (Debian sid) needed GLIBC_2.43 (sqrtf), which the image's glibc 2.36 lacks, and differed
    from the same build through a remote worker, whose inputs are real files."""
    real = Path(os.path.realpath(userland / _LINKER_SCRIPT))
    n = len(_LINKER_SCRIPT.parts)
    if real.is_file() and real.parts[-n:] == _LINKER_SCRIPT.parts:
        return Path(*real.parts[:-n])
    return userland


def glibc_release(userland_identity: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The userland's glibc (its libc6 package's upstream version), or None where unknown."""
    for p in (userland_identity or {}).get("packages", []):
        m = re.match(r"(\d+)\.(\d+)", str(p.get("version", ""))) if p.get("name") == "libc6" else None
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def glibc_needed(elf: Path, env: Mapping[str, str]) -> list[tuple[int, int]]:
    """The GLIBC_x.y symbol versions a shared object requires (binutils' objdump -p)."""
    try:
        out = subprocess.run(["objdump", "-p", str(elf)], capture_output=True, text=True, check=True,
                             env=dict(env)).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"{elf}: objdump -p failed ({e}); check the toolchain's binutils") from None
    return sorted({(int(a), int(b)) for a, b in re.findall(r"\bGLIBC_(\d+)\.(\d+)", out)})


def check_glibc_needed(elf: Path, tc: "Toolchain", what: str) -> None:
    """A module linked against the userland may need no glibc newer than the userland's (the
    image's, Debian bookworm's 2.36): one that does fails to load there ("version `GLIBC_2.43'
    not found"), so the build fails instead, naming the module and the versions."""
    have = glibc_release(tc.userland_identity)
    if have is None:
        return
    newer = [v for v in glibc_needed(elf, tc.env()) if v > have]
    if newer:
        raise UserError(f"{what}: {elf.name} needs GLIBC_{'/'.join(f'{a}.{b}' for a, b in newer)}, newer than the "
                        f"compiler userland's glibc {have[0]}.{have[1]} (the image's): the link took the running "
                        "system's libc instead of the userland's; link with --sysroot at the userland's real "
                        "directory (toolchain.userland_sysroot)")


_SHIMS: dict[Path, tuple[Path, Path]] = {}


def _userland_shims(userland: Path) -> tuple[Path, Path]:
    """(wrapper dir, library dir) for a userland, made once per process in a temp dir:
    gcc/g++/cc/c++/cpp wrappers that run the userland's compiler with --sysroot (so every header
    and library comes from it, none from the running system), and links to its private
    libraries (the running system's glibc stays the one loaded)."""
    if userland in _SHIMS:
        return _SHIMS[userland]
    tmp = Path(tempfile.mkdtemp(prefix="kimi-k3-cc-"))
    atexit.register(shutil.rmtree, tmp, True)
    wrappers, libs = tmp / "bin", tmp / "lib"
    wrappers.mkdir()
    libs.mkdir()
    bin_dir = userland / "usr" / "bin"
    sysroot = userland_sysroot(userland)
    for name, real in (("gcc", "gcc"), ("cc", "gcc"), ("g++", "g++"), ("c++", "g++"),
                       ("cpp", "cpp")):
        target = bin_dir / f"{real}-{USERLAND_GCC_MAJOR}"
        script = wrappers / name
        script.write_text(f'#!/bin/sh\nexec "{target}" --sysroot="{sysroot}" "$@"\n')
        script.chmod(0o755)
    for lib_dir in (userland / "usr" / "lib" / "x86_64-linux-gnu",
                    userland / "lib" / "x86_64-linux-gnu"):
        if not lib_dir.is_dir():
            continue
        for lib in sorted(lib_dir.glob("lib*.so*")):
            if lib.name.startswith(_SYSTEM_LIB_PREFIXES) or (libs / lib.name).exists():
                continue
            if lib.is_file():
                os.symlink(lib, libs / lib.name)
    _SHIMS[userland] = (wrappers, libs)
    return wrappers, libs


def _first_line(tc_env: Mapping[str, str], cmd: Sequence[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(tc_env)).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"{cmd[0]}: cannot run ({e}); check the toolchain") from None
    return out.strip().splitlines()[0] if out.strip() else ""


def find_tvm_ffi() -> tuple[Path, str]:
    """tvm-ffi of the running interpreter (the non-Bazel build's default). Located without
    importing it: importing loads libtvm_ffi, which compile actions don't need."""
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("python package tvm_ffi: not importable; pass --tvm-ffi DIR (the stack's "
                        "apache-tvm-ffi unpacked by `python3 -m tools.kernel_cache unpack-tvm-ffi`)")
    from importlib import metadata
    return Path(list(spec.submodule_search_locations)[0]), metadata.version("apache-tvm-ffi")


def load_tvm_ffi(path: str | None) -> tuple[Path, str]:
    if not path:
        return find_tvm_ffi()
    root = Path(path).absolute()
    ident = root / TVM_FFI_IDENTITY_FILE
    if not (root / "include").is_dir() or not ident.is_file():
        raise UserError(f"--tvm-ffi {root}: no include/ and {TVM_FFI_IDENTITY_FILE} there; make it "
                        "with `python3 -m tools.kernel_cache unpack-tvm-ffi --wheel WHEEL --out DIR`")
    return root, str(_read_json(ident, "tvm-ffi").get("version", ""))


def load_toolchain(cuda_home: str | None, userland: str | None = None,
                   tvm_ffi: str | None = None) -> Toolchain:
    given = cuda_home or os.environ.get("KIMI_CUDA_HOME")
    if not given:
        # No default: a CUDA of the machine is never picked up silently.
        raise UserError("--cuda-home: not given (nor KIMI_CUDA_HOME); pass the pinned CUDA root "
                        "($(tools/bazel info output_base)/external/_main~kernel_toolchain~kimi_cuda/"
                        "root after `tools/bazel build //kernel_cache:toolchain`) or, as an escape "
                        "hatch, a local CUDA 13.0 root")
    home = Path(given).absolute()
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise UserError(f"--cuda-home {home}: no bin/nvcc there; under Bazel the pinned CUDA root "
                        "(@kimi_cuda) is the default, by hand pass its path or a CUDA 13.0 root")
    ident_file = home / CUDA_IDENTITY_FILE
    cuda_identity = _read_json(ident_file, "CUDA") if ident_file.is_file() else None
    ul: Path | None = None
    ul_identity = None
    if userland:
        ul = Path(userland).absolute()
        gxx = ul / "usr" / "bin" / f"g++-{USERLAND_GCC_MAJOR}"
        if not gxx.is_file():
            raise UserError(f"--userland {ul}: no usr/bin/g++-{USERLAND_GCC_MAJOR} there; unpack the "
                            "Debian set with `python3 -m tools.fetch.debian extract --set "
                            "kernel-userland --out DIR`")
        ul_ident = ul / USERLAND_IDENTITY_FILE
        ul_identity = _read_json(ul_ident, "userland") if ul_ident.is_file() else None
    tvm_dir, tvm_version = load_tvm_ffi(tvm_ffi)
    if ul is not None and (ul / "usr" / "include" / "python3.11" / "Python.h").is_file():
        py_include = ul / "usr" / "include" / "python3.11"
    else:
        py_include = Path(sysconfig.get_path("include"))
    partial = Toolchain(cuda_home=home, cuda_identity=cuda_identity, nvcc_release="",
                        nvcc_version_text="", userland=ul, userland_identity=ul_identity,
                        cxx_version="", tvm_ffi_dir=tvm_dir, tvm_ffi_version=tvm_version,
                        python_include=py_include)
    env = partial.env()
    try:
        text = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                              check=True, env=env).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"--cuda-home {home}: bin/nvcc --version failed ({e})") from None
    m = re.search(r"release (\d+\.\d+), (V[\d.]+)", text)
    if not m:
        raise UserError(f"--cuda-home {home}: cannot parse nvcc --version output")
    return dataclasses.replace(partial, nvcc_release=m.group(1),
                               nvcc_version_text=f"{m.group(1)} {m.group(2)}",
                               cxx_version=_first_line(env, ["c++", "--version"]))


def unpack_tvm_ffi(wheel: Path, out: Path) -> Path:
    """OUT/include (tvm_ffi/include of the wheel) and OUT/kimi-k3-tvm-ffi.json (version, wheel
    sha256): the headers every object is compiled against, from the wheel the image ships."""
    import zipfile

    from tools.common.hashing import sha256_file
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"--wheel {wheel}: not a wheel ({e})") from None
    with z:
        names = z.namelist()
        meta = [n for n in names if n.endswith(".dist-info/METADATA")]
        version = ""
        if meta:
            m = re.search(r"^Version: (\S+)$", z.read(meta[0]).decode("utf-8", "replace"), re.M)
            version = m.group(1) if m else ""
        headers = sorted(n for n in names if n.startswith("tvm_ffi/include/") and not n.endswith("/"))
        if not headers or not version:
            raise UserError(f"--wheel {wheel}: no tvm_ffi/include/ or version in it; pass an "
                            "apache-tvm-ffi wheel")
        with dir_replaced_atomically(out, "--out", tool=None) as tmp:
            for n in headers:
                dst = tmp / n[len("tvm_ffi/"):]
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(z.read(n))
            (tmp / TVM_FFI_IDENTITY_FILE).write_text(json.dumps(
                {"version": version, "wheel": wheel.name, "sha256": sha256_file(wheel)},
                indent=1, sort_keys=True) + "\n")
    return out


def write_cuda_stubs(tc: Toolchain, out: Path) -> Path:
    """Link-time stub dir: a libcuda.so stub (no driver on build hosts; soname libcuda.so.1 like
    the real stub), built with the toolchain's own compiler, unless the CUDA root has one."""
    with dir_replaced_atomically(out, "--out", tool=None) as tmp:
        real_stub = tc.cuda_home / "lib64" / "stubs" / "libcuda.so"
        if not real_stub.exists():
            src = tmp / "empty.c"
            src.write_text("/* link-time stand-in for the CUDA driver */\n")
            proc = tc.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                           str(tmp / "libcuda.so"), str(src)])
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise UserError("cuda-stubs: the toolchain's cc failed to build the libcuda.so "
                                "stub; see output above")
            src.unlink()
            os.symlink("libcuda.so", tmp / "libcuda.so.1")
    return out
