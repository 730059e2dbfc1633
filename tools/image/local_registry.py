"""The local registry //image:push uses when no --repository is given: Debian's docker-registry on
127.0.0.1 with storage under the cache root (registry/), started once and reused, stopped by
`python3 -m tools.image.push --stop-local-registry`; its start and stop hold registry.lock, and
pushes of one repository to it take turns (local_push_lock)."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tools.common.cache import cache_root
from tools.common.errors import UserError
from tools.common.files import write_bytes_atomic
from tools.image.registry_client import Repository


@dataclass(frozen=True)
class RegistryProcess:
    pid: int
    port: int
    root: Path

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def registry_ready(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return True
        except urllib.error.HTTPError:
            return True  # 401 from an auth-enabled registry still means it is serving
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def start_registry(root: Path, port: int | None = None, htpasswd: Path | None = None) -> RegistryProcess:
    """Start Debian's docker-registry serving `root`/data on 127.0.0.1 (config in `root`)."""
    exe = shutil.which("docker-registry")
    if exe is None:
        raise UserError("docker-registry: not on PATH; install it (apt-get install -y docker-registry)")
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    auth = (f"auth:\n  htpasswd:\n    realm: kimi-k3\n    path: {htpasswd}\n" if htpasswd else "")
    config = (f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
              f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}")
    (root / "config.yml").write_text(config)
    log = open(root / "registry.log", "ab")
    proc = subprocess.Popen([exe, "serve", str(root / "config.yml")], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    if not registry_ready(port, 10):
        proc.kill()
        raise UserError(f"docker-registry on 127.0.0.1:{port} did not start; see {root / 'registry.log'}")
    return RegistryProcess(proc.pid, port, root)


def stop_registry(reg: RegistryProcess) -> None:
    """Stop a registry this process started (and reap it, so no zombie is left)."""
    try:
        os.kill(reg.pid, signal.SIGTERM)
        os.waitpid(reg.pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie or a reused pid is not our registry
        return "docker-registry" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@contextmanager
def _registry_lock(root: Path) -> Iterator[None]:
    """Exclusive lock beside the storage: the check-start-record sequence of one push (or a stop)
    runs alone, so concurrent pushes share one registry instead of each starting their own on
    the same storage and rewriting its config."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "registry.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextmanager
def local_push_lock(root: Path, repo: Repository) -> Iterator[None]:
    """One push of `repo` at a time to the local registry whose storage is under `root`, for the
    whole probe, upload, attachments and tags. docker-registry 2.8's filesystem storage rewrites a
    repository's link files in place (truncate, then write): a push reading a manifest or tag back
    while another push of the same repository rewrote that link read a cut digest (HTTP 500
    "invalid checksum digest format"). A push that must wait says so, naming the holder's pid
    (written into the lock file). Lock files stay: deleting one would race a waiter."""
    path = root / "locks" / f"{repo.path.replace('/', '+')}.lock"  # '+' is in no repository path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            print(f"[oci_push] waiting for another push of {repo} (pid {holder})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def local_registry_root(repo: Repository) -> Path | None:
    """The local registry's root when --repository names it (its pushes take turns too), else None."""
    root = cache_root() / "registry"
    recorded = _recorded_registry(root)
    if recorded and repo.host in (f"127.0.0.1:{recorded[1]}", f"localhost:{recorded[1]}"):
        return root
    return None


def _recorded_registry(root: Path) -> tuple[int, int] | None:
    try:
        info = json.loads((root / "state.json").read_text())
        return int(info["pid"]), int(info["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def local_registry() -> RegistryProcess:
    """The user's cached local registry: reused when its recorded pid still serves, else started."""
    root = cache_root() / "registry"
    with _registry_lock(root):
        recorded = _recorded_registry(root)
        if recorded and _pid_alive(recorded[0]) and registry_ready(recorded[1], 1):
            return RegistryProcess(recorded[0], recorded[1], root)
        reg = start_registry(root)
        write_bytes_atomic(root / "state.json", json.dumps({"pid": reg.pid, "port": reg.port}).encode() + b"\n")
    print(f"started local registry {reg.host} (pid {reg.pid}, storage {root / 'data'}); it keeps running; "
          f"stop it with: python3 -m tools.image.push --stop-local-registry", file=sys.stderr)
    return reg


def stop_local_registry() -> int:
    root = cache_root() / "registry"
    if not (root / "state.json").is_file():
        print("no local registry recorded", file=sys.stderr)
        return 0
    with _registry_lock(root):
        recorded = _recorded_registry(root)
        if recorded and _pid_alive(recorded[0]):
            os.kill(recorded[0], signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _pid_alive(recorded[0]):
                if time.monotonic() > deadline:
                    raise UserError(f"local registry pid {recorded[0]} did not stop within 10 s of SIGTERM; "
                                    f"stop it with: kill -9 {recorded[0]}")
                time.sleep(0.05)
            print(f"stopped local registry pid {recorded[0]}", file=sys.stderr)
        (root / "state.json").unlink(missing_ok=True)
    return 0
