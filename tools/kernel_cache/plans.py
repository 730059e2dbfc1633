"""The checked-in plans (kernel_cache/plan_*.bzl) as a set: whether each still records the
current inputs (`check`, cheap: no tree, no GitHub), and regenerating all of them (`update`).

    python3 -m tools.kernel_cache.plans check  --plan PATH=STACK... --wheel STACK=WHEEL... [inputs]
    python3 -m tools.kernel_cache.plans update --plan PATH=STACK... --wheel STACK=WHEEL... [inputs]
        --cuda-identity FILE --userland-identity FILE [--stack S]...

Bazel runs them: `tools/bazel run //kernel_cache:update_plans` (update, writing into the
workspace) and //tests/cpu/kernel_cache:plans_current (check). Which stack a plan belongs to is its
file name's (tools/kernel_cache/private/plans.bzl indexes them); Bazel passes each as
--plan PATH=STACK, with the stack's pinned flashinfer-python wheel as --wheel STACK=WHEEL.

`check` names, per plan, what it recorded that the inputs no longer give:
  - its bytes are not what the writer (render_plan) emits for its own content;
  - flashinfer_version is not that of its stack's flashinfer pin;
  - patched_source_digest is not that of the tree the patch gate makes for its stack: the pinned
    wheel's files with the changes of the stack's committed manifest laid over (computed from
    the wheel and the manifest's sha256s: the default stack's #4460 bytes are not needed);
  - nvcc_release is not the lock's kernel toolchain release;
  - its modules (names and order, generators, kwargs for its variant, source markers) are not
    what modules.json declares for its arch;
  - a module's kernel selection is not its selections.json entry.
It cannot see a change in what FlashInfer's generators or this stage's probe emit for the same
inputs (compile commands, generated sources, after an edit of tools/kernel_cache): `update`
regenerates from the trees and shows it as a diff (and :plan_check compares one plan).

`update` builds each stack's tree with the patch gate (the stack's series, the patch pins fetched
through tools/fetch, drift-checked against the committed manifest) and writes every plan of
that stack with make_plan. A stack whose patch pin cannot be fetched (the default stack's
#4460 without GitHub or a filled mirror) is skipped; the others are written, then one line names
the plans not made, the pin and the mirror command (exit 2).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.cache import cache_root
from tools.common.errors import UserError, run_cli
from tools.common.files import workspace_path, write_text_atomic
from tools.fetch.cache import Cache
from tools.fetch.cli import DEFAULT_TIMEOUT_S, Context, fetch_pin
from tools.fetch.sources import mirror_dirs
from tools.kernel_cache.modules import ModuleDecl, load_modules
from tools.kernel_cache.plan import make_plan, read_plan, render_plan
from tools.kernel_cache.selection import FULL, module_selections, planned_selections
from tools.kernel_cache.toolchain import load_toolchain
from tools.kernel_cache.tree import REPO_ROOT, flashinfer_source_digest_of, log
from tools.patch_gate import cli as gate_cli
from tools.patch_gate.manifest import read_manifest
from tools.pins import lock as pins_lock

FLASHINFER_ROLE = "flashinfer"
# The lock's toolchain the kernel stage compiles with (tools/kernel_cache/private/toolchain_repos.bzl).
CUDA_TOOLCHAIN = "cuda-13.0"


@dataclass(frozen=True)
class PlanRef:
    """A checked-in plan file and the stack whose FlashInfer tree it is made from."""

    path: Path
    stack: str


def _pairs(values: Sequence[str], flag: str, example: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        left, sep, right = value.partition("=")
        if not sep or not left or not right:
            raise UserError(f"{flag} {value!r}: expected {example}")
        pairs.append((left, right))
    return pairs


@functools.lru_cache(maxsize=8)
def wheel_files(wheel: Path) -> dict[str, str]:
    """sha256 of every file of a wheel, by its path in the unpacked tree (read once per wheel)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            return {i.filename: hashlib.sha256(z.read(i)).hexdigest() for i in z.infolist() if not i.is_dir()}
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"--wheel {wheel}: not a readable wheel ({e}); pass the stack's pinned flashinfer-python") from None


def gate_tree_digest(wheel: Path, manifest: Mapping[str, Any]) -> str:
    """flashinfer_source_digest of the tree the patch gate makes from `wheel` as `manifest` (its
    committed manifest) describes it: the wheel's files with changed_files laid over."""
    files = dict(wheel_files(wheel))
    for change in manifest.get("changed_files", []):
        if change["sha256_after"] is None:
            files.pop(change["path"], None)
        else:
            files[change["path"]] = change["sha256_after"]
    return flashinfer_source_digest_of(files)


@dataclass
class Inputs:
    """What the plans are made from, besides the trees."""

    lock: pins_lock.Lock
    modules_path: Path
    decls: list[ModuleDecl]
    selections_path: Path
    patch_dir: Path  # flashinfer_patches/: <stack>.series, <stack>.manifest.json, wheel_layout.json
    wheels: dict[str, Path]

    def wheel(self, stack: str) -> Path:
        if stack not in self.wheels:
            raise UserError(f"stack '{stack}': no --wheel {stack}=WHEEL (its pinned flashinfer-python) given")
        return self.wheels[stack]

    def manifest_path(self, stack: str) -> Path:
        return self.patch_dir / f"{stack}.manifest.json"


def recorded_input_drift(ref: PlanRef, inputs: Inputs) -> list[str]:
    """What `ref` recorded that the current inputs no longer give (empty: it is current)."""
    text = ref.path.read_text(encoding="utf-8")
    plan = read_plan(ref.path)
    stack = inputs.lock.stack(ref.stack)
    problems = []
    if render_plan(plan) != text:
        problems.append("its bytes are not what the plan writer emits for its content")
    pin = inputs.lock.pin(stack.roles[FLASHINFER_ROLE])
    version = pin.package.version if getattr(pin, "package", None) else None
    if plan["flashinfer_version"] != version:
        problems.append(f"flashinfer_version {plan['flashinfer_version']}, stack {ref.stack}'s pin {pin.name} "
                        f"is {version}")
    digest = gate_tree_digest(inputs.wheel(ref.stack), read_manifest(inputs.manifest_path(ref.stack),
                                                                     "the --patch-dir manifest"))
    if plan["patched_source_digest"] != digest:
        problems.append(f"patched_source_digest {plan['patched_source_digest'][:16]}, the patch gate's tree of "
                        f"stack {ref.stack} ({pin.name} + {inputs.manifest_path(ref.stack).name}) is {digest[:16]}")
    release = inputs.lock.toolchain(CUDA_TOOLCHAIN).release
    if plan["nvcc_release"] != release:
        problems.append(f"nvcc_release {plan['nvcc_release']}, the lock's {CUDA_TOOLCHAIN} is {release}")
    problems += _module_drift(plan, inputs)
    return problems


def _module_drift(plan: Mapping[str, Any], inputs: Inputs) -> list[str]:
    decls = [d for d in inputs.decls if d.applies_to(plan["arch"])]
    names = [m["name"] for m in plan["modules"]]
    if names != [d.name for d in decls]:
        return [f"modules {names}, {inputs.modules_path.name} declares {[d.name for d in decls]} for {plan['arch']}"]
    problems = []
    for m, d in zip(plan["modules"], decls):
        if (m["generator"], m["kwargs"]) != (d.generator, d.kwargs_for(plan["variant"])):
            problems.append(f"module {m['name']}: generator/kwargs differ from {inputs.modules_path.name}")
    markers = [{"module": d.name, "path": mk.path, "regex": mk.regex} for d in decls for mk in d.markers]
    if plan["source_markers"] != markers:
        problems.append(f"source_markers differ from {inputs.modules_path.name}")
    selection = plan.get("selection", FULL)
    want = module_selections(inputs.selections_path, selection, plan["arch"]) or {}
    have = planned_selections(plan) or {}
    for module in sorted(set(want) | set(have)):
        if want.get(module) != have.get(module):
            problems.append(f"module {module}: kernel selection {selection} differs from {inputs.selections_path.name}")
    return problems


def check(refs: Sequence[PlanRef], inputs: Inputs) -> list[str]:
    """One line per stale plan, naming what differs and the fix."""
    stale = []
    for ref in refs:
        problems = recorded_input_drift(ref, inputs)
        if problems:
            stale.append(f"{ref.path.name} (stack {ref.stack}) is stale: {'; '.join(problems)}; regenerate it with "
                         "`tools/bazel run //kernel_cache:update_plans`")
    return stale


def _stack_tree(stack_name: str, inputs: Inputs, out: Path) -> Path:
    """The patch gate's checked tree of the stack (its patch pins fetched now: a GitHub-only one
    fails here, with the fetcher's one line naming the pin and the mirror command)."""
    stack = inputs.lock.stack(stack_name)
    ctx = Context(lock=inputs.lock, cache=Cache(cache_root()), mirrors=mirror_dirs([]), timeout=DEFAULT_TIMEOUT_S)
    pin_files = [f"{name}={fetch_pin(ctx, inputs.lock.pin(name))}" for name in stack.patch_pins]
    argv = ["apply", "--series", str(inputs.patch_dir / f"{stack_name}.series"),
            "--target", str(inputs.wheel(stack_name)), "--target-pin", stack.roles[FLASHINFER_ROLE],
            "--layout", str(inputs.patch_dir / "wheel_layout.json"), "--lock", str(inputs.lock.path),
            "--expected-manifest", str(inputs.manifest_path(stack_name)), "--out-dir", str(out)]
    argv += [f"--pin-file={p}" for p in pin_files]
    if gate_cli.main(argv) != 0:
        raise UserError(f"stack {stack_name}: the patch gate refused its series (above); fix it or run "
                        f"`tools/bazel run //flashinfer_patches:update_manifest` for that stack, then update the plans")
    return out


def update(refs: Sequence[PlanRef], inputs: Inputs, cuda_home: str, userland: str,
           only_stacks: Sequence[str] = ()) -> list[str]:
    """Regenerate every plan of `refs` (of `only_stacks`, when given) into the workspace; returns
    one line per stack whose plans could not be made (its tree could not be built)."""
    tc = load_toolchain(cuda_home, userland, None)
    by_stack: dict[str, list[PlanRef]] = {}
    for ref in refs:
        if not only_stacks or ref.stack in only_stacks:
            by_stack.setdefault(ref.stack, []).append(ref)
    unknown = sorted(set(only_stacks) - {r.stack for r in refs})
    if unknown:
        raise UserError(f"--stack {','.join(unknown)}: no checked-in plan is for it; stacks with plans: "
                        f"{', '.join(sorted({r.stack for r in refs}))}")
    not_made = []
    for stack, stack_refs in sorted(by_stack.items()):
        names = ", ".join(r.path.name for r in stack_refs)
        with tempfile.TemporaryDirectory(prefix=f"kimi-k3-plans-{stack}-") as tmp:
            try:
                tree = _stack_tree(stack, inputs, Path(tmp) / "tree")
            except UserError as e:
                log(f"stack {stack}: skipped, its tree cannot be built (the last line says why)")
                not_made.append(f"{names} (stack {stack}): {e}")
                continue
            for ref in stack_refs:
                old = read_plan(ref.path)
                fresh = make_plan(tree, inputs.modules_path, old["arch"], old["variant"], tc,
                                  selection=old.get("selection", FULL), selections_path=inputs.selections_path)
                text = render_plan(fresh)
                target = workspace_path(ref.path)
                if target.is_file() and target.read_text(encoding="utf-8") == text:
                    log(f"{target}: unchanged ({fresh['object_count']} objects)")
                else:
                    write_text_atomic(target, text)
                    log(f"{target}: rewritten ({fresh['object_count']} objects); review `git diff {ref.path}`")
    return not_made


def _inputs(args: argparse.Namespace) -> Inputs:
    modules = Path(args.modules)
    return Inputs(lock=pins_lock.load(args.lock), modules_path=modules, decls=load_modules(modules),
                  selections_path=Path(args.selections), patch_dir=Path(args.patch_dir),
                  wheels={s: Path(w) for s, w in _pairs(args.wheel, "--wheel", "STACK=WHEEL")})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m tools.kernel_cache.plans", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--plan", action="append", default=[], required=True, metavar="PATH=STACK",
                        help="a checked-in plan and its stack (repeat for every plan)")
    common.add_argument("--wheel", action="append", default=[], metavar="STACK=WHEEL",
                        help="the stack's pinned flashinfer-python wheel")
    common.add_argument("--lock", default=str(REPO_ROOT / "third_party" / "pins.lock.json"))
    common.add_argument("--modules", default=str(REPO_ROOT / "kernel_cache" / "modules.json"))
    common.add_argument("--selections", default=str(REPO_ROOT / "kernel_cache" / "selections.json"))
    common.add_argument("--patch-dir", default=str(REPO_ROOT / "flashinfer_patches"),
                        help="the FlashInfer patch folder (<stack>.series, <stack>.manifest.json, wheel_layout.json)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", parents=[common], help="name the plans whose recorded inputs are not the current ones")
    p = sub.add_parser("update", parents=[common], help="regenerate every plan into the workspace")
    p.add_argument("--cuda-identity", required=True, help="the pinned CUDA root's identity file (@kimi_cuda)")
    p.add_argument("--userland-identity", required=True, help="the compiler userland's identity file")
    p.add_argument("--stack", action="append", default=[], help="only this stack's plans (repeatable)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    refs = [PlanRef(Path(path), stack) for path, stack in _pairs(args.plan, "--plan", "PATH=STACK")]
    inputs = _inputs(args)
    if args.cmd == "check":
        stale = check(refs, inputs)
        for line in stale:
            print(line, file=sys.stderr)
        if not stale:
            log(f"{len(refs)} plans record the current inputs")
        return 1 if stale else 0
    not_made = update(refs, inputs, str(Path(args.cuda_identity).absolute().parent),
                      str(Path(args.userland_identity).absolute().parent), args.stack)
    if not_made:
        raise UserError("plans not regenerated: " + "; ".join(not_made) + "; the others are written")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
