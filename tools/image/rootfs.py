"""Base root filesystems for the image.

Usage:
    python3 -m tools.image.rootfs debian --out base.tar [--suite bookworm] [--mirror URL] [--include PKG]...
        A minimal Debian rootfs tar from mmdebstrap (offline-capable default: cached under
        ${KIMI_K3_CACHE:-~/.cache/kimi-k3-build}/rootfs/<key>.tar, built once per key).
        bookworm's python3 is 3.11, matching the cp311 wheels. Reproducible as long as the
        mirror's content is fixed: pass a snapshot.debian.org URL to pin it.
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
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tools.common.cache import cache_root
from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_bytes, sha256_file
from tools.image.layer import SITE_PACKAGES, source_date_epoch

DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# python3 for the stack; libibverbs1 + ibverbs-providers because Mooncake's transfer engine
# loads libibverbs even for TCP; ca-certificates for HTTPS model downloads at serve time.
DEFAULT_INCLUDE = ("python3", "libibverbs1", "ibverbs-providers", "ca-certificates")


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


# ---------------------------------------------------------------- debian (mmdebstrap)

def mmdebstrap_command(suite: str, mirror: str, include: Sequence[str], variant: str, out: Path) -> list[str]:
    # The ldconfig aux-cache holds inode/mtime data of the build host: drop it for identical tars.
    return ["mmdebstrap", "--mode=root", "--format=tar", f"--variant={variant}", f"--include={','.join(include)}",
            "--aptopt=Acquire::Check-Valid-Until \"false\"",
            "--customize-hook=rm -f \"$1\"/var/cache/ldconfig/aux-cache",
            suite, str(out), mirror]


def debian_rootfs(out: Path, suite: str, mirror: str, include: Sequence[str], variant: str, epoch: int) -> str:
    """Build (or reuse from the cache) the rootfs tar; returns its sha256."""
    if shutil.which("mmdebstrap") is None:
        raise UserError("mmdebstrap: not on PATH; install it (apt-get install -y mmdebstrap) or use `pull`")
    key_text = json.dumps([suite, mirror, sorted(include), variant, epoch])
    key = sha256_bytes(key_text.encode())[:24]
    cached = cache_root() / "rootfs" / f"{suite}-{variant}-{key}.tar"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.parent / f".{os.getpid()}.{cached.name}"  # ends in .tar, as mmdebstrap's format
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
        started = time.monotonic()
        print(f"[rootfs] mmdebstrap {suite} {variant} +{','.join(include)} (about 2 min)", file=sys.stderr)
        proc = subprocess.run(mmdebstrap_command(suite, mirror, include, variant, tmp), env=env)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise UserError(f"mmdebstrap {suite} from {mirror} failed (exit {proc.returncode}); "
                            "check the mirror URL and network, or use `rootfs.py pull`")
        os.replace(tmp, cached)
        print(f"[rootfs] built {cached} ({cached.stat().st_size >> 20} MiB) in "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    link_or_copy(cached, out)
    return sha256_file(out)


# ---------------------------------------------------------------- pull by digest

_DIGEST_REF_RE = re.compile(r"^[^@\s]+/[^@\s]+@sha256:[0-9a-f]{64}$")


def pull_base(reference: str, out: Path) -> str:
    """Copy a base image by digest into an OCI layout; returns the digest."""
    if not _DIGEST_REF_RE.match(reference):
        raise UserError(f"--reference {reference!r}: pin the base by digest: REGISTRY/REPO@sha256:<64 hex>")
    host = reference.split("/", 1)[0].rsplit(":", 1)[0]
    tls = "false" if host in ("127.0.0.1", "localhost") else "true"
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    shutil.rmtree(tmp)
    # No --preserve-digests: a Docker-format base must be converted to OCI for an oci: layout;
    # the layer blobs keep their bytes, and the digest asked for is recorded as the base digest.
    proc = subprocess.run(["skopeo", "copy", f"--src-tls-verify={tls}", f"docker://{reference}", f"oci:{tmp}:base"],
                          stderr=subprocess.PIPE)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise UserError(f"--reference {reference}: pull failed: {last[0]}; check the reference and credentials")
    (tmp / "base-digest").write_text(reference.split("@", 1)[1] + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
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
    deb = sub.add_parser("debian", help="minimal Debian rootfs tar via mmdebstrap (cached)")
    deb.add_argument("--out", required=True, type=Path)
    deb.add_argument("--suite", default=DEFAULT_SUITE)
    deb.add_argument("--mirror", default=DEFAULT_MIRROR, help="e.g. http://snapshot.debian.org/archive/debian/20261120T000000Z")
    deb.add_argument("--variant", default="minbase")
    deb.add_argument("--include", action="append", default=None, help=f"default: {','.join(DEFAULT_INCLUDE)}")
    deb.add_argument("--source-date-epoch", default=None)
    pull = sub.add_parser("pull", help="base image by digest into an OCI layout")
    pull.add_argument("--reference", required=True)
    pull.add_argument("--out", required=True, type=Path)
    host = sub.add_parser("host-python", help="tiny rootfs with this machine's python (CPU tests)")
    host.add_argument("--out", required=True, type=Path)
    host.add_argument("--module", action="append", default=[])
    args = p.parse_args(argv)
    if args.command == "debian":
        epoch = source_date_epoch(args.source_date_epoch)
        digest = debian_rootfs(args.out, args.suite, args.mirror, args.include or DEFAULT_INCLUDE, args.variant, epoch)
        print(f"rootfs tar: {args.out} sha256:{digest}")
    elif args.command == "pull":
        print(f"base digest: {pull_base(args.reference, args.out)}")
    else:
        print(f"rootfs: {host_python_rootfs(args.out, args.module)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
