"""--driver-stub: a stand-in libcuda.so.1 in the unpacked root (never in the image) defining the
driver symbols (cu*) that the image's libraries needing it import, each returning
CUDA_ERROR_NO_DEVICE, and that directory put first on LD_LIBRARY_PATH."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError
from tools.image.image_rootfs import inside
from tools.image.wheel_install import SITE_PACKAGES

DRIVER_STUB_DIR = "/tmp/kimi-k3-driver-stub"
# Driver API names (cuInit, cuMemCreate, ...); the runtime's cuda* names come from libcudart.
_DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


def driver_symbols(rootfs: Path, dirs: Sequence[str] = ("/" + SITE_PACKAGES,)) -> list[str]:
    """Driver API symbols that the image's ELF files needing libcuda.so.1 under `dirs` (image
    paths; site-packages by default) import (Python loads extensions with RTLD_NOW, so an empty
    library is not enough)."""
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    if not (readelf and nm):
        raise UserError("--driver-stub: needs readelf and nm on PATH; install binutils")
    symbols: set[str] = set()
    for so in sorted(so for d in dirs for so in inside(rootfs, d).rglob("*.so*")):
        if so.is_symlink() or not so.is_file():
            continue
        dynamic = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True).stdout
        if "[libcuda.so.1]" not in dynamic:
            continue
        listing = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True,
                                 text=True).stdout
        for line in listing.splitlines():
            name = line.split()[-1].split("@")[0] if line.split() else ""
            if _DRIVER_SYMBOL.match(name):
                symbols.add(name)
    return sorted(symbols)


def write_driver_stub(rootfs: Path, symbols: Sequence[str]) -> str:
    """A stand-in libcuda.so.1 in the unpacked rootfs (not in the image) defining `symbols` as
    functions that return 100 (CUDA_ERROR_NO_DEVICE); returns its directory inside the image."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise UserError("--driver-stub: no C compiler (cc) on PATH to build a stand-in "
                        "libcuda.so.1; install gcc, or run where the NVIDIA driver is")
    d = inside(rootfs, DRIVER_STUB_DIR)
    d.mkdir(parents=True, exist_ok=True)
    src = d / "stub.c"
    src.write_text("/* stand-in for the driver's libcuda.so.1: smoke test only */\n" +
                   "".join(f"int {name}(void) {{ return 100; }}\n" for name in symbols))
    proc = subprocess.run([cc, "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libcuda.so.1", "-o",
                           str(d / "libcuda.so.1"), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"--driver-stub: {cc} could not build the stub: {proc.stderr.strip()[-300:]}")
    return DRIVER_STUB_DIR


def with_library_path(env: Sequence[str], directory: str) -> list[str]:
    """env with directory first on LD_LIBRARY_PATH (keeping the image's own entries)."""
    out, found = [], False
    for e in env:
        if e.startswith("LD_LIBRARY_PATH="):
            out.append(f"LD_LIBRARY_PATH={directory}:{e.split('=', 1)[1]}".rstrip(":"))
            found = True
        else:
            out.append(e)
    return out if found else [*out, f"LD_LIBRARY_PATH={directory}"]
