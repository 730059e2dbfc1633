"""The content-addressed cache: verified files by sha256, per-entry locks, eviction.

Layout under the root (tools.common.cache.cache_root(), or --cache): `cas/sha256/<hex>` files,
`tmp/` for partial writes, `locks/` for flocks, `git/<sha256(url)>.git` bare repositories,
`git-paths/<sha256(url)>.git` the objects of git_tree pins with `paths` (tools/fetch/git.py
ensure_paths_objects), `index/git_tree/<key>` -> sha256 of a git_tree pin's tar (key: tree_index_key).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Iterator, Sequence

from tools.common.errors import UserError, cannot_write
from tools.common.files import write_text_atomic
from tools.common.hashing import sha256_file
from tools.pins.lock import is_sha256

_LOCK_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Cache:
    """`<root>/cas/sha256/<hex>` files, `tmp/` for partial writes, `locks/` for flocks,
    `git/<sha256(url)>.git` bare repositories, `git-paths/<sha256(url)>.git` the objects of
    git_tree pins with `paths`, `index/git_tree/<key>` -> sha256 of a git_tree pin's tar."""

    def __init__(self, root: Path, *, option: str | None = None) -> None:
        """`option`: the flag that chose `root` (e.g. "--cache"), for the fix in error messages;
        None when it came from KIMI_K3_CACHE or the default."""
        self.root = root.absolute()
        self.option = option

    def write_failed(self, error: OSError, path: Path) -> UserError:
        """The one line for a failed write under the cache: a full disk is the cache's problem,
        never a source's (so never retried as a network error)."""
        if self.option:
            elsewhere, writable = f"pass a {self.option} on a larger disk", f"pass a writable {self.option}"
        else:
            elsewhere, writable = "set KIMI_K3_CACHE to a larger disk", "set KIMI_K3_CACHE to a writable directory"
        return cannot_write(path, error, no_space_fix=elsewhere,
                            access_fix=f"make {self.root} writable for this user, or {writable}")

    @contextlib.contextmanager
    def writing(self, path: Path) -> Iterator[None]:
        """Turn an OSError of the statements inside into write_failed (naming the file it names)."""
        try:
            yield
        except OSError as e:
            raise self.write_failed(e, Path(e.filename) if e.filename else path) from None

    def cas_path(self, sha256: str) -> Path:
        # The name is a path component: anything but 64 hex digits could point outside the cache.
        if not is_sha256(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "cas" / "sha256" / sha256

    def tmp_dir(self) -> Path:
        path = self.root / "tmp"
        with self.writing(path):
            path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Exclusive flock for one entry; lock files stay (deleting them would race waiters)."""
        if not _LOCK_KEY_RE.fullmatch(key):
            raise ValueError(f"not a cache lock key: {key!r}")  # keys name files under locks/
        path = self.root / "locks" / f"{key}.lock"
        with self.writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "a")
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def clean_stale_temps(self, key: str) -> None:
        """Remove temp files a killed fetch of `key` left behind (call with the key's lock held)."""
        for stale in self.tmp_dir().glob(f"{key}.*.part"):
            with self.writing(stale):
                stale.unlink(missing_ok=True)

    @contextlib.contextmanager
    def temp_file(self, key: str) -> Iterator[tuple[Path, IO[bytes]]]:
        """A temp file in the cache (same filesystem as cas/, so the final rename is atomic);
        removed on every exit that is not a commit: an exception, Ctrl-C, SIGTERM (run_cli)."""
        tmp_dir = self.tmp_dir()
        with self.writing(tmp_dir):
            fd, name = tempfile.mkstemp(prefix=f"{key}.", suffix=".part", dir=tmp_dir)
        path = Path(name)
        f = os.fdopen(fd, "wb")
        try:
            yield path, f
        except BaseException:
            # close() flushes what a failed write left buffered, and on a full disk fails again:
            # that must not replace the error being raised.
            with contextlib.suppress(OSError):
                f.close()
            raise
        else:
            with self.writing(path):
                f.close()
        finally:
            path.unlink(missing_ok=True)

    def commit(self, tmp: Path, sha256: str) -> Path:
        """Rename a verified, fsynced temp file into the CAS (read-only: it may be hardlinked).
        Not tools.common.files: the bytes were streamed (GBs) and hashed into `tmp` already, and
        the entry must be fsynced, then renamed, then its directory fsynced."""
        dest = self.cas_path(sha256)
        with self.writing(dest):
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        return dest

    def verified_entry(self, sha256: str, what: str, evict_hint: str) -> Path | None:
        """The CAS entry for `sha256` after re-hashing it; a corrupt entry is a UserError."""
        path = self.cas_path(sha256)
        if not path.exists():
            return None
        actual = sha256_file(path)
        if actual != sha256:
            raise UserError(f"{what}: cached file {path} is corrupt: expected sha256 {sha256}, actual {actual}; "
                            f"remove it with `{evict_hint}` (or delete the file) and fetch again")
        return path

    def evict(self, sha256: str, key: str) -> Path | None:
        """Remove the CAS entry for `sha256` under the lock `key` its writers take; returns the
        removed path (None when there was none)."""
        with self.locked(key):
            path = self.cas_path(sha256)
            if path.exists():
                with self.writing(path):
                    path.unlink()
                return path
        return None

    def git_repo(self, repository: str) -> Path:
        key = hashlib.sha256(repository.encode()).hexdigest()
        return self.root / "git" / f"{key}.git"

    def git_paths_repo(self, repository: str) -> Path:
        """Where the objects of `paths` pins of `repository` go: commits without the blobs
        outside their paths. Apart from git_repo's whole commits, so that no fetch into a
        repository ever takes such a commit for one it has whole."""
        key = hashlib.sha256(repository.encode()).hexdigest()
        return self.root / "git-paths" / f"{key}.git"

    def tree_index(self, key: str) -> Path:
        if not _LOCK_KEY_RE.fullmatch(key):
            raise ValueError(f"not a tree index key: {key!r}")  # keys name files under index/
        return self.root / "index" / "git_tree" / key

    def tree_entry(self, key: str) -> str | None:
        """The sha256 the tree index records under `key` (tree_index_key); None when absent or
        not a sha256 (a damaged index is a miss, rebuilt by the next fetch, never a path to follow)."""
        index = self.tree_index(key)
        if not index.is_file():
            return None
        value = index.read_text(encoding="ascii", errors="replace").strip()
        return value if is_sha256(value) else None

    def record_tree(self, key: str, sha256: str) -> None:
        """Point the tree index at the CAS entry of a tree's tar (fsynced: it names an entry)."""
        with self.writing(self.tree_index(key)):
            write_text_atomic(self.tree_index(key), sha256 + "\n", fsync=True)


def tree_index_key(tree: str, paths: Sequence[str] = ()) -> str:
    """The tree index's key for a git_tree pin's tar (also its lock and temp-file key, prefixed
    "tree-"): the tree id for the whole tree. With `paths` one tree has one tar per set of
    directories, so the key adds the sha256 of that set: a pin of the whole tree and one of some
    of its directories never share an entry. "-paths-", not ".": clean_stale_temps("tree-<tree>")
    globs "tree-<tree>.*", which must not match a concurrent paths fetch's temp file. The paths
    are one per line (tools.pins.lock refuses control characters in them)."""
    if not paths:
        return tree
    digest = hashlib.sha256("\n".join(paths).encode()).hexdigest()
    return f"{tree}-paths-{digest}"
