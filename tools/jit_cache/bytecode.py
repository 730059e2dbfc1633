"""The image's Python bytecode for builds and tests (tools/common/bytecode_tree.py says why).

    python3 -m tools.jit_cache.bytecode build-bytecode --stack S --arch A --base-tar BASE.tar \
        --site-tree DIR... --site-packages /usr/local/lib/python3.X/dist-packages \
        --module NAME... --out OUT

The image's interpreter, over the image's installed trees as the SGLang JIT build runs it
(sglang_aot.ImagePython), imports each --module; every module that import reached in the image
(its standard library, its site-packages) is compiled by that interpreter into OUT/<PREFIX>/ by
image path as checked-hash bytecode (tools/jit_cache/bytecode_worker.py), with OUT/<PREFIX>/kimi-k3-bytecode.json
saying what wrote it. A module that fails to import is named, and OUT is left as it was.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import dir_replaced_atomically
from tools.jit_cache import bytecode_tree

WORKER = Path(__file__).with_name("bytecode_worker.py")


def build_bytecode(stack: str, arch: str, modules: Sequence[str], base_tar: Path, site_trees: Sequence[Path],
                   site_packages: str, out: Path) -> int:
    from tools.jit_cache.sglang_aot import ImagePython, log

    if not modules:
        raise UserError("--module: none given; name the modules the image's python3 imports in builds and tests")
    t0 = time.monotonic()
    with dir_replaced_atomically(out, "--out", tool=None) as tree, \
            tempfile.TemporaryDirectory(prefix="bytecode-") as scratch_dir:
        image = ImagePython(Path(scratch_dir), base_tar, site_trees, site_packages, arch)
        prefix = tree / bytecode_tree.PREFIX
        prefix.mkdir(parents=True)
        # A fixed hash seed: the order of a compiled frozenset constant follows its strings' hashes.
        result = image.run_worker({"modules": list(modules), "root": str(image.root), "out": str(prefix)},
                                  {"PYTHONHASHSEED": "0"}, "build-bytecode", WORKER)
        if result["failed"]:
            named = "; ".join(f"{m}: {e}" for m, e in result["failed"])
            raise UserError(f"--module: the image's python3 cannot import {named}; drop it from the "
                            "bytecode target's modules or fix the image (its traceback is above)")
        if not result["compiled"]:
            raise UserError(f"--base-tar {base_tar}: the image's python3 imported no module from its own root; "
                            "pass the image's base tar and installed trees")
        (prefix / bytecode_tree.MARKER).write_text(json.dumps({
            "stack": stack, "modules": list(modules), "files": result["compiled"],
            "cache_tag": "cpython-" + image.python.name[len("python"):].replace(".", ""),
            "invalidation": "checked-hash",
        }, indent=1, sort_keys=True) + "\n")
        log(f"bytecode: {result['compiled']} module(s) compiled by the image's "
            f"python3 for {len(modules)} import(s) in {time.monotonic() - t0:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.bytecode",
                                     description="the image's Python bytecode for builds and tests")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-bytecode", help="compile what the image's python3 imports for --module")
    b.add_argument("--stack", required=True)
    b.add_argument("--arch", required=True, help="FLASHINFER_CUDA_ARCH_LIST while importing (the image's)")
    b.add_argument("--base-tar", type=Path, required=True, help="the image's Debian rootfs tar (its python3.11)")
    b.add_argument("--site-tree", type=Path, action="append", required=True,
                   help="an image layer's installed tree (rooted at /); repeat, bottom layer first")
    b.add_argument("--site-packages", required=True, help="the image's site-packages (image/constants.bzl SITE_PACKAGES)")
    b.add_argument("--module", action="append", default=[], help="a module to import; repeat")
    b.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return build_bytecode(args.stack, args.arch, args.module, args.base_tar, args.site_tree, args.site_packages,
                          args.out)


if __name__ == "__main__":
    sys.exit(run_cli(main))
