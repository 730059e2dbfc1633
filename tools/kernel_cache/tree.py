"""The patched tree and what every module of this stage shares: the repository root, the AOT
layout path, the log line, and content digests (of the tree, generated sources, headers)."""
from __future__ import annotations

import os
import sys
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_bytes, sha256_file

# Where FlashInfer looks up AOT modules inside its package (flashinfer/data/aot/<m>/<m>.so).
AOT_SUBDIR = Path("flashinfer/data/aot")
REPO_ROOT = Path(__file__).absolute().parents[2]


def log(msg: str) -> None:
    print(f"[kernel_cache] {msg}", file=sys.stderr, flush=True)


def _tree_files(root: Path, skip: Callable[[Path], bool]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = sorted(n for n in dirnames if not skip(d / n))
        for n in sorted(filenames):
            if not skip(d / n):
                yield d / n


def _digest(entries: Iterable[tuple[str, str]]) -> str:
    return sha256_bytes("".join(f"{rel}\0{sha}\n" for rel, sha in entries).encode())


def dir_digest(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> str:
    """sha256 over (relative path, content sha256) of every file, in walk order (walk_order).
    File modes are left out: they don't change compiled code, and wheel unpackers disagree on
    them."""
    return _digest((p.relative_to(root).as_posix(), sha256_file(p)) for p in _tree_files(root, skip))


def walk_order(rel: str) -> tuple[tuple[int, str], ...]:
    """Sort key giving _tree_files' order for relative paths: in each directory its files (by
    name), then its subdirectories (by name), each walked in turn."""
    parts = rel.split("/")
    return (*((1, d) for d in parts[:-1]), (0, parts[-1]))


def _flashinfer_skips(parts: Sequence[str]) -> bool:
    """Build outputs and caches under flashinfer/ (parts relative to the tree), not sources:
    aot/ is where this stage writes."""
    return tuple(parts[:len(AOT_SUBDIR.parts)]) == AOT_SUBDIR.parts or "__pycache__" in parts \
        or PurePosixPath(parts[-1]).suffix == ".pyc"


def flashinfer_source_digest(tree: Path) -> str:
    """Digest of the patched FlashInfer package: every file under flashinfer/ except build
    outputs (aot/ is where this stage writes; caches and bytecode are not sources)."""
    return dir_digest(tree / "flashinfer", lambda p: _flashinfer_skips(p.relative_to(tree).parts))


def flashinfer_source_digest_of(files: Mapping[str, str]) -> str:
    """flashinfer_source_digest of a tree holding exactly `files` (path relative to the tree ->
    content sha256), without the tree: e.g. a wheel's members with a patch manifest's changes."""
    prefix = "flashinfer/"
    kept = {rel[len(prefix):]: sha for rel, sha in files.items()
            if rel.startswith(prefix) and not _flashinfer_skips(rel.split("/"))}
    return _digest((rel, kept[rel]) for rel in sorted(kept, key=walk_order))


def check_tree(tree: Path) -> Path:
    tree = tree.absolute()
    if not (tree / "flashinfer" / "__init__.py").is_file():
        raise UserError(
            f"--flashinfer-tree {tree}: no flashinfer/__init__.py there; pass the patched tree "
            "(the unpacked wheel directory that holds flashinfer/)")
    if not (tree / "flashinfer" / "data" / "csrc").is_dir():
        raise UserError(f"--flashinfer-tree {tree}: no flashinfer/data/csrc; pass an unpacked "
                        "flashinfer-python wheel tree (it ships csrc/ under flashinfer/data/)")
    return tree
