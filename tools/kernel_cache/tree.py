"""The patched tree and what every module of this stage shares: the repository root, the AOT
layout path, the log line, and content digests (of the tree, generated sources, headers)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterator

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


def dir_digest(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> str:
    """sha256 over (relative path, content sha256) of every file, in sorted order. File modes
    are left out: they don't change compiled code, and wheel unpackers disagree on them."""
    lines = (f"{p.relative_to(root).as_posix()}\0{sha256_file(p)}\n"
             for p in _tree_files(root, skip))
    return sha256_bytes("".join(lines).encode())


def flashinfer_source_digest(tree: Path) -> str:
    """Digest of the patched FlashInfer package: every file under flashinfer/ except build
    outputs (aot/ is where this stage writes; caches and bytecode are not sources)."""
    pkg = tree / "flashinfer"
    aot = tree / AOT_SUBDIR

    def skip(p: Path) -> bool:
        return p == aot or p.name == "__pycache__" or p.suffix == ".pyc"

    return dir_digest(pkg, skip)


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
