"""The patch gate's command line (`python3 -m tools.patch_gate <subcommand>`): one subcommand
per job (apply, check, update-manifest, check-manifest, install-manifest, remap, repack-wheel).
Exit codes: 0 ok, 1 conflict or manifest drift, 2 bad input (a malformed patch included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import tools.patch_gate
from tools.common.files import workspace_path, write_bytes_atomic
from tools.common.hashing import sha256_file
from tools.patch_gate import wheel as wheel_repack
from tools.common.files import check_replaceable_dir
from tools.patch_gate.gate import REMAPPED_TOOL, log, render_table, run_gate, write_remapped
from tools.patch_gate.result import GateInputs, GateResult
from tools.patch_gate.gitapply import GitApply
from tools.patch_gate.manifest import (build_manifest, check_manifest, install_manifest, print_drift,
                                       write_manifest)
from tools.patch_gate.remap import WheelLayout, remap_patch
from tools.patch_gate.series import load_lock, parse_pin_files, read_series, resolve_series, verify_pin_sha256

EXIT_REFUSED = 1
# --help's description: the first paragraph of the package docstring.
_DESCRIPTION = (tools.patch_gate.__doc__ or "").split("\n\n")[0]


def _add_gate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--series", type=Path, required=True, help="series file (default.series / pypi.series)")
    parser.add_argument("--target", type=Path, required=True, help="the pinned wheel, or an unpacked wheel directory")
    parser.add_argument("--layout", type=Path, required=True, help="wheel_layout.json mapping source paths to wheel paths")
    parser.add_argument("--pin-file", action="append", default=[], metavar="NAME=PATH", help="file for each pin: entry")
    parser.add_argument("--lock", type=Path, help="pins.lock.json: verify --pin-file and --target-pin sha256 against it")
    parser.add_argument("--target-pin", help="lock pin name of the target (recorded in the manifest)")
    parser.add_argument("--table", type=Path, help="also write the table here")
    parser.add_argument("--git", default="git", help="git executable (default: git on PATH)")


def _gate_inputs(args: argparse.Namespace) -> GateInputs:
    lock = load_lock(args.lock) if args.lock else None
    if lock is not None and args.target_pin and args.target.is_file():
        verify_pin_sha256(lock, args.target_pin, sha256_file(args.target), f"--target {args.target}")
    entries = read_series(args.series)
    sources = resolve_series(args.series, entries, parse_pin_files(args.pin_file), lock)
    return GateInputs(series=args.series, target=args.target, layout=WheelLayout.load(args.layout), sources=sources,
                      target_pin=args.target_pin, git=GitApply(args.git))


def _report(result: GateResult, table_path: Path | None) -> None:
    table = render_table(result)
    sys.stdout.write(table)
    sys.stdout.flush()
    if table_path is not None and result.accepted:
        write_bytes_atomic(table_path, table.encode("utf-8"))


def cmd_apply(args: argparse.Namespace) -> int:
    # Both folders are checked before the series runs: a refusal costs nothing and leaves nothing.
    if args.out_dir and not args.check_only:
        check_replaceable_dir(args.out_dir, "--out-dir", None)
    if args.remapped_dir:
        check_replaceable_dir(args.remapped_dir, "--remapped-dir", REMAPPED_TOOL)
    inputs = _gate_inputs(args)
    result = run_gate(inputs, None if args.check_only else args.out_dir, args.expected_manifest)
    _report(result, args.table)
    if result.drift:
        print_drift(args.expected_manifest, result.drift)
    if not result.accepted:
        return EXIT_REFUSED
    if args.manifest:
        write_manifest(args.manifest, build_manifest(result))
    if args.remapped_dir:
        write_remapped(args.remapped_dir, [r.patch for r in result.results], "--remapped-dir")
    return 0


def cmd_check_manifest(args: argparse.Namespace) -> int:
    """Compare a built manifest with the expected one (the Bazel validation of the gate's tree)."""
    drift = check_manifest(args.built, args.expected_manifest)
    if drift:
        print_drift(args.expected_manifest, drift)
        return EXIT_REFUSED
    if args.stamp:
        write_bytes_atomic(args.stamp, f"{args.expected_manifest}: no drift\n".encode("utf-8"))
    return 0


def cmd_install_manifest(args: argparse.Namespace) -> int:
    """Write a built manifest over the committed expected one (`bazel run //...:update_manifest`)."""
    target, changes = install_manifest(args.built, args.expected_manifest)
    if changes is not None:
        log(f"wrote {target}: {len(changes)} fields changed; review `git diff {args.expected_manifest}`")
        for line in changes:
            log(f"  {line}")
    else:
        log(f"wrote {target} (new); review it before committing")
    return 0


def cmd_update_manifest(args: argparse.Namespace) -> int:
    inputs = _gate_inputs(args)
    result = run_gate(inputs, None)
    _report(result, args.table)
    if not result.ok:
        return EXIT_REFUSED
    target = workspace_path(args.expected_manifest)
    write_manifest(target, build_manifest(result))
    log(f"wrote {target}")
    return 0


def cmd_remap(args: argparse.Namespace) -> int:
    lock = load_lock(args.lock) if args.lock else None
    sources = resolve_series(args.series, read_series(args.series), parse_pin_files(args.pin_file), lock)
    layout = WheelLayout.load(args.layout)
    patches = [remap_patch(s, layout) for s in sources]
    write_remapped(args.out_dir, patches, "--out-dir")
    for p in patches:
        print(f"{p.source.entry.label}: {len(p.files)} files remapped, {len(p.excluded)} excluded")
        for f in p.files:
            print(f"  {f.source} -> {f.wheel}")
        for e in p.excluded:
            print(f"  {e.source} excluded ({e.reason})")
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    wheel = wheel_repack.repack_wheel(args.tree, args.out_dir, args.local_label, args.modes_from)
    if args.wheel_name_out:
        write_bytes_atomic(args.wheel_name_out, (wheel.name + "\n").encode("utf-8"))
    print(wheel)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m tools.patch_gate", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    apply = sub.add_parser("apply", help="check and apply a series to a wheel tree atomically")
    _add_gate_args(apply)
    apply.add_argument("--out-dir", type=Path, required=True, help="patched tree (replaced in one rename)")
    apply.add_argument("--manifest", type=Path, help="write the manifest of changed files here")
    apply.add_argument("--remapped-dir", type=Path, help="write the wheel-layout patches here for review")
    apply.add_argument("--expected-manifest", type=Path, help="also fail (exit 1) on drift against this manifest")
    apply.set_defaults(func=cmd_apply, check_only=False)

    check = sub.add_parser("check", help="run the gate without writing a tree (only the touched files are extracted); with --expected-manifest, fail on drift")
    _add_gate_args(check)
    check.add_argument("--expected-manifest", type=Path, help="fail (exit 1) naming every drift against this manifest")
    check.add_argument("--manifest", type=Path, help="write the built manifest here")
    check.set_defaults(func=cmd_apply, check_only=True, out_dir=None, remapped_dir=None)

    update = sub.add_parser("update-manifest", help="regenerate the expected manifest (review its diff before committing)")
    _add_gate_args(update)
    update.add_argument("--expected-manifest", type=Path, required=True, help="path to (re)write; relative to the workspace under `bazel run`")
    update.set_defaults(func=cmd_update_manifest)

    check_manifest = sub.add_parser("check-manifest", help="fail (exit 1) naming every drift of a built manifest against the expected one")
    check_manifest.add_argument("--built", type=Path, required=True, help="the manifest.json the gate wrote")
    check_manifest.add_argument("--expected-manifest", type=Path, required=True, help="the committed <stack>.manifest.json")
    check_manifest.add_argument("--stamp", type=Path, help="on success write a one-line stamp here (a Bazel validation output)")
    check_manifest.set_defaults(func=cmd_check_manifest)

    install = sub.add_parser("install-manifest", help="write a built manifest over the expected one, atomically (review its diff)")
    install.add_argument("--built", type=Path, required=True, help="the manifest.json the gate wrote")
    install.add_argument("--expected-manifest", type=Path, required=True, help="path to (re)write; relative to the workspace under `bazel run`")
    install.set_defaults(func=cmd_install_manifest)

    remap = sub.add_parser("remap", help="write the wheel-layout patches of a series for review (no target needed)")
    remap.add_argument("--series", type=Path, required=True)
    remap.add_argument("--layout", type=Path, required=True)
    remap.add_argument("--pin-file", action="append", default=[], metavar="NAME=PATH")
    remap.add_argument("--lock", type=Path)
    remap.add_argument("--out-dir", type=Path, required=True)
    remap.set_defaults(func=cmd_remap)

    repack = sub.add_parser("repack-wheel", help="zip a patched tree as <name>-<version>+kimik3.<digest> deterministically")
    repack.add_argument("--tree", type=Path, required=True, help="patched tree from `apply --out-dir`")
    repack.add_argument("--out-dir", type=Path, required=True, help="directory that receives the one wheel")
    repack.add_argument("--local-label", default=wheel_repack.PATCHED_LOCAL_LABEL)
    repack.add_argument("--modes-from", type=Path,
                        help="the upstream wheel: file modes (exec bits) are taken from it, not from disk")
    repack.add_argument("--wheel-name-out", type=Path, help="also write the wheel's file name here")
    repack.set_defaults(func=cmd_repack)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
