"""`python3 -m tools.jit_cache`:

    inventory --stack S (--tree DIR | --wheel WHEEL) [inputs] --out FILE
        one stack's inventory (review JSON), from the patch gate's tree or the pinned wheel
        (gated here with sglang_patches/<S>.series, drift-checked against its manifest);
    check --built S=FILE... --inventory-dir jit_cache
        each recomputed inventory equals the checked-in jit_cache/inventory.<S>.json; exit 1 with
        one line per new, removed or changed site, and the command that rewrites them;
    install --built S=FILE... --inventory-dir jit_cache
        write the recomputed inventories over the checked-in ones (what
        `tools/bazel run //jit_cache:update_inventory` runs; review `git diff jit_cache/`);
    build-sglang --stack S --arch 12.0f|9.0a --modules FILE --base-tar TAR --site-tree DIR...
                 --cuda-home C --userland U --out OUT
        SGLang's JIT modules of jit_cache/sglang_modules.json built ahead of time in SGLang's own
        cache layout (tools/jit_cache/sglang_aot.py; what //jit_cache:sglang_jit_<arch> runs);
    check-sglang --stack S --arch A --modules FILE --base-tar TAR --site-tree DIR... --cache OUT
        SGLang's own loader, as the image runs it (no compiler, SGLANG_CRASH_ON_JIT_COMPILE=1),
        finds and loads every module of OUT;
    coverage --recording FILE --inventory jit_cache/inventory.<S>.json [--cache-manifest OUT]
        per kind, the recorded first-use compiles prebuilt / recorded, and the inventory's
        static-only sites (tools/jit_cache/coverage.py).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from tools.common.cliargs import named_paths
from tools.common.errors import UserError
from tools.common.files import workspace_path, write_bytes_atomic
from tools.common.jsondata import load_json_file
from tools.common.jsonfmt import review_json
from tools.jit_cache.coverage import add_coverage_command
from tools.jit_cache.sglang_aot import add_sglang_commands
from tools.jit_cache.inventory import (BACKEND_NEEDS_READ, CHECKPOINT_FACT_SCHEMA, REACH, build_inventory, differences,
                                       load_profiles, log, read_inventory)
from tools.jit_cache.tree import gated_tree, tree_from_dir

EXIT_DIFFERS = 1
UPDATE_COMMAND = "tools/bazel run //jit_cache:update_inventory"



def cmd_inventory(args: argparse.Namespace) -> int:
    if (args.tree is None) == (args.wheel is None):
        raise UserError("inventory: give exactly one of --tree DIR (the gate's tree) and --wheel WHEEL (the pinned wheel)")
    _check_stack(args.stack, args.lock)
    # Every input file is read (and refused) before the tree is scanned or gated: minutes saved.
    profiles = load_profiles(args.profiles)
    reach = load_json_file(args.reach, "--reach", REACH)
    facts = load_json_file(args.facts, "--facts", CHECKPOINT_FACT_SCHEMA)
    needs = load_json_file(args.backend_needs, "--backend-needs", BACKEND_NEEDS_READ)
    plan = _read_plan(args.kernel_plan)
    aot_modules = _aot_modules(args.sglang_modules, args.stack)
    triton_calls = _triton_calls(args.triton_calls, args.stack)
    with tempfile.TemporaryDirectory(prefix="jit-cache-") as scratch_dir:
        scratch = Path(scratch_dir)
        if args.tree is not None:
            tree = tree_from_dir(args.tree, "--tree")
        else:
            tree = gated_tree(args.wheel, args.stack, args.patch_dir, args.lock, scratch)
        inventory = build_inventory(args.stack, tree, profiles, reach, facts["architectures"], needs, plan,
                                    args.kernel_plan.name, aot_modules, triton_calls)
    write_bytes_atomic(args.out, review_json(inventory))
    counts = ", ".join(f"{k} {c['reached']}/{c['total']}" for k, c in inventory["counts"].items())
    log(f"stack {args.stack}: sites reached/total: {counts}; wrote {args.out}")
    return 0


def _check_stack(stack: str, lock_path: Path) -> None:
    """An inventory is of a stack of the lock (another name would be written, and checked, as if)."""
    from tools.pins.lock import load

    stacks = sorted(load(lock_path).stacks)
    if stack not in stacks:
        raise UserError(f"--stack {stack}: not a stack of {lock_path} (its stacks: {', '.join(stacks)}); "
                        "pass one of them")


def _aot_modules(path: Path | None, stack: str) -> list:
    """The stack's SGLang JIT modules built ahead of time (none when the file lists no such stack)."""
    if path is None:
        return []
    from tools.jit_cache.sglang_aot import load_modules
    return load_modules(path, stack, "--sglang-modules", required=False)


def _triton_calls(path: Path | None, stack: str) -> list:
    """The stack's Triton calls built ahead of time (none when the file lists no such stack)."""
    if path is None:
        return []
    from tools.jit_cache.triton_aot import load_calls
    return load_calls(path, stack, "--triton-calls", required=False)


def _read_plan(path: Path) -> dict:
    from tools.kernel_cache.plan import read_plan
    return read_plan(path)


def _checked_in(directory: Path, stack: str) -> Path:
    return directory / f"inventory.{stack}.json"


def cmd_check(args: argparse.Namespace) -> int:
    built = named_paths(args.built, "--built", form="STACK=FILE", what="stack")
    failed = False
    for stack, path in sorted(built.items()):
        ours = read_inventory(path, "--built")
        target = _checked_in(args.inventory_dir, stack)
        if not target.is_file():
            print(f"jit_cache/{target.name}: missing for stack {stack}; run `{UPDATE_COMMAND}` and commit it", file=sys.stderr)
            failed = True
            continue
        theirs = read_inventory(target, "checked-in inventory")
        for line in differences(ours, theirs):
            print(f"jit_cache/{target.name}: {line}; run `{UPDATE_COMMAND}` and review `git diff jit_cache/`", file=sys.stderr)
            failed = True
    stale = sorted(p.name for p in args.inventory_dir.glob("inventory.*.json") if p.name.split(".")[1] not in built)
    for name in stale:
        print(f"jit_cache/{name}: no stack of the lock has this name; delete it", file=sys.stderr)
        failed = True
    if not failed:
        log(f"inventories current: {', '.join(sorted(built))}")
    return EXIT_DIFFERS if failed else 0


def cmd_install(args: argparse.Namespace) -> int:
    built = named_paths(args.built, "--built", form="STACK=FILE", what="stack")
    directory = workspace_path(args.inventory_dir)
    for stack, path in sorted(built.items()):
        data = read_inventory(path, "--built")
        write_bytes_atomic(_checked_in(directory, stack), review_json(data))
        log(f"wrote {_checked_in(directory, stack)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inv = sub.add_parser("inventory", help="one stack's inventory of first-use compile sites")
    inv.add_argument("--stack", required=True)
    inv.add_argument("--tree", type=Path, help="the patch gate's SGLang tree of the stack")
    inv.add_argument("--wheel", type=Path, help="the stack's pinned sglang wheel (gated here)")
    inv.add_argument("--patch-dir", type=Path, default=Path("sglang_patches"), help="with --wheel: series, manifests, layout")
    inv.add_argument("--lock", type=Path, default=Path("third_party/pins.lock.json"),
                     help="the lock whose stack --stack names (and, with --wheel, its series' pins)")
    inv.add_argument("--profiles", type=Path, default=Path("image/profiles"))
    inv.add_argument("--reach", type=Path, default=Path("jit_cache/reach.json"))
    inv.add_argument("--facts", type=Path, default=Path("jit_cache/checkpoint_facts.json"))
    inv.add_argument("--backend-needs", type=Path, default=Path("image/backend_needs.json"))
    inv.add_argument("--kernel-plan", type=Path, required=True, help="the stack's kernel-cache plan the image ships")
    inv.add_argument("--sglang-modules", type=Path, help="jit_cache/sglang_modules.json: the SGLang JIT modules built ahead of time")
    inv.add_argument("--triton-calls", type=Path, help="jit_cache/triton_calls.json: the Triton kernels built ahead of time")
    inv.add_argument("--out", type=Path, required=True)
    inv.set_defaults(func=cmd_inventory)
    for name, func, text in (("check", cmd_check, "recomputed inventories == the checked-in ones"),
                             ("install", cmd_install, "write recomputed inventories over the checked-in ones")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--built", action="append", default=[], required=True, metavar="STACK=FILE")
        p.add_argument("--inventory-dir", type=Path, default=Path("jit_cache"))
        p.set_defaults(func=func)
    add_sglang_commands(sub)
    add_coverage_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
