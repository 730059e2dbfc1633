"""The cluster's PID 1, inside its root (python3.13 of set rbe-cluster; standard library only).

    python3.13 -m tools.rbe.supervisor --state DIR --venv DIR --port P --workers N --instance NAME
                                       [--bots-remote URL]

Starts, in order, each only once the one before answers: PostgreSQL (initdb on first use, as
the root's `postgres` user; a Unix socket only), BuildGrid's schema (`bgd migrate apply`), the
buildbox-casd (the cluster's one blob store), the BuildGrid server (`bgd server start`), then the
buildbox-workers,
and waits until every worker has a bot session in the scheduler's database. Then it writes
`ready` to the status file and waits. On SIGTERM (`down`) it stops them in the reverse order.
If anything fails to start, or a process dies later, it writes `failed` with one line naming the
process and the last line of its log, stops the rest and exits 1; as PID 1 its exit ends every
process left in the namespace.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tools.rbe import config

START_TIMEOUT_S = 60.0


class StartError(Exception):
    """One line: what did not start and why."""


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.layout = config.Layout(Path(args.state))
        self.venv = Path(args.venv)
        self.port = args.port
        self.workers = args.workers
        self.instance = args.instance
        self.bots_remote = args.bots_remote or f"http://127.0.0.1:{args.port}"
        self.runner_binds = [tuple(b.split(":", 1)) for b in args.runner_bind]
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []  # in start order
        self.stopping = False
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}

    # --- processes ------------------------------------------------------------------------------

    def log(self, name: str) -> Path:
        return self.layout.logs / f"{name}.log"

    def last_line(self, name: str) -> str:
        try:
            lines = [l.strip() for l in self.log(name).read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return "no log"
        if not lines:
            return "its log is empty"
        line = lines[-1]
        # buildbox's lines: "<time> [<pid>:<tid>] [<file>] [ERROR] ... errMsg = \"<the reason>\"": the reason.
        if 'errMsg = "' in line:
            line = line.split('errMsg = "', 1)[1].rstrip('"')
        elif "] [" in line:
            line = line.rsplit("] ", 1)[1]
        return line[:300]

    def start(self, name: str, argv: list[str], user: str | None = None) -> subprocess.Popen[bytes]:
        if user:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv]
        out = open(self.log(name), "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.procs.append((name, proc))
        return proc

    def run(self, name: str, argv: list[str], user: str | None = None, timeout: float = START_TIMEOUT_S) -> str:
        if user:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv]
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)
        with open(self.log(name), "ab") as out:
            out.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            err = [l.strip() for l in proc.stderr.decode(errors="replace").splitlines() if l.strip()]
            raise StartError(f"{name} failed (exit {proc.returncode}): {err[-1][:300] if err else self.last_line(name)}")
        return proc.stdout.decode(errors="replace")

    def wait_for(self, what: str, name: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT_S) -> None:
        proc = dict(self.procs).get(name)
        deadline = time.monotonic() + timeout
        while True:
            if self.stopping:
                raise StartError("stopped while starting")
            if ready():
                self.timings[name] = round(time.monotonic() - self.t0, 2)
                return
            if proc is not None and proc.poll() is not None:
                raise StartError(f"{name} exited (code {proc.returncode}) before {what}: {self.last_line(name)}")
            if time.monotonic() > deadline:
                raise StartError(f"{name}: no {what} after {timeout:.0f} s: {self.last_line(name)}")
            time.sleep(0.1)

    # --- the pieces -------------------------------------------------------------------------------

    def psql(self, sql: str) -> str:
        return self.run("psql", ["psql", "-h", str(self.layout.pg_socket_dir), "-U", config.PG_USER, "-d",
                                 config.DATABASE, "-tAXc", sql]).strip()

    def postgres(self) -> None:
        pg = pwd.getpwnam(config.PG_USER)
        for d in (self.layout.pgdata, self.layout.pg_mount, self.layout.pg_socket_dir):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chown(d, pg.pw_uid, pg.pw_gid)
        # (This namespace's own mount, on its own tmpfs: gone with the namespace.)
        self.run("mount", ["mount", "--bind", str(self.layout.pgdata), str(self.layout.pg_mount)])
        data = self.layout.pg_mount
        if not (data / "PG_VERSION").exists():
            # Trust on the Unix socket alone: its directory is 0700 (postgres), no TCP listener.
            self.run("initdb", [f"{config.PG_BIN}/initdb", "-D", str(data), "-U", config.PG_USER, "--auth=trust",
                                "-E", "UTF8", "--no-sync", "--no-instructions"], user=config.PG_USER)
        self.start("postgres", config.postgres_argv(self.layout), user=config.PG_USER)
        sock = str(self.layout.pg_socket_dir)
        self.wait_for("a Unix socket that answers", "postgres", lambda: subprocess.run(
            ["pg_isready", "-q", "-h", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0)
        have = self.run("psql", ["psql", "-h", sock, "-U", config.PG_USER, "-d", "postgres", "-tAXc",
                                 f"SELECT 1 FROM pg_database WHERE datname = '{config.DATABASE}'"]).strip()
        if have != "1":
            self.run("createdb", ["createdb", "-h", sock, "-U", config.PG_USER, config.DATABASE])

    def casd(self) -> None:
        for old in self.layout.superseded:
            shutil.rmtree(old, ignore_errors=True)
        self.layout.cas.mkdir(exist_ok=True)
        self.start("casd", config.casd_argv(self.layout, self.instance))
        sock = self.layout.casd_socket
        self.wait_for(f"socket {sock}", "casd", sock.exists)

    def buildgrid(self) -> None:
        bgd = str(self.venv / "bin" / "bgd")
        self.run("migrate", [bgd, "migrate", "apply", config.database_url(self.layout)], timeout=120)
        self.timings["migrate"] = round(time.monotonic() - self.t0, 2)
        self.start("bgd", [bgd, "server", "start", str(self.layout.bgd_config)])

        def listening() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        self.wait_for(f"gRPC listener on 127.0.0.1:{self.port}", "bgd", listening)

    def workers_up(self) -> None:
        # Bot sessions made from now on are this start's (the database outlives a `down`).
        since = self.psql("SELECT (now() AT TIME ZONE 'utc')::text")
        for i in range(self.workers):
            self.start(f"worker-{i}", config.worker_argv(self.layout, i, self.bots_remote, self.instance,
                                                               self.runner_binds))

        def registered() -> bool:
            for name, proc in self.procs:
                if name.startswith("worker-") and proc.poll() is not None:
                    raise StartError(f"{name} exited (code {proc.returncode}) before registering with the Bots service "
                                     f"at {self.bots_remote}: {self.last_line(name)}")
            n = self.psql(f"SELECT count(DISTINCT bot_id) FROM bots WHERE instance_name = '{self.instance}' "
                          f"AND last_update_timestamp >= '{since}'")
            return n.isdigit() and int(n) >= self.workers
        self.wait_for(f"bot sessions of all {self.workers} workers at {self.bots_remote}", "workers", registered)

    # --- life -------------------------------------------------------------------------------------

    def status(self, state: str, **extra: object) -> None:
        tmp = self.layout.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"state": state, **extra}, sort_keys=True) + "\n")
        os.replace(tmp, self.layout.status_file)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def reap(self) -> None:
        """PID 1 adopts every orphan of the namespace (a runner's children): collect them all."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            for _, proc in self.procs:
                if proc.pid == pid and proc.returncode is None:
                    proc.returncode = -1  # reaped here; Popen would not see it again

    def stop(self) -> None:
        """Reverse start order: workers, BuildGrid, casd, then PostgreSQL (SIGINT: its fast
        shutdown, which ends its sessions and writes a checkpoint)."""
        for name, proc in reversed(self.procs):
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGINT if name == "postgres" else signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.on_signal)
        try:
            self.postgres()
            self.casd()
            self.buildgrid()
            self.workers_up()
        except (StartError, subprocess.TimeoutExpired, OSError) as e:
            self.status("failed", error=str(e))
            self.stop()
            return 1
        rss = {name: proc.pid for name, proc in self.procs}
        self.status("ready", seconds=round(time.monotonic() - self.t0, 2), timings=self.timings, pids=rss)
        exit_code = 0
        while not self.stopping:
            dead = [(n, p) for n, p in self.procs if p.poll() is not None]
            if dead:
                name, proc = dead[0]
                self.status("failed", error=f"{name} exited (code {proc.returncode}) while the cluster ran: "
                                            f"{self.last_line(name)}")
                exit_code = 1
                break
            self.reap()
            time.sleep(0.5)
        self.stop()
        if exit_code == 0:
            self.status("stopped")
        return exit_code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", required=True)
    ap.add_argument("--venv", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--bots-remote")
    ap.add_argument("--runner-bind", action="append", default=[], metavar="SOURCE:PATH",
                    help="read-only in every action (tools/rbe/exec_root.py)")
    return Supervisor(ap.parse_args(argv)).serve()


if __name__ == "__main__":
    sys.exit(main())
