"""The artifact cache root every stage shares (CAS, git mirrors, kernel objects, rootfs tars, the
local registry): $KIMI_K3_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/kimi-k3-build. tools/bazel
computes the same path in shell (it runs before any Python) and exports KIMI_K3_CACHE."""
from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "KIMI_K3_CACHE"


def cache_root() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kimi-k3-build"


DISK_CACHE_ENV = "KIMI_K3_DISK_CACHE"


def disk_cache_dir() -> Path | None:
    """Bazel's disk cache: $KIMI_K3_DISK_CACHE (`off`: none), else <cache root>/bazel-disk-cache
    (tools/bazel passes the same to Bazel)."""
    value = os.environ.get(DISK_CACHE_ENV)
    if value == "off":
        return None
    return Path(value) if value else cache_root() / "bazel-disk-cache"


SIZE_FORMAT = re.compile(r"[0-9]+[KMGT]?")  # what tools/bazel accepts too (ASCII digits only)


def parse_size(text: str) -> int:
    """`50G`, `512M`, `1000` -> bytes (powers of 1024, as Bazel reads its size flags)."""
    if not SIZE_FORMAT.fullmatch(text):
        raise ValueError("expected a size such as 50G (ASCII digits, then nothing for bytes or "
                         "one of K, M, G, T)")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(text.rstrip("KMGT")) * units.get(text[-1], 1)


def prune_disk_cache(directory: Path, max_bytes: int) -> tuple[int, int, int]:
    """Remove the least recently used entries (Bazel refreshes an entry's mtime when it uses it)
    until the cache holds at most max_bytes; (files removed, bytes removed, bytes kept). A build
    running meanwhile that misses a removed blob reruns its action."""
    entries = []
    for sub in ("ac", "cas"):
        for dirpath, _, names in os.walk(directory / sub):
            for name in names:
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except OSError:
                    continue
                entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    removed = removed_bytes = 0
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total - removed_bytes <= max_bytes:
            break
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed += 1
        removed_bytes += size
    return removed, removed_bytes, total - removed_bytes


MAX_SIZE_ENV = "KIMI_K3_DISK_CACHE_MAX_SIZE"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tools.common.errors import UserError

    p = argparse.ArgumentParser(description="Prune Bazel's disk cache (the one tools/bazel uses) to a size.")
    p.add_argument("command", choices=["prune-disk-cache"])
    p.add_argument("--max-size", help=f"keep at most this much (default: ${MAX_SIZE_ENV} or 50G)")
    args = p.parse_args(argv)
    # The error names where the size came from: the flag, or the variable the user set.
    if args.max_size is not None:
        max_size, source = args.max_size, f"--max-size {args.max_size}"
    else:
        max_size = os.environ.get(MAX_SIZE_ENV) or "50G"
        source = f"{MAX_SIZE_ENV}={max_size}"
    try:
        max_bytes = parse_size(max_size)
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None
    directory = disk_cache_dir()
    if directory is None:
        raise UserError(f"{DISK_CACHE_ENV}=off: there is no disk cache to prune")
    where = f"{DISK_CACHE_ENV}={directory}" if os.environ.get(DISK_CACHE_ENV) else f"disk cache {directory}"
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{where}: exists and is not a directory; set {DISK_CACHE_ENV} to Bazel's "
                        "disk cache directory (or off)")
    if not directory.exists():
        print(f"{directory}: no disk cache yet, nothing to prune")
        return 0
    removed, removed_bytes, kept = prune_disk_cache(directory, max_bytes)
    print(f"{directory}: removed {removed} entries ({removed_bytes / 2**30:.2f} GiB), "
          f"{kept / 2**30:.2f} GiB kept (at most {max_size})")
    return 0


if __name__ == "__main__":
    import sys

    from tools.common.errors import run_cli

    sys.exit(run_cli(main))
