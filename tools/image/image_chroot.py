"""Running in a chroot of the unpacked root with only the image's environment: a private mount
namespace with /proc, without network unless asked; the imports the smoke test checks, run with
the image's python3."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError

# Runs inside the chroot with the image's python3; builtins and sys only, so a tiny test image
# needs no more stdlib than what it tests. One line per module: MARK, name, ok, detail.
_MARK = "kimi-k3-smoke"
_IMPORT_SCRIPT = r"""
import sys
for name in sys.argv[1:]:
    try:
        __import__(name)
        ok, detail = "1", str(getattr(sys.modules[name], "__file__", None))
    except BaseException as e:
        ok, detail = "0", type(e).__name__ + ": " + str(e).replace("\n", " ")
    print("kimi-k3-smoke", name, ok, detail, sep="\t", flush=True)
"""


def run_in_chroot(rootfs: Path, argv: Sequence[str], env: Sequence[str], network: bool = True,
                  timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """argv (image paths) in a chroot of rootfs with only `env`: a private mount namespace with
    /proc, and without network (its own network namespace, loopback down) unless `network`."""
    if os.geteuid() != 0:
        raise UserError("image_smoke: chroot needs root; run as root (CI runs tests as root)")
    (rootfs / "proc").mkdir(exist_ok=True)
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    inner = [chroot, str(rootfs), *argv]
    unshare = shutil.which("unshare")
    if unshare:
        # A private mount namespace: /proc is mounted for torch & co and vanishes with the process.
        # `--propagation private` would remount / private, which fails when / is not a mount
        # point (inside tools/bazel's sealed root, a chroot); making the mount that holds the
        # rootfs private in the new namespace gives the same isolation in both cases.
        mount = shutil.which("mount") or "/usr/bin/mount"
        findmnt = shutil.which("findmnt") or "/usr/bin/findmnt"
        cmd = [unshare, "--mount", *([] if network else ["--net"]), "--propagation", "unchanged", "--",
               "/bin/sh", "-c",
               f'{mount} --make-rprivate "$({findmnt} -n -o TARGET -T "$0")" && '
               f'{mount} -t proc proc "$0/proc" && exec "$@"', str(rootfs), *inner]
    elif not network:
        raise UserError("unshare: not on PATH; the profile check runs without network in its own namespace: "
                        "install util-linux")
    else:
        cmd = inner
    environment = dict(e.split("=", 1) for e in env)
    environment.setdefault("HOME", "/root")
    return subprocess.run(cmd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def run_imports(rootfs: Path, modules: Sequence[str], env: Sequence[str]) -> list[dict[str, object]]:
    """Import modules with the image's python3 in a chroot (private mount ns with /proc)."""
    script = rootfs / "tmp" / "kimi-k3-smoke.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(_IMPORT_SCRIPT)
    proc = run_in_chroot(rootfs, ["/usr/bin/python3", "/tmp/kimi-k3-smoke.py", *modules], env)
    results = []
    for line in proc.stdout.splitlines():
        parts = line.split("\t", 3)
        if len(parts) == 4 and parts[0] == _MARK:
            results.append({"module": parts[1], "ok": parts[2] == "1", "detail": parts[3]})
    if len(results) != len(modules):
        tail = proc.stderr.strip().splitlines()[-3:]
        raise UserError(f"chroot python3 in {rootfs} did not run (exit {proc.returncode}): {tail}; "
                        "does the image have /usr/bin/python3?")
    return results

