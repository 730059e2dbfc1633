"""The cluster's root and BuildGrid's venv, each built once and reused offline.

The root is Debian set `rbe-cluster` of third_party/debian.lock.json (PostgreSQL 18, buildbox
1.4.30, bubblewrap, python3.13), installed by mmdebstrap from a local repository of exactly the
set's verified .debs, as tools/bazel builds Bazel's sealed root. A set of its own rather than more
packages in `bazel-root`: bumping PostgreSQL or buildbox re-provisions this small root instead of
Bazel's large one (and restarting every Bazel server), and a Bazel server does not need the
cluster's packages to talk to it on 127.0.0.1. Actions do not run over this root but over Bazel's
sealed root, as local actions do (tools/rbe/exec_root.py).

The venv: python3.13 of that root (BuildGrid 0.9.1 needs >= 3.13; sid's python3 is 3.14, for
which the locked wheels were not resolved) with `pip install --require-hashes --no-deps` of
rbe/requirements_lock.txt. Its path is named by the lock's and the root's keys, and it is built
in a temp sibling bound at that final path inside the root, so its scripts name the final path.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically
from tools.fetch import debian as debian_fetch
from tools.pins import debian
from tools.rbe.config import DEBIAN_SET

REPO_ROOT = Path(__file__).absolute().parents[2]
DEBIAN_LOCK = REPO_ROOT / "third_party" / "debian.lock.json"
PIP_LOCK = REPO_ROOT / "rbe" / "requirements_lock.txt"
ROOT_TOOL = "tools.rbe root"
VENV_TOOL = "tools.rbe venv"
COMPLETE = ".kimi-k3-complete"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Forwarded into the root for pip: the index and proxies the user set (never their config files:
# the host's pip config is for the 3.11 venv, its constraints and find-links would only clash).
PIP_FORWARD = ("PIP_INDEX_URL", "PIP_DEFAULT_TIMEOUT", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
               "no_proxy", "NO_PROXY")


def root_key(lock: Path = DEBIAN_LOCK) -> str:
    return debian.load_set(lock, DEBIAN_SET).content_key()[:16]


def root_dir(state: Path, lock: Path = DEBIAN_LOCK) -> Path:
    return state / "roots" / root_key(lock)


def venv_dir(state: Path, lock: Path = DEBIAN_LOCK, pip_lock: Path = PIP_LOCK) -> Path:
    h = hashlib.sha256(pip_lock.read_bytes() + root_key(lock).encode()).hexdigest()[:16]
    return state / "venvs" / f"buildgrid-{h}"


def _need(tool: str, fix: str) -> None:
    if shutil.which(tool) is None:
        raise UserError(f"{tool} not found: {fix}")


def ensure_root(state: Path, lock: Path = DEBIAN_LOCK) -> Path:
    """The root of set rbe-cluster, provisioned when missing."""
    root = root_dir(state, lock)
    if (root / COMPLETE).exists():
        return root
    if os.geteuid() != 0:
        raise UserError("the cluster needs root (mount and PID namespaces, pivot_root, bubblewrap): run it as root")
    _need("mmdebstrap", "install it with 'apt-get install mmdebstrap' and retry")
    deb_set = debian.load_set(lock, DEBIAN_SET)
    start = time.monotonic()
    print(f"rbe: provisioning the cluster root (Debian set {DEBIAN_SET}, {len(deb_set.packages)} packages) "
          f"into {root} (first run only)", file=sys.stderr, flush=True)
    scratch = Path(tempfile.mkdtemp(prefix=".repo-", dir=root.parent if root.parent.exists() else _mkdir(root.parent)))
    try:
        repo = debian_fetch.local_repository(deb_set, scratch / "repo", what=f"repository of set {DEBIAN_SET}")
        names = ",".join(p.name for p in deb_set.packages)
        with dir_replaced_atomically(root, "the cluster root", tool=ROOT_TOOL) as tmp:
            # variant=custom naming every package: the root holds exactly the set (checked below).
            proc = subprocess.run(
                ["mmdebstrap", "--variant=custom", f"--include={names}", "--aptopt=Acquire::Check-Valid-Until \"false\"",
                 "sid", str(tmp), f"deb [trusted=yes] copy://{repo} ./"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                tail = [l for l in proc.stdout.splitlines() if l.strip()][-1:] or ["no output"]
                raise UserError(f"mmdebstrap failed to build the cluster root from set {DEBIAN_SET} ({tail[0]}); "
                                f"re-resolve it with `{debian.resolve_command(DEBIAN_SET)}`")
            status = (tmp / "var/lib/dpkg/status").read_text(encoding="utf-8", errors="replace")
            debian.check_installed(deb_set, status, f"the cluster root {tmp}")
            (tmp / COMPLETE).touch()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"rbe: cluster root ready in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return root


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def host_ca_bundle() -> Path:
    """The CA bundle the host's pip trusts (a proxy's own CA is in it where there is one)."""
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        v = os.environ.get(var)
        if v and Path(v).is_file():
            return Path(v)
    return Path("/etc/ssl/certs/ca-certificates.crt")


def ensure_venv(state: Path, root: Path, lock: Path = DEBIAN_LOCK, pip_lock: Path = PIP_LOCK) -> Path:
    """BuildGrid's venv (python3.13 of the root, the hashed lock), built when missing."""
    venv = venv_dir(state, lock, pip_lock)
    if (venv / COMPLETE).exists():
        return venv
    start = time.monotonic()
    print(f"rbe: installing BuildGrid from {pip_lock.relative_to(REPO_ROOT)} into {venv} (first run only)",
          file=sys.stderr, flush=True)
    ca = host_ca_bundle()
    env = {"PATH": HOST_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PIP_CONFIG_FILE": os.devnull,
           "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.update({k: os.environ[k] for k in PIP_FORWARD if k in os.environ})
    with dir_replaced_atomically(venv, "the BuildGrid venv", tool=VENV_TOOL) as tmp:
        # In a private mount namespace (gone when it ends): the temp venv at its final path, the
        # lock, the host's CA bundle and resolver bound into the root; then chroot (pip needs no
        # namespaces of its own, so no pivot_root).
        script = f"""set -e
root={root}
mkdir -p "$root{venv}" "$root/run/rbe-lock"
mount --bind {tmp} "$root{venv}"
mount --bind {pip_lock.parent} "$root/run/rbe-lock"
mount --bind {ca} "$root/etc/ssl/certs/ca-certificates.crt"
if [ -e /etc/resolv.conf ]; then [ -e "$root/etc/resolv.conf" ] || : >"$root/etc/resolv.conf"
  mount --bind /etc/resolv.conf "$root/etc/resolv.conf"; fi
exec chroot "$root" sh -c 'python3.13 -m venv {venv} && {venv}/bin/pip install --quiet --no-cache-dir --require-hashes --no-deps --only-binary=:all: -r /run/rbe-lock/{pip_lock.name}'
"""
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = [l for l in proc.stdout.splitlines() if l.strip()][-1:] or ["no output"]
            raise UserError(f"pip could not install {pip_lock.relative_to(REPO_ROOT)} into the cluster venv ({tail[0]}); "
                            "check the network or PIP_INDEX_URL, or re-lock it (its header says how)")
        (tmp / COMPLETE).touch()
    print(f"rbe: BuildGrid venv ready in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return venv
