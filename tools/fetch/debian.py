"""Debian sets' .debs through the verified fetch: fetched into the cache (mirrors first, the
lock's size as cap), copied into a mirror, unpacked into a tree, laid out as a flat apt repository;
and the Debian CLI (`python3 -m tools.fetch.debian`, main() here: its lock commands are
tools.pins.debian's, resolve, add-set, check-root, key, show; mirror, extract and repo are here).
The CLI lives here, the higher of the two stages, so that no import points from pins to fetch.

Each package is the file pin tools.pins.debian.DebPackage.pin gives (name `<set>/<package>`,
mirror layout `<mirror>/<basename of the pool path>`). Standard library only: the repository
rule of `@debian_<set>` runs `repo` with a bare interpreter.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tools.common import cache as cache_env
from tools.common import credentials
from tools.common.errors import UserError, run_cli
from tools.common.files import check_replaceable_dir, dir_replaced_atomically, write_bytes_atomic
from tools.common.jsonfmt import canonical_json
from tools.common.progress import human_bytes
from tools.fetch.cache import Cache
from tools.fetch.cli import mirror_file
from tools.fetch.place import check_writable_path
from tools.fetch.sources import fetch_file_pin, mirror_dirs
from tools.pins import debian

# A set's unpacked tree and its local repository are these tools' outputs (marked): a rerun may
# replace them, nothing else.
EXTRACT_TOOL = "tools.fetch.debian extract"
REPOSITORY_TOOL = "tools.fetch.debian repo"


def fetch_set(deb_set: debian.DebSet, cache_dir: Path | None = None, mirrors: Sequence[Path] | None = None,
              timeout: float = debian.TIMEOUT_S) -> list[tuple[debian.DebPackage, Path]]:
    """Every .deb of the set as a verified CAS entry (tools.fetch: cache, mirrors, origin URLs)."""
    cache = Cache(cache_dir or cache_env.cache_root())
    mirrors = list(mirrors) if mirrors is not None else mirror_dirs([])
    repin = f"re-resolve with `{debian.resolve_command(deb_set.name)}`"
    result = []
    total = sum(p.size for p in deb_set.packages)
    done, started = 0, time.monotonic()
    for index, pkg in enumerate(deb_set.packages, 1):
        path = fetch_file_pin(pkg.pin(deb_set.name), cache, mirrors, timeout, fill_hint=debian.fill_command(deb_set.name),
                              repin_hint=repin)
        done += pkg.size
        result.append((pkg, path))
        if index % 25 == 0 or index == len(deb_set.packages):
            rate = done / max(time.monotonic() - started, 1e-6)
            print(f"debian: {deb_set.name}: {index}/{len(deb_set.packages)} .debs verified, {human_bytes(done)} / "
                  f"{human_bytes(total)}, {human_bytes(rate)}/s, ETA {(total - done) / max(rate, 1):.0f} s",
                  file=sys.stderr, flush=True)
    return result


def mirror_set(deb_set: debian.DebSet, target: Path, cache_dir: Path | None = None,
               mirrors: Sequence[Path] | None = None) -> None:
    check_writable_path(target.absolute(), "mirror", directory=True)
    sources = [target, *[m for m in (mirror_dirs([]) if mirrors is None else mirrors) if m != target]]
    for pkg, path in fetch_set(deb_set, cache_dir, sources):
        mirror_file(path, target / Path(pkg.filename).name, pkg.sha256, pkg.size)
    print(f"debian: mirror {target}: set '{deb_set.name}' complete ({len(deb_set.packages)} .debs)", file=sys.stderr)


def extract_set(lock_path: Path | str, name: str, out_dir: Path | str, cache_dir: Path | None = None,
                mirrors: Sequence[Path] | None = None) -> Path:
    """Unpack every .deb of set `name` (data archives only: no maintainer scripts run) into
    `out_dir`, in name order, in a temp sibling renamed into place; writes `out_dir/.debian-set.json`."""
    deb_set = debian.load_set(lock_path, name)
    out = Path(out_dir).absolute()
    check_writable_path(out, "--out", directory=True)
    check_replaceable_dir(out, "--out", EXTRACT_TOOL)  # before any download
    debs = fetch_set(deb_set, cache_dir, mirrors)
    with dir_replaced_atomically(out, "--out", tool=EXTRACT_TOOL) as tmp:
        started = time.monotonic()
        for index, (pkg, path) in enumerate(debs, 1):
            unpack_deb(path, tmp, f"set '{name}' package {pkg.name}", "re-resolve the set")
            if index % 25 == 0 or index == len(debs):
                print(f"debian: {name}: {index}/{len(debs)} unpacked ({time.monotonic() - started:.1f} s)",
                      file=sys.stderr, flush=True)
        write_bytes_atomic(tmp / debian.SET_MARKER, canonical_json({"name": name, "packages": deb_set.entries()}))
    print(f"debian: set '{name}' ({len(debs)} packages) -> {out}", file=sys.stderr)
    return out


def unpack_deb(path: Path, out: Path, what: str, fix: str) -> None:
    """One verified .deb's files into out (dpkg-deb -x); a file dpkg-deb cannot read is one line
    naming `what` and the `fix`."""
    proc = subprocess.run(["dpkg-deb", "-x", str(path), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{what}: dpkg-deb -x failed ({proc.stderr.strip()}); the verified file {path} is "
                        f"not a .deb dpkg-deb reads: {fix}")


def deb_control(path: Path, what: str) -> str:
    """The control paragraph of a .deb, as dpkg-deb reads it."""
    proc = subprocess.run(["dpkg-deb", "--field", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{what}: dpkg-deb --field failed ({proc.stderr.strip()}); the verified file {path} is "
                        "not a .deb dpkg-deb reads: re-resolve the set")
    return proc.stdout.rstrip("\n")


def local_repository(deb_set: debian.DebSet, out_dir: Path | str, cache_dir: Path | None = None,
                     mirrors: Sequence[Path] | None = None, what: str = "repository") -> Path:
    """A flat apt repository of exactly the set's verified .debs (`deb [trusted=yes] copy://DIR ./`),
    built in a temp sibling and renamed into place: the only mirror mmdebstrap is given, so a
    root holds nothing the lock does not name.

    The Packages file is written here from `dpkg-deb --field` (dpkg-deb comes with dpkg itself;
    dpkg-scanpackages needs dpkg-dev, apt-ftparchive apt-utils), with the lock's size and sha256."""
    out = Path(out_dir).absolute()
    check_writable_path(out, what, directory=True)
    check_replaceable_dir(out, what, REPOSITORY_TOOL)
    debs = fetch_set(deb_set, cache_dir, mirrors)
    with dir_replaced_atomically(out, what, tool=REPOSITORY_TOOL) as tmp:
        stanzas = []
        for pkg, path in debs:
            name = Path(pkg.filename).name
            try:
                os.link(path, tmp / name)
            except OSError:
                shutil.copyfile(path, tmp / name)
            control = deb_control(path, f"set '{deb_set.name}' package {pkg.name}")
            fields = dict((line.partition(":")[0], line.partition(":")[2].strip())
                          for line in control.splitlines() if line and line[0] not in " \t")
            if (fields.get("Package"), fields.get("Version")) != (pkg.name, pkg.version):
                raise UserError(f"set '{deb_set.name}' package {pkg.name} {pkg.version}: the verified .deb says "
                                f"{fields.get('Package')} {fields.get('Version')}; the lock is inconsistent: "
                                f"re-resolve with `{debian.resolve_command(deb_set.name)}`")
            stanzas.append(f"{control}\nFilename: ./{name}\nSize: {pkg.size}\nSHA256: {pkg.sha256}\n")
        (tmp / "Packages").write_text("\n".join(stanzas), encoding="utf-8")
    print(f"debian: set '{deb_set.name}': local repository of {len(debs)} .debs -> {out}", file=sys.stderr)
    return out


# --- CLI ---------------------------------------------------------------------------------------

def _mirrors(args: argparse.Namespace) -> list[Path]:
    return mirror_dirs(args.mirror)


def _cache(args: argparse.Namespace) -> Path | None:
    return Path(args.cache) if args.cache else None


def cmd_mirror(args: argparse.Namespace) -> int:
    sets = debian.load_sets(args.lock)
    for name in args.set or sorted(sets):
        mirror_set(debian.load_set(args.lock, name), Path(args.mirror_dir), _cache(args), _mirrors(args))
    print(args.mirror_dir)
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    print(extract_set(args.lock, args.set, args.out, _cache(args), _mirrors(args)))
    return 0


def cmd_repo(args: argparse.Namespace) -> int:
    print(local_repository(debian.load_set(args.lock, args.set), Path(args.out), _cache(args), _mirrors(args),
                           what="--out"))
    return 0


def add_fetch_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """mirror, extract and repo: the commands of the Debian CLI that fetch .debs."""
    for command, helptext in (("mirror", "fill a mirror directory with the sets' .debs"),
                              ("extract", "unpack a set's verified .debs into a directory"),
                              ("repo", "a flat apt repository of a set's verified .debs")):
        p = sub.add_parser(command, parents=[common], help=helptext)
        p.add_argument("--cache", help="cache dir (default: $KIMI_K3_CACHE or ~/.cache/kimi-k3-build)")
        p.add_argument("--mirror", action="append", default=[], help="mirror dir, tried before origins (repeatable; "
                       "$KIMI_K3_MIRROR adds colon-separated dirs after these)")
        if command == "mirror":
            p.add_argument("mirror_dir")
            p.add_argument("--set", action="append", default=[], help="set name (repeatable; default: every set)")
            p.set_defaults(func=cmd_mirror)
        else:
            p.add_argument("--set", required=True)
            p.add_argument("--out", required=True)
            p.set_defaults(func=cmd_extract if command == "extract" else cmd_repo)


def main(argv: Sequence[str] | None = None) -> int:
    """The whole Debian CLI (`python3 -m tools.fetch.debian`)."""
    args = debian.build_parser(add_fetch_commands).parse_args(argv)
    credentials.restore()  # the proxies' credentials, which tools/bazel keeps out of Bazel
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(run_cli(main))
