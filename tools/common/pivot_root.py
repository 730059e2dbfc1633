"""Make a directory the root of the calling mount namespace: pivot_root(2), then detach the old root.

    python3 -m tools.common.pivot_root NEW_ROOT

tools/bazel runs this in the sealed root's own mount namespace (unshare --mount), so that Bazel
runs with the sealed root as its namespace's root rather than chrooted into it: the kernel lets a
process create user and mount namespaces (Bazel's linux-sandbox, bubblewrap) only when its root is
its mount namespace's root. Every process of the namespace whose root was the old one (the
namespace's holder) has the new root afterwards; the old root (the host's /) is unmounted lazily, so
nothing in the namespace can reach the host's files.

Why not pivot_root(8): Debian sid's util-linux no longer ships it (the launcher's own tests run it
inside the sealed root), and Python's os module has no wrapper; glibc has none either, so this is
the raw system call.
"""
from __future__ import annotations

import ctypes
import os
import sys

# pivot_root's system call number (glibc exports no wrapper).
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
MNT_DETACH = 2
# Where the old root hangs between the pivot and its lazy unmount; removed afterwards.
OLD_ROOT = "run/kimi-k3-old-root"


def pivot(new_root: str) -> None:
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: no system call number known for {machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir(new_root)
    os.makedirs(OLD_ROOT, exist_ok=True)
    if libc.syscall(SYS_PIVOT_ROOT[machine], b".", OLD_ROOT.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root {new_root}: {os.strerror(err)} (is it a mount point, in a private mount "
                      "namespace of its own?)")
    os.chdir("/")
    if libc.umount2(b"/" + OLD_ROOT.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount /{OLD_ROOT}: {os.strerror(err)}")
    os.rmdir("/" + OLD_ROOT)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isabs(argv[0]):
        print("usage: python3 -m tools.common.pivot_root NEW_ROOT (an absolute directory)", file=sys.stderr)
        return 2
    try:
        pivot(argv[0])
    except OSError as e:
        print(f"tools.common.pivot_root: error: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
