"""The content-addressed cache: verified files by sha256, per-entry locks, eviction.

Layout under the root (tools.common.cache.cache_root(), or --cache): `cas/sha256/<hex>` files,
`tmp/` for partial writes, `locks/` for flocks, `git/<sha256(url)>.git` bare repositories,
`index/git_tree/<tree>` -> sha256 of the tree's tar.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Iterator

from tools.common.errors import UserError
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
    `git/<sha256(url)>.git` bare repositories, `index/git_tree/<tree>` -> sha256 of its tar."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()

    def cas_path(self, sha256: str) -> Path:
        # The name is a path component: anything but 64 hex digits could point outside the cache.
        if not is_sha256(sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "cas" / "sha256" / sha256

    def tmp_dir(self) -> Path:
        path = self.root / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Exclusive flock for one entry; lock files stay (deleting them would race waiters)."""
        if not _LOCK_KEY_RE.fullmatch(key):
            raise ValueError(f"not a cache lock key: {key!r}")  # keys name files under locks/
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def clean_stale_temps(self, key: str) -> None:
        """Remove temp files a killed fetch of `key` left behind (call with the key's lock held)."""
        for stale in self.tmp_dir().glob(f"{key}.*.part"):
            stale.unlink(missing_ok=True)

    @contextlib.contextmanager
    def temp_file(self, key: str) -> Iterator[tuple[Path, IO[bytes]]]:
        """A temp file in the cache (same filesystem as cas/, so the final rename is atomic);
        removed on any failure."""
        fd, name = tempfile.mkstemp(prefix=f"{key}.", suffix=".part", dir=self.tmp_dir())
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                yield path, f
        finally:
            path.unlink(missing_ok=True)

    def commit(self, tmp: Path, sha256: str) -> Path:
        """Rename a verified, fsynced temp file into the CAS (read-only: it may be hardlinked).
        Not tools.common.files: the bytes were streamed (GBs) and hashed into `tmp` already, and
        the entry must be fsynced, then renamed, then its directory fsynced."""
        dest = self.cas_path(sha256)
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
                path.unlink()
                return path
        return None

    def git_repo(self, repository: str) -> Path:
        key = hashlib.sha256(repository.encode()).hexdigest()
        return self.root / "git" / f"{key}.git"

    def tree_index(self, tree: str) -> Path:
        return self.root / "index" / "git_tree" / tree

    def tree_entry(self, tree: str) -> str | None:
        """The sha256 the tree index records for `tree`; None when absent or not a sha256 (a
        damaged index is a miss, rebuilt by the next fetch, never a path to follow)."""
        index = self.tree_index(tree)
        if not index.is_file():
            return None
        value = index.read_text(encoding="ascii", errors="replace").strip()
        return value if is_sha256(value) else None

    def record_tree(self, tree: str, sha256: str) -> None:
        """Point the tree index at the CAS entry of the tree's tar (fsynced: it names an entry)."""
        write_text_atomic(self.tree_index(tree), sha256 + "\n", fsync=True)
