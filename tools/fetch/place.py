"""Putting verified artifacts where the caller asked (--out, mirror files): whole or not at all."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tarfile
from pathlib import Path

from tools.common.errors import UserError, cannot_write
from tools.common.files import dir_replaced_atomically

# A git tree pin unpacked by `fetch --out DIR` is this tool's output (marked): a rerun may replace it.
EXTRACT_TOOL = "tools.fetch"


def check_writable_path(path: Path, what: str, *, directory: bool) -> None:
    """A one-line UserError (naming `what`) when `path` cannot become a file (directory=False)
    or a directory: it exists as the other kind, it or an ancestor is a dangling symlink, an
    ancestor is not a directory, or this user may not look at an ancestor."""
    try:
        for at in (path, *path.parents):
            if at.is_symlink() and not at.exists():
                where = f"{what} {path} is" if at == path else f"{what} {path}: {at} is"
                raise UserError(f"{where} a symlink to {os.readlink(at)}, which does not exist; create its "
                                "target or use another path")
            if not at.exists():
                continue
            if at == path:
                if directory and not path.is_dir():
                    raise UserError(f"{what} {path} is a file, not a directory; pass a directory path")
                if not directory and path.is_dir():
                    raise UserError(f"{what} {path} is a directory; pass the path of the file to write "
                                    f"(e.g. {path / 'NAME'})")
            elif not at.is_dir():
                raise UserError(f"{what} {path}: {at} is a file, not a directory; pass a path under a directory")
            return
    except OSError as e:  # stat refused: a directory on the way that this user may not search
        raise UserError(f"{what} {path}: cannot look at {e.filename or path} ({e.strerror or e}); fix its "
                        "permissions or use another path") from None


def write_failed(error: OSError, path: Path, option: str) -> UserError:
    """The one line for a failed write of `path`, which `option` ("--out", "the mirror") chose."""
    return cannot_write(path, error, no_space_fix=f"put {option} on a larger disk",
                        access_fix=f"make {path.parent} writable for this user, or put {option} elsewhere")


def place_file(src: Path, out: Path, *, link: bool = True, option: str = "--out") -> Path:
    """Put a verified file at `out` atomically: hardlink when possible, else copy. A failed
    write (a full disk) leaves nothing at `out` and is one line naming `out` and `option`.

    Not tools.common.files: that writes bytes it holds in memory into a fresh 0644 file, while
    this links the (read-only, GB-sized) CAS entry itself, or streams a copy fsynced before the
    rename."""
    out = out.absolute()
    check_writable_path(out, "output", directory=False)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
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
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # the source is a verified CAS entry: a failed write (a full disk)
            raise write_failed(e, out, option) from None
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
    try:
        with dir_replaced_atomically(out, "--out", tool=EXTRACT_TOOL) as tmp:
            with tarfile.open(tar_path) as tar:
                tar.extractall(tmp, filter="data")
    except OSError as e:  # the tar is a verified CAS entry: a failed write (a full disk)
        raise write_failed(e, out, "--out") from None
    return out
