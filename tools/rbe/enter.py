"""Enter the cluster root: the first process of the cluster's own mount and PID namespaces.

    unshare --mount --pid --fork --kill-child --propagation private -- \
        python3 -m tools.rbe.enter ROOT WORKSPACE STATE VENV [READ_ONLY...] -- SUPERVISOR_ARGS...

Binds what the cluster needs at its own path (the workspace for the supervisor's code, the state
directory, the venv, and read-only the exec root's host paths its workers bind into actions), mounts a /proc of the new PID namespace and fresh /tmp, /run and /dev/shm,
pivots into ROOT (tools.common.pivot_root: bubblewrap creates its namespaces only where the root
is the namespace's root, never in a chroot), then execs the root's python3.13 as the
supervisor, which stays PID 1. Every mount lives in this namespace only, so when the supervisor
exits the kernel ends every process of the cluster and the mounts go with the namespace: nothing
is left behind on the host.
"""
from __future__ import annotations

import os
import subprocess
import sys

from tools.common.pivot_root import pivot


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise OSError(f"mount {' '.join(args)}: {proc.stderr.strip()}")


def enter(root: str, binds: list[str], ro: set[str]) -> None:
    _mount("--bind", root, root)  # pivot_root wants a mount point
    for d in ("proc", "dev", "tmp", "run"):
        os.makedirs(f"{root}/{d}", exist_ok=True)
    _mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", f"{root}/proc")
    _mount("--rbind", "/dev", f"{root}/dev")  # /dev/fuse for casd's staging, /dev/null, urandom
    _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", f"{root}/dev/shm")  # PostgreSQL's shared memory
    _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", f"{root}/tmp")
    _mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", f"{root}/run")
    for path in binds:
        os.makedirs(f"{root}{path}", exist_ok=True)
        _mount("--bind", path, f"{root}{path}")
        if path in ro:
            _mount("-o", "remount,bind,ro", f"{root}{path}")
    pivot(root)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 4:
        print("usage: python3 -m tools.rbe.enter ROOT WORKSPACE STATE VENV [READ_ONLY...] -- SUPERVISOR_ARGS...",
              file=sys.stderr)
        return 2
    end = argv.index("--")
    root, ws, state, venv = argv[:4]
    read_only = argv[4:end]  # the exec root's host paths (tools/rbe/exec_root.py)
    try:
        enter(root, [ws, state, venv, *read_only], ro={ws, venv, *read_only})
    except OSError as e:
        print(f"rbe: error: entering the cluster root {root}: {e}", file=sys.stderr)
        return 1
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PYTHONPATH": ws,
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    os.chdir("/")
    os.execve("/usr/bin/python3.13", ["python3.13", "-m", "tools.rbe.supervisor", *argv[end + 1:]], env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
