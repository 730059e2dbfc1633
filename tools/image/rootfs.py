"""Base root filesystems for the image.

Usage:
    python3 -m tools.image.rootfs debian --out base.tar [--lock third_party/debian.lock.json]
            [--set image-base] [--repo DIR]
        The Debian rootfs tar of a set of the Debian lock: mmdebstrap whose only mirror is a local
        repository of the set's verified .debs (--repo, from `python3 -m tools.fetch.debian repo`,
        else made here through tools.fetch: cache, mirrors, origin). Cached under
        ${KIMI_K3_CACHE:-~/.cache/kimi-k3-build}/rootfs/<set>-<key>.tar, the key from the set's
        package entries, re-hashed on every use; the root must hold exactly the set's packages.
    python3 -m tools.image.rootfs pull --reference REGISTRY/REPO@sha256:D --out LAYOUT_DIR
        A base image pulled by digest into an OCI layout (tools/image/layout.py --base-layout).
    python3 -m tools.image.rootfs host-python --out DIR [--module M]...
        A tiny rootfs holding only this machine's Python interpreter, the shared libraries it
        loads and the stdlib modules needed to import M: the fast base of the CPU test image.

The rootfs tar goes into a layer through tools/image/layer.py --tar (entries sorted, mtimes fixed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tools.common.cache import cache_root
from tools.common.errors import UserError, run_cli
from tools.common.files import check_replaceable_dir, replace_dir, temp_dir_sibling, write_text_atomic
from tools.common.hashing import sha256_bytes, sha256_file
from tools.common.jsonfmt import canonical_json
from tools.fetch.debian import local_repository
from tools.image.layer_tar import source_date_epoch
from tools.image.wheel_install import SITE_PACKAGES
from tools.pins import debian

DEFAULT_SET = "image-base"


def link_or_copy(src: Path, dest: Path) -> None:
    """Place `src` at `dest` atomically (hard link when possible)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


# ---------------------------------------------------------------- debian (mmdebstrap from the lock)

# Part of the cache key: bump when the mmdebstrap call below changes what a rootfs holds.
RECIPE = "mmdebstrap-custom-copy-repo-v1"


def sources_list(deb_set: debian.DebSet) -> str:
    """The image's /etc/apt/sources.list: the set's archive and suites (the local repository the
    root was built from is a temp path, and must not be what `apt-get update` reads later)."""
    return "".join(f"deb {deb_set.archive} {suite} main\n" for suite in deb_set.suites)


def mmdebstrap_version() -> str:
    proc = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def rootfs_key(deb_set: debian.DebSet, epoch: int, tool_version: str) -> str:
    """The cached tar's key: the set's package entries (name, version, sha256, ...), the epoch,
    the sources.list written into it, the recipe and the mmdebstrap that ran it. Not the set's
    description, suites' current state or any URL's content: only what the tar is built from."""
    return sha256_bytes(canonical_json({"packages": deb_set.entries(), "epoch": epoch, "recipe": RECIPE,
                                        "sources": sources_list(deb_set), "mmdebstrap": tool_version}))[:24]


def mmdebstrap_command(deb_set: debian.DebSet, repo: Path, out: Path) -> list[str]:
    # variant=custom with every package of the set named: the root holds exactly the set
    # (check_installed proves it), and the only mirror is the local repository of verified .debs
    # (copy://: mmdebstrap copies them into the chroot, which cannot see file:// paths).
    # The ldconfig aux-cache holds inode/mtime data of the build host: dropped for identical tars.
    names = ",".join(p.name for p in deb_set.packages)
    return ["mmdebstrap", "--mode=root", "--format=tar", "--variant=custom", f"--include={names}",
            "--aptopt=Acquire::Check-Valid-Until \"false\"",
            "--customize-hook=rm -f \"$1\"/var/cache/ldconfig/aux-cache",
            f"--customize-hook=printf %s {shlex.quote(sources_list(deb_set))} > \"$1\"/etc/apt/sources.list",
            deb_set.suites[0], str(out), f"deb [trusted=yes] copy://{repo.absolute()} ./"]


def dpkg_status_of(tar_path: Path) -> str:
    with tarfile.open(tar_path) as tar:
        for name in ("./var/lib/dpkg/status", "var/lib/dpkg/status"):
            try:
                member = tar.extractfile(name)
            except KeyError:
                continue
            if member is not None:
                return member.read().decode("utf-8", errors="replace")
    raise UserError(f"rootfs {tar_path}: no var/lib/dpkg/status; mmdebstrap did not produce a Debian root")


def cached_rootfs(cached: Path) -> Path | None:
    """The cached tar after re-hashing it against the sha256 recorded when it was built; a
    corrupt or unrecorded one is removed (it is derived: building it again is always right)."""
    record = cached.with_name(cached.name + ".sha256")
    if not cached.is_file():
        return None
    expected = record.read_text().strip() if record.is_file() else ""
    actual = sha256_file(cached)
    if actual == expected:
        return cached
    print(f"[rootfs] warning: cached {cached} is corrupt (sha256 {actual}, recorded {expected or 'none'}); "
          "building it again", file=sys.stderr)
    cached.unlink()
    record.unlink(missing_ok=True)
    return None


def debian_rootfs(out: Path, lock: Path, set_name: str, epoch: int, repo: Path | None = None,
                  cache_dir: Path | None = None) -> str:
    """The rootfs tar of Debian set `set_name`, from the cache (keyed by the set's entries, re-hashed)
    or built by mmdebstrap from a local repository of the set's verified .debs (`repo`, else made
    here through tools.fetch); returns its sha256."""
    if shutil.which("mmdebstrap") is None:
        raise UserError("mmdebstrap: not on PATH; install it (apt-get install -y mmdebstrap) or use `pull`")
    deb_set = debian.load_set(lock, set_name)
    key = rootfs_key(deb_set, epoch, mmdebstrap_version())
    cached = (cache_dir or cache_root()) / "rootfs" / f"{set_name}-{key}.tar"
    if cached_rootfs(cached) is None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{set_name}-repo.", dir=cached.parent) as scratch:
            if repo is None:
                repo = local_repository(deb_set, Path(scratch) / "repo", cache_dir)
            tmp = cached.parent / f".{os.getpid()}.{cached.name}"  # ends in .tar, as mmdebstrap's format
            env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
            started = time.monotonic()
            print(f"[rootfs] mmdebstrap {set_name}: {len(deb_set.packages)} locked packages (about 2-3 min)",
                  file=sys.stderr)
            try:
                proc = subprocess.run(mmdebstrap_command(deb_set, repo, tmp), env=env)
                if proc.returncode != 0:
                    raise UserError(f"mmdebstrap of Debian set '{set_name}' failed (exit {proc.returncode}, see "
                                    "above); the set may be incomplete: re-resolve it with "
                                    f"`{debian.resolve_command(set_name)}`")
                debian.check_installed(deb_set, dpkg_status_of(tmp), f"rootfs of set '{set_name}'")
                write_text_atomic(cached.with_name(cached.name + ".sha256"), sha256_file(tmp) + "\n")
                os.replace(tmp, cached)
            finally:
                tmp.unlink(missing_ok=True)
        print(f"[rootfs] built {cached} ({cached.stat().st_size >> 20} MiB) in "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    link_or_copy(cached, out)
    return sha256_file(out)


# ---------------------------------------------------------------- pull by digest

_DIGEST_REF_RE = re.compile(r"^[^@\s]+/[^@\s]+@sha256:[0-9a-f]{64}$")


PULL_TOOL = "tools.image.rootfs pull"


def pull_base(reference: str, out: Path) -> str:
    """Copy a base image by digest into an OCI layout; returns the digest."""
    if not _DIGEST_REF_RE.match(reference):
        raise UserError(f"--reference {reference!r}: pin the base by digest: REGISTRY/REPO@sha256:<64 hex>")
    host = reference.split("/", 1)[0].rsplit(":", 1)[0]
    tls = "false" if host in ("127.0.0.1", "localhost") else "true"
    out = out.absolute()
    check_replaceable_dir(out, "--out", PULL_TOOL)  # before the pull: a wrong --out costs nothing
    tmp = temp_dir_sibling(out)
    tmp.rmdir()  # skopeo makes the layout's folder itself
    # No --preserve-digests: a Docker-format base must be converted to OCI for an oci: layout;
    # the layer blobs keep their bytes, and the digest asked for is recorded as the base digest.
    proc = subprocess.run(["skopeo", "copy", f"--src-tls-verify={tls}", f"docker://{reference}", f"oci:{tmp}:base"],
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise UserError(f"--reference {reference}: pull failed: {last[0]}; check the reference and credentials")
    (tmp / "base-digest").write_text(reference.split("@", 1)[1] + "\n")
    try:
        replace_dir(tmp, out, "--out", tool=PULL_TOOL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return reference.split("@", 1)[1]


# ---------------------------------------------------------------- host python (CPU tests)

_LDD_RE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


def shared_libraries(binary: Path) -> list[Path]:
    """The absolute library paths `ldd` reports for `binary` (the loader included)."""
    proc = subprocess.run(["ldd", str(binary)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return [Path(m.group(1)) for line in proc.stdout.splitlines() if (m := _LDD_RE.search(line))]


def _module_files(python: Path, modules: Sequence[str]) -> list[Path]:
    code = ("import sys, json, site\n"
            + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted({getattr(m, '__file__', None) or '' for m in list(sys.modules.values())})))")
    proc = subprocess.run([str(python), "-I", "-c", code], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise UserError(f"--module {' '.join(modules)}: the host python cannot import them; pass stdlib modules")
    return [Path(f) for f in json.loads(proc.stdout) if f]


def host_python_rootfs(out: Path, modules: Sequence[str] = ()) -> Path:
    """A rootfs dir with the running interpreter at its own path and /usr/bin/python3 -> it.

    The interpreter keeps its host path so its RUNPATH and prefix search work unchanged inside
    a chroot. A .pth file puts Debian's /usr/local/lib/python3.11/dist-packages on sys.path,
    as Debian's python3 does, so the layers built for the real image import the same way.
    """
    python = Path(sys.executable).resolve()
    base_prefix = Path(sys.base_prefix).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = {python, stdlib / "os.py", *shared_libraries(python)}
    # Codecs looked up by name at startup (the locale's, e.g. ASCII with no LANG in a chroot).
    startup = ["encodings.ascii", "encodings.latin_1", "encodings.utf_8", "encodings.aliases"]
    for f in _module_files(python, [*startup, *modules]):
        f = f.resolve()
        if f.is_relative_to(base_prefix) and f.exists():
            files.add(f)
            if f.suffix == ".so":
                files.update(shared_libraries(f))
    out = out.absolute()
    if out.exists():
        raise UserError(f"--out {out}: already exists; pass a new directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in sorted(files):
            dest = tmp / str(f).lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f.resolve(), dest)  # resolve: /lib is a symlink on merged-/usr hosts
        (tmp / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        os.symlink(str(python), tmp / "usr" / "bin" / "python3")
        site = tmp / str(stdlib).lstrip("/") / "site-packages"
        site.mkdir(parents=True, exist_ok=True)
        (site / "kimi-k3-dist-packages.pth").write_text("/" + SITE_PACKAGES + "\n")
        for d in ("tmp", "proc", "dev", "root"):
            (tmp / d).mkdir(exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    deb = sub.add_parser("debian", help="Debian rootfs tar of a set of the Debian lock (mmdebstrap, cached)")
    deb.add_argument("--out", required=True, type=Path)
    deb.add_argument("--lock", type=Path, default=debian.DEFAULT_LOCK)
    deb.add_argument("--set", default=DEFAULT_SET)
    deb.add_argument("--repo", type=Path, help="local repository of the set (python3 -m tools.fetch.debian repo)")
    deb.add_argument("--source-date-epoch", default=None)
    deb.add_argument("--cache-root-file", type=Path,
                     help="file naming the cache root (Bazel actions have no $KIMI_K3_CACHE); default: the cache root")
    pull = sub.add_parser("pull", help="base image by digest into an OCI layout")
    pull.add_argument("--reference", required=True)
    pull.add_argument("--out", required=True, type=Path)
    host = sub.add_parser("host-python", help="tiny rootfs with this machine's python (CPU tests)")
    host.add_argument("--out", required=True, type=Path)
    host.add_argument("--module", action="append", default=[])
    args = p.parse_args(argv)
    if args.command == "debian":
        epoch = source_date_epoch(args.source_date_epoch)
        cache_dir = Path(args.cache_root_file.read_text().strip()) if args.cache_root_file else None
        digest = debian_rootfs(args.out, args.lock, args.set, epoch, args.repo, cache_dir)
        print(f"rootfs tar: {args.out} sha256:{digest}")
    elif args.command == "pull":
        print(f"base digest: {pull_base(args.reference, args.out)}")
    else:
        print(f"rootfs: {host_python_rootfs(args.out, args.module)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
