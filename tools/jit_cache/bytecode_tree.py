"""The image's Python bytecode for builds and tests: a tree, rooted at / like a layer's installed
tree, that holds under PREFIX the checked-hash (PEP 552) .pyc files of what the image's python3
imports in them (its standard library's and its site-packages'), laid out by image path as
PYTHONPYCACHEPREFIX reads them (tools/jit_cache/bytecode.py writes it).

Why: the image ships no bytecode and its trees are read-only Bazel outputs, so every run of the
image's python3 in a build or test (SGLang's JIT build and check, Triton's, the launch-profile
check's chroot) compiled the same thousands of modules from source. Checked-hash files are
validated against the source's bytes at each import, so a file whose source differs (a patched
stack, a mutated tree) is compiled from source as before, never taken stale. Nothing of it is in
the image. The first-use stage writes it (bytecode.py) and runs the image's python3 with it
(sglang_aot.ImagePython); the image stage's rootfs plan mounts it (tools/image/image_rootfs.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

PREFIX = "var/cache/kimi-k3/bytecode"  # image path, relative to /
MARKER = "kimi-k3-bytecode.json"  # in PREFIX: what wrote it (stack, python cache tag, files)


def is_bytecode_tree(tree: Path) -> bool:
    return (tree / PREFIX / MARKER).is_file()


def split_trees(trees: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(installed trees, bytecode trees) of a layers' tree list, order kept."""
    installed = [t for t in trees if not is_bytecode_tree(t)]
    return installed, [t for t in trees if is_bytecode_tree(t)]


def link_prefix(bytecode: Path, prefix_dir: Path, root: Path) -> str:
    """Make prefix_dir a PYTHONPYCACHEPREFIX for an interpreter whose image root is `root` (a
    scratch directory, not /): Python looks a module's bytecode up at <prefix><absolute source
    directory>, so <prefix_dir><root> links to the tree's PREFIX. Both the path as given and its
    resolved form are linked (sys.path may hold either). Returns the value for PYTHONPYCACHEPREFIX."""
    target = (bytecode / PREFIX).resolve()
    for path in {os.path.abspath(root), os.path.realpath(root)}:
        link = prefix_dir / path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(target)
    return str(prefix_dir)


def chroot_env(trees: Sequence[Path]) -> list[str]:
    """The env entry that points the image's python3 at a bytecode tree mounted at /, if any."""
    return [f"PYTHONPYCACHEPREFIX=/{PREFIX}"] if any(is_bytecode_tree(t) for t in trees) else []
