"""Verified fetcher: every upstream input comes from the lock, by hash, through one cache.

    fetch        --pin NAME [--out PATH [--archive]]  print the path of the verified artifact
    mirror       --mirror DIR [--stack S]... [--pin P]... [--from-git PIN=CHECKOUT]...
    add-git-diff --name N --repository URL --commit C [--parent P] [--from-git CHECKOUT]
    add-git-tree --name N --repository URL --commit C [--path DIR]... [--from-git CHECKOUT]
    verify       schema check + table of pins
    evict        --pin NAME | --sha256 HEX
    format       rewrite the lock in canonical form

Wheel pins from PyPI are added with `python3 -m tools.pins.pypi add-pypi NAME==VERSION`.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.common import cache as cache_env
from tools.common import credentials
from tools.common.errors import UserError
from tools.common.files import check_replaceable_dir
from tools.common.hashing import sha256_file
from tools.common.progress import human_bytes
from tools.fetch import git as fetch_git
from tools.fetch.cache import Cache, tree_index_key
from tools.fetch.place import EXTRACT_TOOL, check_writable_path, extract_tar, place_file
from tools.fetch.sources import SourceFailed, fetch_file_pin, mirror_dirs
from tools.pins import lock as lockfile
from tools.pins.lock import FilePin, GitDiffPin, GitTreePin, Lock, Pin

DEFAULT_TIMEOUT_S = 60.0
CACHE_COMMANDS = ("fetch", "mirror", "evict", "add-git-diff", "add-git-tree")  # the ones that touch the cache


@dataclass
class Context:
    lock: Lock
    cache: Cache
    mirrors: list[Path]
    timeout: float


def fetch_pin(ctx: Context, pin: Pin, from_git: str | None = None) -> Path:
    if isinstance(pin, FilePin):
        return fetch_file_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout)
    if isinstance(pin, GitDiffPin):
        return fetch_git.fetch_git_diff_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout, from_git)
    return fetch_git.fetch_git_tree_pin(pin, ctx.cache, ctx.mirrors, ctx.timeout, from_git)


def cmd_fetch(ctx: Context, args: argparse.Namespace) -> int:
    pin = ctx.lock.pin(args.pin)
    if args.archive and not isinstance(pin, GitTreePin):
        raise UserError(f"fetch --archive: pin '{pin.name}' is a {pin.kind} pin; --archive places a git_tree pin's tar")
    unpack = isinstance(pin, GitTreePin) and not args.archive
    if args.out:
        # Checked before fetching, so a wrong --out costs no download.
        check_writable_path(Path(args.out).absolute(), "--out", directory=unpack)
        if unpack:
            check_replaceable_dir(Path(args.out).absolute(), "--out", EXTRACT_TOOL)
    path = fetch_pin(ctx, pin)
    if args.out:
        if unpack:
            path = extract_tar(path, Path(args.out))
        else:
            path = place_file(path, Path(args.out), link=not args.copy)
    print(path)
    return 0


def parse_from_git(values: Sequence[str], lock: Lock) -> dict[str, str]:
    result: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--from-git {value!r}: expected PIN=CHECKOUT, e.g. --from-git flashinfer-pr4460=~/flashinfer")
        if not isinstance(lock.pin(name), (GitDiffPin, GitTreePin)):
            raise UserError(f"--from-git {value!r}: pin '{name}' is not a git pin; --from-git only fills git pins")
        if not Path(path).exists():
            raise UserError(f"--from-git {value!r}: {path} does not exist; pass a local clone of the repository")
        result[name] = path
    return result


def selected_pins(lock: Lock, stacks: Sequence[str], pins: Sequence[str]) -> list[Pin]:
    names: list[str] = []
    for stack in stacks:
        names += lock.stack(stack).pin_names()
    names += [lock.pin(p).name for p in pins]
    if not stacks and not pins:
        names = list(lock.pins)
    return [lock.pins[n] for n in dict.fromkeys(names)]


def mirror_file(src: Path, dest: Path, sha256: str, size: int | None) -> str:
    """Copy a verified file into the mirror unless an identical one is there (re-verified, so a
    corrupt, truncated or unreadable copy is replaced); returns what was done."""
    note = "written"
    try:
        if dest.is_file():
            if (size is None or dest.stat().st_size == size) and sha256_file(dest) == sha256:
                return "present"
            note = "replaced a corrupt copy"
    except OSError:
        note = "replaced an unreadable copy"
    place_file(src, dest, link=False, option="the mirror")
    return note


def cmd_mirror(ctx: Context, args: argparse.Namespace) -> int:
    target = Path(args.mirror_dir)
    check_writable_path(target.absolute(), "mirror", directory=True)
    from_git = parse_from_git(args.from_git, ctx.lock)
    pins = selected_pins(ctx.lock, args.stack, [*args.pin, *from_git])
    # The target is a source too (already-present files are verified, not re-downloaded).
    ctx.mirrors = [target, *[m for m in ctx.mirrors if m != target]]
    print(f"mirror: {len(pins)} pins into {target}", file=sys.stderr)
    for index, pin in enumerate(pins, 1):
        path = fetch_pin(ctx, pin, from_git.get(pin.name))
        notes: list[str] = []
        if pin.filename and isinstance(pin, (FilePin, GitDiffPin, GitTreePin)):
            notes.append(mirror_file(path, target / pin.filename, pin.sha256, getattr(pin, "size", None)))
        if isinstance(pin, (GitDiffPin, GitTreePin)):
            notes.append(mirror_git_pin(ctx, pin, target, from_git.get(pin.name)))
        print(f"mirror: [{index}/{len(pins)}] {pin.name}: {', '.join(notes) or 'cached'}", file=sys.stderr)
    print(target)
    return 0


def mirror_git_pin(ctx: Context, pin: GitDiffPin | GitTreePin, target: Path, from_git: str | None) -> str:
    """Also put the pin's commits into the mirror's bare repository, so hosts that regenerate
    the diff (or need the tree) are served; a diff served from a mirror file alone cannot. A
    pin with `paths` puts its paths closure into the mirror's paths repository instead."""
    if isinstance(pin, GitTreePin) and pin.paths:
        failures: list[str] = []
        if fetch_git.ensure_tree_pin_objects(ctx.cache, pin, ctx.mirrors, from_git, failures) is None:
            print(f"mirror: warning: {pin.name}: no git source for the paths repository ({'; '.join(failures)})",
                  file=sys.stderr)
            return "no git repository"
        repo = fetch_git.mirror_paths_repo(ctx.cache, pin, target)
        return f"repository {repo.relative_to(target)} ({', '.join(pin.paths)})"
    if isinstance(pin, GitDiffPin):
        wanted = [(pin.commit, pin.commit_tree, "commit_tree"), (pin.parent, pin.parent_tree, "parent_tree")]
    else:
        wanted = [(pin.commit, pin.tree, "tree")]
    failures: list[str] = []
    if fetch_git.ensure_commits(ctx.cache, pin.name, pin.repository, wanted, ctx.mirrors, from_git, failures) is None:
        print(f"mirror: warning: {pin.name}: no git source for the bare repository ({'; '.join(failures)})",
              file=sys.stderr)
        return "no git repository"
    repo = fetch_git.mirror_git_repo(ctx.cache, pin.repository, [c for c, _, _ in wanted], target)
    return f"repository {repo.relative_to(target)}"


def cmd_verify(ctx: Context, args: argparse.Namespace) -> int:
    lock = ctx.lock
    rows = [("PIN", "KIND", "SIZE", "SHA256/COMMIT", "SOURCE")]
    for pin in lock.pins.values():
        if isinstance(pin, FilePin):
            rows.append((pin.name, pin.kind, human_bytes(pin.size), pin.sha256[:16],
                         urllib.parse.urlparse(pin.urls[0]).netloc))
        elif isinstance(pin, GitDiffPin):
            rows.append((pin.name, pin.kind, "", f"{pin.parent[:8]}..{pin.commit[:8]}", pin.repository))
        else:
            rows.append((pin.name, pin.kind, "", pin.commit[:16], pin.repository))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for stack in lock.stacks.values():
        files = [lock.pins[n] for n in stack.pin_names()]
        total = sum(p.size for p in files if isinstance(p, FilePin))
        print(f"stack {stack.name}: {len(files)} pins ({len(stack.wheels)} wheels), {human_bytes(total)} of files")
    raw = lockfile.read_raw(lock.path)
    if lock.path.read_text(encoding="utf-8") != lockfile.canonical_text(raw):
        print(f"note: {lock.path} is not in canonical form; run `python3 -m tools.fetch format`", file=sys.stderr)
    print(f"{lock.path}: OK, {len(lock.pins)} pins, {len(lock.stacks)} stacks")
    return 0


def cmd_format(ctx: Context, args: argparse.Namespace) -> int:
    lockfile.write(ctx.lock.path, lockfile.read_raw(ctx.lock.path))
    print(ctx.lock.path)
    return 0


def cmd_evict(ctx: Context, args: argparse.Namespace) -> int:
    if args.sha256 is not None:
        # The value becomes a path under the cache: only a sha256 may (no `..`, no `/`).
        if not lockfile.is_sha256(args.sha256):
            raise UserError(f"evict --sha256 {args.sha256!r}: pass exactly 64 lowercase hex digits (a cache entry's "
                            "name under cas/sha256/)")
        targets = [(args.sha256, args.sha256)]
    else:
        pin = ctx.lock.pin(args.pin)
        if isinstance(pin, GitTreePin) and not pin.sha256:
            key = tree_index_key(pin.tree, list(pin.paths))
            recorded = ctx.cache.tree_entry(key)
            targets = [(recorded, f"tree-{key}")] if recorded else []
            ctx.cache.tree_index(key).unlink(missing_ok=True)
        else:
            targets = [(pin.sha256, pin.sha256)]
    removed = 0
    for sha256, key in targets:
        path = ctx.cache.evict(sha256, key)
        if path is not None:
            removed += 1
            print(path)
    if not removed:
        print("nothing to evict", file=sys.stderr)
    return 0


def cmd_add_git_diff(ctx: Context, args: argparse.Namespace) -> int:
    # Here, not in tools.pins: the diff's sha256 is that of the canonical diff this package
    # renders into its cache (pins -> fetch would make the package graph a circle).
    for value, label in ((args.commit, "--commit"), (args.parent, "--parent")):
        if value is not None and not re.fullmatch(r"[0-9a-f]{40}", value):
            raise UserError(f"{label} {value!r}: pass a full 40-char lowercase commit id (git rev-parse it first)")
    cache_repo = ctx.cache.git_repo(args.repository)
    sources = fetch_git.git_sources(args.repository, ctx.mirrors, args.from_git)
    failures: list[str] = []
    with ctx.cache.locked(f"git-{cache_repo.stem}"):
        fetch_git.init_bare(cache_repo)
        for source in sources:
            try:
                # depth 2 brings the first parent along when --parent is not given.
                fetch_git.fetch_commits(cache_repo, source, [args.commit, *([args.parent] if args.parent else [])],
                                        depth=2)
                break
            except SourceFailed as e:
                failures.append(f"{source}: {e}")
        else:
            raise UserError(f"add-git-diff {args.name}: no source has commit {args.commit} ({'; '.join(failures)}); "
                            "pass --from-git CHECKOUT with a clone that contains it")
        try:
            parent = args.parent or fetch_git.git_text(["rev-parse", "--verify", f"{args.commit}^1"], cache_repo)
        except SourceFailed:
            # A shallow source (a filled mirror holds each commit at depth 1) has no parent to name.
            raise UserError(f"add-git-diff {args.name}: commit {args.commit} from {source} comes without its parent "
                            "(a shallow clone or mirror); pass --parent PARENT, or --from-git CHECKOUT with a clone "
                            "that has the history") from None
        fetch_git.fetch_commits(cache_repo, str(cache_repo), [parent])
        with ctx.cache.temp_file(f"diff-{args.commit}") as (tmp, out):
            fetch_git.write_canonical_diff(cache_repo, parent, args.commit, out)
            sha256 = sha256_file(tmp)
            ctx.cache.commit(tmp, sha256)
        entry = {
            "kind": "git_diff", "repository": args.repository,
            "commit": args.commit, "commit_tree": fetch_git.tree_of(cache_repo, args.commit),
            "parent": parent, "parent_tree": fetch_git.tree_of(cache_repo, parent),
            "filename": args.filename or f"{args.name}-{args.commit[:8]}.diff", "sha256": sha256,
        }
    return write_git_pin(ctx, args, entry, f"sha256 {sha256}")


def cmd_add_git_tree(ctx: Context, args: argparse.Namespace) -> int:
    # The archive's sha256 is that of the tar this package renders (like add-git-diff's diff).
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        raise UserError(f"--commit {args.commit!r}: pass a full 40-char lowercase commit id (git rev-parse it first)")
    if args.path:
        return add_git_tree_paths(ctx, args, sorted(args.path))
    failures: list[str] = []
    cache_repo = ctx.cache.git_repo(args.repository)
    with ctx.cache.locked(f"git-{cache_repo.stem}"):
        fetch_git.init_bare(cache_repo)
        for source in fetch_git.git_sources(args.repository, ctx.mirrors, args.from_git):
            try:
                fetch_git.fetch_commits(cache_repo, source, [args.commit])
                break
            except SourceFailed as e:
                failures.append(f"{source}: {e}")
        else:
            raise no_source_has(args, failures)
        with ctx.cache.temp_file(f"tree-{args.commit}") as (tmp, out):
            fetch_git.write_canonical_archive(cache_repo, args.commit, out)
            sha256 = sha256_file(tmp)
            ctx.cache.commit(tmp, sha256)
        tree = fetch_git.tree_of(cache_repo, args.commit)
    ctx.cache.record_tree(tree_index_key(tree), sha256)
    entry = {"kind": "git_tree", "repository": args.repository, "commit": args.commit, "tree": tree,
             "filename": args.filename or f"{args.name}-{args.commit[:8]}.tar", "sha256": sha256}
    return write_git_pin(ctx, args, entry, f"tree {tree} sha256 {sha256}")


def add_git_tree_paths(ctx: Context, args: argparse.Namespace, paths: list[str]) -> int:
    """add-git-tree --path: the archive of those directories only, and each one's tree id."""
    problem = lockfile.tree_paths_problem(paths)
    if problem:
        raise UserError(f"add-git-tree {args.name}: --path {problem}")
    failures: list[str] = []
    got = fetch_git.ensure_paths_objects(ctx.cache, f"add-git-tree {args.name}", args.repository, args.commit,
                                         paths, ctx.mirrors, args.from_git, failures)
    if got is None:
        raise no_source_has(args, failures)
    repo, path_trees = got
    with ctx.cache.temp_file(f"tree-{args.commit}") as (tmp, out):
        fetch_git.write_canonical_archive(repo, args.commit, out, paths)
        sha256 = sha256_file(tmp)
        ctx.cache.commit(tmp, sha256)
    tree = fetch_git.tree_of(repo, args.commit)
    ctx.cache.record_tree(tree_index_key(tree, paths), sha256)
    entry = {"kind": "git_tree", "repository": args.repository, "commit": args.commit, "tree": tree,
             "paths": {p: path_trees[p] for p in paths},
             "filename": args.filename or f"{args.name}-{args.commit[:8]}.tar", "sha256": sha256}
    return write_git_pin(ctx, args, entry, f"tree {tree} paths {', '.join(paths)} sha256 {sha256}")


def no_source_has(args: argparse.Namespace, failures: Sequence[str]) -> UserError:
    return UserError(f"add-git-tree {args.name}: no source has commit {args.commit} ({'; '.join(failures)}); "
                     "pass --from-git CHECKOUT with a clone that contains it")


def write_git_pin(ctx: Context, args: argparse.Namespace, entry: dict, summary: str) -> int:
    """add-git-diff's and add-git-tree's last step: the entry (with --description) into the lock."""
    if args.description:
        entry["description"] = args.description
    raw = lockfile.read_raw(ctx.lock.path)
    raw.setdefault("pins", {})[args.name] = entry
    lockfile.write(ctx.lock.path, raw)
    print(f"{args.name}: {entry['filename']} {summary}", file=sys.stderr)
    print(args.name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m tools.fetch", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lock", default=str(lockfile.DEFAULT_LOCK), help="lock file (default: %(default)s)")
    common.add_argument("--cache", help="cache dir (default: $KIMI_K3_CACHE or ~/.cache/kimi-k3-build)")
    common.add_argument("--mirror", action="append", default=[], help="mirror dir, tried before origins (repeatable; "
                        "$KIMI_K3_MIRROR adds colon-separated dirs after these)")
    common.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="network timeout in seconds")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", parents=[common], help="fetch one pin, print the verified path")
    p.add_argument("--pin", required=True)
    p.add_argument("--out", help="also place the artifact here (a directory for git_tree pins)")
    p.add_argument("--copy", action="store_true", help="copy to --out instead of hardlinking")
    p.add_argument("--archive", action="store_true", help="place a git_tree pin's tar at --out, not its files")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("mirror", parents=[common], help="fill a mirror directory from the lock")
    p.add_argument("mirror_dir", nargs="?", help="the mirror to fill (or the first --mirror)")
    p.add_argument("--stack", action="append", default=[])
    p.add_argument("--pin", action="append", default=[])
    p.add_argument("--from-git", action="append", default=[], metavar="PIN=CHECKOUT")
    p.set_defaults(func=cmd_mirror)

    p = sub.add_parser("add-git-diff", parents=[common], help="add or bump a git_diff pin")
    p.add_argument("--name", required=True)
    p.add_argument("--repository", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--parent", help="default: the commit's first parent")
    p.add_argument("--from-git", metavar="CHECKOUT", help="local clone to read the commits from")
    p.add_argument("--filename")
    p.add_argument("--description")
    p.set_defaults(func=cmd_add_git_diff)

    p = sub.add_parser("add-git-tree", parents=[common], help="add or bump a git_tree pin (commit, tree, tar sha256)")
    p.add_argument("--name", required=True)
    p.add_argument("--repository", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--path", action="append", default=[], metavar="DIR",
                   help="archive only this directory of the commit (repeatable; relative to the repository root, "
                        "e.g. include); the lock records each one's tree id. For a build that reads only these, "
                        "from a clone that may lack other files")
    p.add_argument("--from-git", metavar="CHECKOUT", help="local clone to read the commit from")
    p.add_argument("--filename")
    p.add_argument("--description")
    p.set_defaults(func=cmd_add_git_tree)

    p = sub.add_parser("verify", parents=[common], help="validate the lock and print its pins")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("format", parents=[common], help="rewrite the lock in canonical form")
    p.set_defaults(func=cmd_format)

    p = sub.add_parser("evict", parents=[common], help="remove a cache entry")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--pin")
    group.add_argument("--sha256")
    p.set_defaults(func=cmd_evict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["add-pypi"]:  # the command tools.fetch had before tools.pins.pypi owned it
        raise UserError("add-pypi is a command of tools.pins.pypi: run `python3 -m tools.pins.pypi add-pypi "
                        "NAME==VERSION` (same flags, e.g. --lock, --platform, --python, --pin-name, --index-url)")
    args = build_parser().parse_args(argv)
    credentials.restore()  # the proxies' credentials, which tools/bazel keeps out of Bazel
    if args.command == "mirror":
        if not args.mirror_dir:
            if not args.mirror:
                raise UserError("mirror: name the directory to fill: `python3 -m tools.fetch mirror --mirror DIR` or `python3 -m tools.fetch mirror DIR`")
            args.mirror_dir = args.mirror[0]
    lock = lockfile.load(args.lock)
    cache = Cache(Path(args.cache) if args.cache else cache_env.cache_root(), option="--cache" if args.cache else None)
    if args.command in CACHE_COMMANDS:
        what = "--cache" if args.cache else (cache_env.ENV if os.environ.get(cache_env.ENV) else "cache directory")
        check_writable_path(cache.root, what, directory=True)
    ctx = Context(lock=lock, cache=cache, mirrors=mirror_dirs(args.mirror), timeout=args.timeout)
    return int(args.func(ctx, args))
