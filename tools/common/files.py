"""Atomic writes: a temp sibling in the same directory, then os.replace, so a reader (or a
killed run) never sees half a file. Files come out 0644: mkstemp's 0600 would otherwise leak into
committed files (manifests, plans) and image layers."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

MODE = 0o644


def temp_sibling(path: Path, suffix: str = ".tmp") -> Path:
    """A new empty 0644 file beside `path` for the caller to fill and os.replace onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.fchmod(fd, MODE)
    os.close(fd)
    return Path(tmp)


def write_bytes_atomic(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Write `data` to `path` all at once or not at all (fsync: also survive a power loss)."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, *, fsync: bool = False) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)
