"""Putting verified artifacts where the caller asked (--out, mirror files): whole or not at all."""
from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically


def check_writable_path(path: Path, what: str, *, directory: bool) -> None:
    """A one-line UserError (naming `what`) when `path` cannot become a file (directory=False)
    or a directory: it exists as the other kind, or an ancestor is not a directory."""
    if path.exists():
        if directory and not path.is_dir():
            raise UserError(f"{what} {path} is a file, not a directory; pass a directory path")
        if not directory and path.is_dir():
            raise UserError(f"{what} {path} is a directory; pass the path of the file to write "
                            f"(e.g. {path / 'NAME'})")
        return
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{what} {path}: {parent} is a file, not a directory; pass a path under a directory")
            return


def place_file(src: Path, out: Path, *, link: bool = True) -> Path:
    """Put a verified file at `out` atomically: hardlink when possible, else copy.

    Not tools.common.files: that writes bytes it holds in memory into a fresh 0644 file, while
    this links the (read-only, GB-sized) CAS entry itself, or streams a copy fsynced before the
    rename."""
    out = out.absolute()
    check_writable_path(out, "output", directory=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            if not link:
                raise OSError("copy requested")
            os.link(src, tmp)
        except OSError:
            # Different filesystem or links not allowed: copy, and fsync before the rename.
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out)
        # rename(2) between two links to one inode (a rerun linking the same CAS entry) succeeds
        # without doing anything, leaving tmp behind: remove it (absent after a real rename).
        tmp.unlink(missing_ok=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def extract_tar(tar_path: Path, out: Path) -> Path:
    """Unpack a verified tar into directory `out`, built in a temp sibling then renamed."""
    out = out.absolute()
    # The "data" filter refuses absolute paths, `..`, links out of the tree and device files;
    # without it a tar could write anywhere, so an interpreter lacking it is refused, not trusted.
    if not hasattr(tarfile, "data_filter"):
        raise UserError(f"extracting into {out} needs tarfile extraction filters (Python 3.8.17+, 3.9.17+, "
                        f"3.10.12+ or 3.11.4+), this is Python {sys.version.split()[0]}: run tools/fetch with a "
                        "newer python3")
    check_writable_path(out, "output", directory=True)
    with dir_replaced_atomically(out) as tmp:
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp, filter="data")
    return out
