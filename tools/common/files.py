"""Atomic writes: a temp sibling in the same directory, then os.replace, so a reader (or a
killed run) never sees half a file. Files come out 0644: mkstemp's 0600 would otherwise leak into
committed files (manifests, plans) and image layers; a secret is written with mode=PRIVATE_MODE
(0600 from its creation, never readable by others for a moment) and read only from a file
require_owner_only accepts. Directories the same way: built in a temp sibling (0755, not
mkdtemp's 0700), then swapped into place by replace_dir, the one helper every stage uses for it;
it replaces only an empty directory or a previous output of the same tool
(check_replaceable_dir), so no command deletes what it did not write."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from tools.common.errors import UserError

MODE = 0o644
PRIVATE_MODE = 0o600
DIR_MODE = 0o755


def temp_sibling(path: Path, suffix: str = ".tmp", mode: int = MODE) -> Path:
    """A new empty file (0644, or `mode`) beside `path` for the caller to fill and os.replace onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)  # created 0600
    os.fchmod(fd, mode)
    os.close(fd)
    return Path(tmp)


def write_bytes_atomic(path: Path, data: bytes, *, fsync: bool = False, mode: int = MODE) -> None:
    """Write `data` to `path` all at once or not at all (fsync: also survive a power loss); the
    file has `mode` from its creation on (PRIVATE_MODE for a secret)."""
    tmp = temp_sibling(path, mode=mode)
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


def require_owner_only(path: Path, what: str) -> None:
    """A secret (a private key, a passphrase) is read only from a file no one but its owner can
    read or change: group or other bits are refused with the chmod that fixes them. A link is
    judged by its target (os.stat), whose mode is what guards the secret."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError as e:
        raise UserError(f"{what} {path}: unreadable ({e.strerror}); pass an existing file") from None
    if mode & 0o077:
        raise UserError(f"{what} {path}: mode {mode:04o} lets other users read or change a secret; "
                        f"make it the owner's only: chmod 600 {path}")


def set_tree_writable(root: Path, writable: bool) -> None:
    """root and everything under it read-only (dirs 0555, files 0444), or back to 0755 / 0644: a
    copy a check must only read (every lookup must be a hit), then removable again. Links are
    left alone (chmod would follow them)."""
    for p in [root, *root.rglob("*")]:  # listed first: chmod needs only ownership, in any order
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(DIR_MODE if writable else 0o555)
        else:
            p.chmod(MODE if writable else 0o444)


@contextlib.contextmanager
def read_only_copy(src: Path, dest: Path) -> Iterator[Path]:
    """A copy of tree src at dest, read-only while the block runs (a check's lookups must all be
    hits: a miss would have to write), writable again afterwards so it can be removed."""
    shutil.copytree(src, dest)
    set_tree_writable(dest, False)
    try:
        yield dest
    finally:
        set_tree_writable(dest, True)


def workspace_path(path: Path) -> Path:
    """A relative path is the workspace's under `bazel run` (which runs in the runfiles tree and
    names the source tree in BUILD_WORKSPACE_DIRECTORY): how a run target writes a checked-in file."""
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    return Path(workspace) / path if workspace and not path.is_absolute() else path


# The marker a directory swap leaves in every tree it writes for a named tool: the proof that a
# later run may replace that directory. Without it a tree is the user's, and never deleted.
OUTPUT_MARKER = ".kimi-k3-output"


def check_replaceable_dir(target: Path, what: str, tool: str | None) -> None:
    """The one rule of every directory this project replaces: `target` may be absent, an empty
    directory, or a previous output of `tool` (its OUTPUT_MARKER names the tool). Anything else
    holds what the tool did not write, so it is refused in one line, before any work, and never
    deleted. tool=None: a tree shipped byte for byte (an image layer's, a kernel cache) carries
    no marker, so only an empty directory (what Bazel gives an action) is replaced."""
    for at in target.absolute().parents:  # `--out FILE/sub`: one line, not a FileExistsError
        if at.exists() or at.is_symlink():
            if not at.is_dir():
                raise UserError(f"{what} {target}: {at} is not a directory; pass a path under a directory")
            break
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UserError(f"{what} {target}: exists and is not a directory; remove it or pick another path")
    if not target.exists():
        return
    try:
        with os.scandir(target) as entries:
            if next(entries, None) is None:
                return
        owner = _marker_tool(target / OUTPUT_MARKER)
    except OSError as e:
        raise UserError(f"{what} {target}: cannot look into it ({e.strerror}); pick another path") from None
    if tool is not None and owner == tool:
        return
    held = (f"holds the output of {owner}" if owner else
            f"holds files that {tool or 'this tool'} did not write (no {OUTPUT_MARKER} marker)")
    raise UserError(f"{what} {target}: exists, is not empty and {held}; pass another path "
                    "(a new or empty directory), or remove it yourself")


def _marker_tool(marker: Path) -> str | None:
    """The tool a marker names; None for no marker, or a file that is not one (a user's file
    of that name proves nothing)."""
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        tool = json.loads(marker.read_bytes()).get("tool")
    except (ValueError, AttributeError):
        return None
    return tool if isinstance(tool, str) else None


def temp_dir_sibling(path: Path) -> Path:
    """A new empty 0755 directory beside `path` for the caller to fill and replace_dir onto it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(DIR_MODE)
    return tmp


def replace_dir(new: Path, target: Path, what: str, *, tool: str | None) -> None:
    """Put the finished directory `new` (on the file system of `target`) in place of `target`;
    `new` is gone afterwards. `target` must be replaceable (check_replaceable_dir, checked again
    under the lock); a `tool` marks `new` as its output (OUTPUT_MARKER), so its next run may
    replace it.

    Readers always find a directory at `target`, the old tree or the new one, never a mix: a
    previous output is swapped out with one rename(RENAME_EXCHANGE) where the file system has it
    (elsewhere two renames leave a moment without one). Concurrent replacements in one directory
    are serialised by an flock on that directory itself (without it their renames race:
    ENOTEMPTY, a vanished target), so no lock file is left behind. The previous tree is removed
    after the lock is released: deleting a large tree must not hold up other writers.
    """
    check_replaceable_dir(target, what, tool)
    if tool is not None:
        (new / OUTPUT_MARKER).write_bytes(json.dumps({"tool": tool}, sort_keys=True).encode() + b"\n")
    parent = target.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    garbage: Path | None = None  # what holds the previous output afterwards
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        check_replaceable_dir(target, what, tool)  # another run may have put something there
        if not target.exists():
            os.rename(new, target)
        elif _exchange(new, target):
            garbage = new
        else:
            garbage = Path(tempfile.mkdtemp(prefix=f".{target.name}.previous-", dir=parent))
            os.rename(target, garbage / "tree")
            os.rename(new, target)
    finally:
        os.close(fd)  # releases the flock
    if garbage is not None:
        shutil.rmtree(garbage)


@contextlib.contextmanager
def dir_replaced_atomically(target: Path, what: str, *, tool: str | None) -> Iterator[Path]:
    """`with dir_replaced_atomically(out, "--out", tool=...) as tmp:` fill tmp (a
    temp_dir_sibling); on success it replaces `out` (replace_dir), on any error it is removed and
    `out` stays as it was. `out` is checked first (check_replaceable_dir), before any work."""
    check_replaceable_dir(target, what, tool)
    tmp = temp_dir_sibling(target)
    try:
        yield tmp
        replace_dir(tmp, target, what, tool=tool)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # C libraries before glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


# A scratch directory's owner lock: held (flock) by the live process for as long as it uses the
# directory, so a later run can tell a directory whose owner was killed from one in use.
SCRATCH_LOCK = ".owner.lock"


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A private scratch directory `<parent or $TMPDIR>/<prefix><random>`, removed on exit.

    An action that runs outside the sandbox (no-sandbox) and is killed with SIGKILL (Bazel after
    its grace period, the OOM killer) never reaches its cleanup, and a scan's scratch can be
    gigabytes. So the directory holds an flock for its whole life, and each new one first removes
    the directories of its own prefix whose lock no live process holds: only what an earlier run
    of this helper wrote, never a directory without the lock file."""
    parent = Path(parent or tempfile.gettempdir())
    sweep_dead_scratch(parent, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = os.open(path / SCRATCH_LOCK, os.O_CREAT | os.O_RDWR, PRIVATE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def sweep_dead_scratch(parent: Path, prefix: str) -> list[Path]:
    """Remove `parent/<prefix>*` directories left by killed owners (lock file present, not held);
    returns them."""
    removed = []
    for path in sorted(parent.glob(glob_escape(prefix) + "*")):
        lock = path / SCRATCH_LOCK
        if path.is_symlink() or not path.is_dir() or not lock.is_file() or lock.is_symlink():
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live owner holds it
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
