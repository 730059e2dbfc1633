"""`up`, `down` and `status` of the loopback cluster, on the host (Python 3.11).

One cluster per cache root, in `<cache root>/rbe/cluster/` (config.Layout). `up` checks its input
before it starts anything (the instance name, the worker count, the port free on 127.0.0.1, no
cluster already up), provisions the root and the venv when missing, writes the run directory
(BuildGrid's config), then starts the supervisor in new mount and PID namespaces pivoted into
the root (tools.rbe.enter) and waits for its status: `ready`, or `failed` with one line, in which
case everything it started is already gone. `down` sends the supervisor SIGTERM and waits for
the namespace to end; the kernel then ends whatever was left in it, and its mounts go with it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.common import cache as cache_env
from tools.common.errors import UserError
from tools.common.files import dir_replaced_atomically, write_text_atomic
from tools.rbe import config, exec_root, root as rootfs

RUN_TOOL = "tools.rbe up"
REPO_ROOT = Path(__file__).absolute().parents[2]
UP_TIMEOUT_S = 180.0
DOWN_TIMEOUT_S = 60.0


def state_dir() -> Path:
    return cache_env.cache_root() / "rbe"


def layout() -> config.Layout:
    return config.Layout(state_dir() / "cluster")


@dataclass
class Running:
    pid: int  # the unshare process on the host: the namespace lives as long as it does
    port: int
    instance: str
    workers: int


def _alive(pid: int, name: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(name.encode() in part for part in cmdline) and _state(pid) not in ("Z", "")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def running(lay: config.Layout) -> Running | None:
    """The cluster this cache root's state file names, if its namespace still runs."""
    try:
        data = json.loads(lay.state_file.read_text())
        r = Running(int(data["pid"]), int(data["port"]), str(data["instance"]), int(data["workers"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return r if _alive(r.pid, "tools.rbe.enter") else None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As gRPC binds: a listener refuses it, a connection of the last run in TIME_WAIT does not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_input(workers: int, port: int, instance: str) -> None:
    """Bad input, one line each, before anything is written or started."""
    why = config.check_instance(instance)
    if why:
        raise UserError(f"--instance {instance!r}: {why}")
    if not 1 <= workers <= config.MAX_WORKERS:
        raise UserError(f"--workers {workers}: expected 1 to {config.MAX_WORKERS}")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: expected 1 to 65535")


def up(workers: int, port: int = config.DEFAULT_PORT, instance: str = config.DEFAULT_INSTANCE,
       bots_remote: str | None = None) -> dict[str, object]:
    check_input(workers, port, instance)
    lay = layout()
    r = running(lay)
    if r:
        raise UserError(f"a cluster is already up (127.0.0.1:{r.port}, {r.workers} workers, pid {r.pid}): "
                        "stop it with `python3 -m tools.rbe down` first")
    if not port_free(port):
        raise UserError(f"--port {port}: 127.0.0.1:{port} is in use by another process; pass a free --port "
                        "(and the same in build:rbe --remote_executor) or stop what listens there")
    if os.geteuid() != 0:
        raise UserError("the cluster needs root (mount and PID namespaces, pivot_root, bubblewrap): run it as root")
    t0 = time.monotonic()
    actions = exec_root.find()
    root = rootfs.ensure_root(state_dir())
    venv = rootfs.ensure_venv(state_dir(), root)
    lay.data.mkdir(parents=True, exist_ok=True)
    lay.cas.mkdir(exist_ok=True)
    with dir_replaced_atomically(lay.run, "the cluster's run directory", tool=RUN_TOOL) as tmp:
        (tmp / "logs").mkdir()
        (tmp / lay.bgd_config.name).write_text(config.bgd_config(lay, port, instance))
    if not port_free(port):  # taken while the root was provisioned
        raise UserError(f"--port {port}: 127.0.0.1:{port} is in use by another process; pass a free --port")
    t_start = time.monotonic()
    argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", "--",
            sys.executable, "-m", "tools.rbe.enter", str(root), str(REPO_ROOT), str(lay.state), str(venv),
            *actions.host_paths(), "--",
            "--state", str(lay.state), "--venv", str(venv), "--port", str(port), "--workers", str(workers),
            "--instance", instance, *(f"--runner-bind={source}:{path}" for source, path in actions.runner_binds())]
    if bots_remote:
        argv += ["--bots-remote", bots_remote]
    env = {"PATH": rootfs.HOST_PATH, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    with open(lay.logs / "supervisor.log", "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    write_text_atomic(lay.state_file, json.dumps({"pid": proc.pid, "port": port, "instance": instance,
                                                  "workers": workers}, sort_keys=True) + "\n")
    try:
        status = _wait_ready(lay, proc)
    except BaseException:
        _stop(proc.pid, lay)
        raise
    if status.get("state") != "ready":
        _stop(proc.pid, lay)
        error = status.get("error") or f"the cluster's supervisor exited (code {proc.returncode}): " + _last_line(
            lay.logs / "supervisor.log")
        raise UserError(f"the cluster did not start: {error} (logs: {lay.logs})")
    status["start_s"] = round(time.monotonic() - t_start, 2)
    status["total_s"] = round(time.monotonic() - t0, 2)
    return status


def last_status(lay: config.Layout) -> dict[str, object]:
    """The supervisor's last status ({} when none): `failed` names what ended the cluster."""
    try:
        data = json.loads(lay.status_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _last_line(path: Path) -> str:
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def _wait_ready(lay: config.Layout, proc: subprocess.Popen[bytes]) -> dict[str, object]:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            status = json.loads(lay.status_file.read_text())
        except (OSError, ValueError):
            status = None
        if status and status.get("state") in ("ready", "failed"):
            return status
        if proc.poll() is not None:
            return {"state": "exited"}
        time.sleep(0.1)
    return {"state": "timeout", "error": f"not ready after {UP_TIMEOUT_S:.0f} s"}


def _supervisor_pid(pid: int) -> int | None:
    """The namespace's PID 1 as the host sees it: the one child of unshare."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


def _stop(pid: int, lay: config.Layout) -> bool:
    """SIGTERM to the supervisor (it stops the cluster in order), SIGKILL to the namespace after
    DOWN_TIMEOUT_S (--kill-child: unshare's death kills PID 1, and with it every process left)."""
    sup = _supervisor_pid(pid)
    if sup:
        os.kill(sup, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while time.monotonic() < deadline and _state(pid) not in ("", "Z"):
        time.sleep(0.1)
    clean = _state(pid) in ("", "Z")
    if not clean:
        os.kill(pid, signal.SIGKILL)
        while _state(pid) not in ("", "Z"):
            time.sleep(0.1)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    try:
        lay.state_file.unlink()
    except FileNotFoundError:
        pass
    return clean


def down() -> str:
    lay = layout()
    r = running(lay)
    if r is None:
        return "no cluster is up"
    clean = _stop(r.pid, lay)
    if listening(r.port):
        raise UserError(f"the cluster stopped but 127.0.0.1:{r.port} still answers: another process listens there")
    return f"cluster stopped (127.0.0.1:{r.port})" + ("" if clean else f"; it did not stop within {DOWN_TIMEOUT_S:.0f} s and was killed")


def processes(pid: int) -> list[tuple[int, str, int, int]]:
    """(pid, name, RSS, PSS in kB) of every process below `pid`, the host's view. PSS shares each
    shared page among its users: PostgreSQL's shared buffers count once in the sum, not per backend."""
    out = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields.get("VmRSS", "0 kB").split()[0])
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            pss = int(next(l.split()[1] for l in rollup.splitlines() if l.startswith("Pss:")))
        except (OSError, StopIteration, ValueError):
            pss = rss
        out.append((p, fields.get("Name", "?").strip(), rss, pss))
        todo.extend(int(k) for k in kids)
    return out
