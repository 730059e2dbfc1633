"""Wheels installed into the tree a layer is written from, as Debian's python3 in the image sees
them: the `installer` library (what pip uses inside), no byte-compiling, one owner per file."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable, Sequence

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically, temp_dir_sibling
from tools.image.layer_contents import walk

# Debian's python3 puts /usr/local/lib/python3.11/dist-packages on sys.path (not site-packages).
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
IMAGE_PYTHON = "/usr/bin/python3"


def install_wheel(wheel: Path, staging: Path) -> None:
    """Install a wheel as Debian's python3 would see it, without running the image.

    Uses the `installer` library (what pip uses inside), prefix /usr/local, purelib and
    platlib = Debian's dist-packages, script shebangs = /usr/bin/python3. No byte-compiling:
    marshal output can depend on the compiling interpreter (this build host's, not the
    image's python3.11), which would leak the host into the layer; python3 writes its
    __pycache__ on first import instead.
    """
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    if not wheel.is_file() or wheel.suffix != ".whl":
        raise UserError(f"--wheel {wheel}: not a .whl file; pass a wheel from the fetch cache")
    scheme = {
        "purelib": "/" + SITE_PACKAGES,
        "platlib": "/" + SITE_PACKAGES,
        "headers": "/usr/local/include/python3.11/" + wheel.name.split("-")[0],
        "scripts": "/usr/local/bin",
        "data": "/usr/local",
    }
    destination = SchemeDictionaryDestination(
        scheme, interpreter=IMAGE_PYTHON, script_kind="posix",
        bytecode_optimization_levels=(), destdir=str(staging))
    try:
        with WheelFile.open(wheel) as source:
            install(source, destination, additional_metadata={"INSTALLER": b"kimi-k3-build\n"})
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--wheel {wheel}: cannot install ({e}); check the wheel is intact "
                        "and not installed twice in this layer") from e


def wheels_in_dirs(dirs: Iterable[str]) -> list[str]:
    """The .whl files directly inside each directory (a Bazel rule's directory output, e.g. the
    patch gate's repacked +kimik3 wheel, whose file name is only known after the build)."""
    found: list[str] = []
    for raw in dirs:
        d = Path(raw)
        wheels = sorted(str(w) for w in d.glob("*.whl")) if d.is_dir() else []
        if not wheels:
            raise UserError(f"--wheel-dir {raw}: no .whl file in it; pass the directory a wheel was written to")
        found += wheels
    return found


def install_wheels(wheels: Sequence[Path], out: Path) -> None:
    """Install wheels into one tree rooted at the image's / (what a layer of them holds), and
    refuse a file two wheels both install. The tree is what the layer is written from, and what
    the launch-profile check mounts as the image's root (tools/image/image_rootfs.py rootfs plans)."""
    with dir_replaced_atomically(out, "--out-tree", tool=None) as tree:
        stages = temp_dir_sibling(out)
        try:
            owner: dict[str, str] = {}
            for i, wheel in enumerate(sorted(wheels, key=lambda w: w.name)):
                stage = stages / f"{i}-{wheel.name}"
                stage.mkdir()
                install_wheel(wheel, stage)
                # Moved file by file into the merged tree (one filesystem: renames, no copies).
                for host_path in sorted(walk(stage), key=lambda p: p.relative_to(stage).as_posix()):
                    rel = host_path.relative_to(stage).as_posix()
                    target = tree / rel
                    if host_path.is_dir() and not host_path.is_symlink():
                        target.mkdir(exist_ok=True)
                        continue
                    if rel in owner or target.exists() or target.is_symlink():
                        raise UserError(f"--wheel {wheel}: {rel!r} is already installed by "
                                        f"{owner.get(rel, 'another input')}; give each file one source "
                                        "(split the wheels into separate layers)")
                    owner[rel] = wheel.name
                    os.rename(host_path, target)
        finally:
            shutil.rmtree(stages, ignore_errors=True)
