"""Refuse FlashInfer package sets whose versions disagree, or that would run unpatched kernels.

Rules (FlashInfer checks the first two itself at import, but only against its own
`_build_meta.__version__`, which a repacked wheel leaves at the upstream value):
  - flashinfer-cubin must equal flashinfer-python's version (its upstream part, for a patched one);
  - flashinfer-jit-cache must start with it (jit-cache versions carry a CUDA suffix: 0.6.18+cu130);
  - no official flashinfer-jit-cache next to a patched flashinfer-python (`+kimik3...`): its
    precompiled modules are loaded without any source check and would silently run the
    unpatched kernels. Only a jit-cache of exactly the patched version (built from the same
    patched tree) may accompany it.

Inputs: wheel files or names (`--wheel`), `--dist NAME==VERSION`, installed `--site-packages`
directories, and/or a stack of the lock (`--lock` + `--stack`). Exit 0 coherent, 1 not, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from tools.common.errors import UserError, run_cli
from tools.patch_gate.wheel import PATCHED_LOCAL_LABEL, read_metadata_name_version
from tools.pins import lock as pins_lock

FLASHINFER_PYTHON = "flashinfer-python"
FLASHINFER_CUBIN = "flashinfer-cubin"
FLASHINFER_JIT_CACHE = "flashinfer-jit-cache"
FLASHINFER_DISTS = (FLASHINFER_PYTHON, FLASHINFER_CUBIN, FLASHINFER_JIT_CACHE)


@dataclass(frozen=True)
class Dist:
    """A distribution name (canonical) and version, with where it was seen."""

    name: str
    version: str
    origin: str


def is_patched(version: str) -> bool:
    """A project-patched build: local version label starting with the patch label."""
    try:
        local = Version(version).local
    except InvalidVersion:
        return False
    return local is not None and local.split(".")[0] == PATCHED_LOCAL_LABEL


def upstream_version(version: str) -> str:
    """The version FlashInfer's own checks see: a patched wheel keeps the upstream __version__."""
    return version.split("+", 1)[0] if is_patched(version) else version


def dist_from_wheel(value: str) -> Dist:
    try:
        name, version, _, _ = parse_wheel_filename(Path(value).name)
    except InvalidWheelFilename as e:
        raise UserError(f"--wheel {value}: not a wheel file name ({e}); pass NAME-VERSION-TAGS.whl") from e
    return Dist(canonicalize_name(name), str(version), Path(value).name)


def dist_from_spec(value: str) -> Dist:
    name, sep, version = value.partition("==")
    if not sep or not name or not version:
        raise UserError(f"--dist {value!r}: expected NAME==VERSION, e.g. flashinfer-python==0.6.18")
    try:
        Version(version)
    except InvalidVersion as e:
        raise UserError(f"--dist {value!r}: {version!r} is not a PEP 440 version") from e
    return Dist(canonicalize_name(name), version, f"--dist {value}")


def dists_from_site_packages(directory: Path) -> list[Dist]:
    if not directory.is_dir():
        raise UserError(f"--site-packages {directory}: not a directory; pass an installed site-packages")
    dists = []
    for dist_info in sorted(directory.glob("*.dist-info")):
        name, version = read_metadata_name_version(dist_info / "METADATA")
        dists.append(Dist(canonicalize_name(name), version, str(dist_info)))
    return dists


def dists_from_lock_stack(lock_path: Path, stack: str) -> list[Dist]:
    """The packaged pins a stack of the lock names (file pins with a `package`)."""
    lock = pins_lock.load(lock_path)  # validated: a malformed lock is refused, not half read
    if stack not in lock.stacks:
        raise UserError(f"--stack {stack}: not in {lock_path} (stacks: {', '.join(sorted(lock.stacks))})")
    dists = []
    for value in lock.stacks[stack].roles.values():
        pin = lock.pins[value]
        if isinstance(pin, pins_lock.FilePin) and pin.package is not None:
            dists.append(Dist(canonicalize_name(pin.package.name), pin.package.version, f"lock pin {value}"))
    return dists


def _normalized(version: str) -> str:
    try:
        return str(Version(version))
    except InvalidVersion:
        return version


def coherence_problems(dists: Sequence[Dist]) -> list[str]:
    """Every reason the FlashInfer packages of this set must not be installed together."""
    problems: list[str] = []
    by_name: dict[str, Dist] = {}
    for dist in dists:
        seen = by_name.get(dist.name)
        if seen is not None and _normalized(seen.version) != _normalized(dist.version):
            problems.append(f"{dist.name} appears as {seen.version} ({seen.origin}) and {dist.version} ({dist.origin})")
        by_name.setdefault(dist.name, dist)
    python = by_name.get(FLASHINFER_PYTHON)
    cubin = by_name.get(FLASHINFER_CUBIN)
    jit_cache = by_name.get(FLASHINFER_JIT_CACHE)
    if python is None:
        problems += [f"{d.name} {d.version} ({d.origin}) without flashinfer-python" for d in (cubin, jit_cache) if d]
        return problems
    base = upstream_version(python.version)
    if cubin is not None and cubin.version != base:
        problems.append(f"flashinfer-cubin {cubin.version} does not equal flashinfer-python {base}: install the same version")
    if jit_cache is not None:
        if not jit_cache.version.startswith(base):
            problems.append(f"flashinfer-jit-cache {jit_cache.version} does not start with flashinfer-python {base}: install the matching build")
        if is_patched(python.version) and jit_cache.version != python.version:
            problems.append(
                f"flashinfer-jit-cache {jit_cache.version} next to patched flashinfer-python {python.version}: its precompiled "
                "modules load without a source check and would run unpatched kernels; drop it (use the kernel cache built "
                "from the patched tree)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="version_coherence.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", action="append", default=[], help="wheel file or file name (repeatable)")
    parser.add_argument("--dist", action="append", default=[], metavar="NAME==VERSION", help="a distribution (repeatable)")
    parser.add_argument("--site-packages", action="append", default=[], type=Path, help="installed site-packages (repeatable)")
    parser.add_argument("--lock", type=Path, help="pins.lock.json (with --stack)")
    parser.add_argument("--stack", help="a stack of the lock, e.g. default or pypi")
    args = parser.parse_args(argv)
    if bool(args.lock) != bool(args.stack):
        raise UserError("--lock and --stack go together; pass both or neither")
    dists = [dist_from_wheel(w) for w in args.wheel] + [dist_from_spec(d) for d in args.dist]
    for directory in args.site_packages:
        dists += dists_from_site_packages(directory)
    if args.lock:
        dists += dists_from_lock_stack(args.lock, args.stack)
    if not dists:
        raise UserError("no input: pass --wheel, --dist, --site-packages or --lock with --stack")
    flashinfer = [d for d in dists if d.name in FLASHINFER_DISTS]
    for dist in flashinfer:
        print(f"{dist.name} {dist.version}{' (patched)' if is_patched(dist.version) else ''}  [{dist.origin}]")
    problems = coherence_problems(dists)
    for problem in problems:
        print(f"version coherence: {problem}", file=sys.stderr)
    if not problems:
        print(f"version coherence: ok ({len(flashinfer)} FlashInfer distributions of {len(dists)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
