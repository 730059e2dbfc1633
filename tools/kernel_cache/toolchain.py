"""The toolchain the objects are compiled with: the CUDA root (nvcc), the wheel roots that add
headers CUDA lacks (nvidia/cu13), tvm-ffi, the host compilers and the userland they run in
(--host-root: chroot into the host's root when tools/bazel's sealed root is not the one CUDA was
installed for), and the link-time stub dir (libcuda.so stub, unversioned lib*.so links)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_bytes
from tools.kernel_cache.tree import dir_digest

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
        return sha256_bytes(json.dumps(self.identity(), sort_keys=True).encode())


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
