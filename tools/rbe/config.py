"""What the cluster runs, as data: the paths of one cluster, BuildGrid's server config, and the
command lines of PostgreSQL, buildbox-casd and buildbox-worker. Pure functions (no process, no
file written), so the tests check every generated line without starting anything.

The config is this project's own minimal one, written for one loopback cluster: one gRPC port
on 127.0.0.1 (no TLS, no auth: nothing but this host reaches it), instance `main` serving CAS,
ByteStream, the action cache, Execution and Bots; CAS in one buildbox-casd, the action cache in memory
(`!lru-action-cache`, lost at `down`: the CAS keeps the blobs, so a restarted cluster
reruns actions once and uploads nothing twice), and BuildGrid's one scheduler, `!sql-scheduler`,
which accepts only a `postgresql:` URL: PostgreSQL on a Unix socket (no second TCP port).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DEFAULT_PORT = 50051
DEFAULT_INSTANCE = "main"
# The Debian set the cluster's processes run in.
DEBIAN_SET = "rbe-cluster"
# The Debian set every remote action runs over: Bazel's sealed root, as a local action does
# (tools/rbe/exec_root.py). It is the value of the platform property `worker-root` the workers
# offer and //rbe:platform asks for, so an action for another root is refused by the scheduler at
# once instead of waiting forever.
EXEC_ROOT_SET = "bazel-root"
PLATFORM = {"OSFamily": "linux", "worker-root": EXEC_ROOT_SET}
PG_BIN = "/usr/lib/postgresql/18/bin"
PG_USER = "postgres"  # created in the root by postgresql-common's maintainer script
DATABASE = "bgd"
MAX_WORKERS = 64
# BuildGrid's gRPC threads: above .bazelrc's build:rbe --jobs (one Execute stream each) plus the
# bots' sessions. The RPCs it accepts at once: past the threads they wait, and none is refused. A
# refusal (RESOURCE_EXHAUSTED) fails Bazel's upload or ends a worker's bot session, and Bazel
# opens up to about 100 streams per connection: 1,024 were refused in the main job's first
# minute.
THREAD_POOL_SIZE = 256
MAXIMUM_CONCURRENT_RPCS = 65536
# REAPI (remote_execution.proto): these words may not be a segment of an instance name.
RESERVED_SEGMENTS = {"blobs", "uploads", "actions", "actionResults", "operations", "capabilities",
                     "compressed-blobs"}
INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


def check_instance(name: str) -> str | None:
    """None for a usable instance name, else why not (one phrase)."""
    if not INSTANCE_RE.fullmatch(name):
        return "expected path segments of letters, digits, '_', '.', '-' separated by '/'"
    bad = sorted(set(name.split("/")) & RESERVED_SEGMENTS)
    if bad:
        return f"'{bad[0]}' is a reserved word of the REAPI and may not be a segment"
    return None


@dataclass(frozen=True)
class Layout:
    """Every path of one cluster under its state directory (`<cache root>/rbe/`): `data/` outlives
    a `down` (PostgreSQL's cluster, casd's blob store); `run/` is one `up`'s
    (configs, sockets, logs, the state file), written anew at each `up`."""
    state: Path

    @property
    def data(self) -> Path:
        return self.state / "data"

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def pgdata(self) -> Path:
        return self.data / "pg"

    @property
    def cas(self) -> Path:
        """The one blob store: the shared buildbox-casd's local cache."""
        return self.data / "casd"

    @property
    def superseded(self) -> list[Path]:
        """What earlier layouts of this directory held and nothing reads now: BuildGrid's disk CAS
        and a casd cache per worker. `up` removes them (this tool wrote them; tens of GB)."""
        return [self.data / "cas", *sorted(p for p in self.data.glob("casd-*") if re.fullmatch(r"casd-\d+", p.name))]

    # Inside the cluster's namespace, on its own tmpfs /run: the postgres user cannot pass
    # through the state directory's parents (a home directory such as /root is 0700), so the
    # supervisor binds data/pg here and PostgreSQL's socket lives here too.
    pg_socket_dir = Path("/run/postgresql")
    pg_mount = Path("/run/pgdata")

    @property
    def casd_socket(self) -> Path:
        return self.run / "casd.sock"

    @property
    def bgd_config(self) -> Path:
        return self.run / "bgd.yml"

    @property
    def logs(self) -> Path:
        return self.run / "logs"

    @property
    def state_file(self) -> Path:
        return self.run / "cluster.json"

    @property
    def status_file(self) -> Path:
        """Written by the supervisor inside the root: ready, or failed with one line."""
        return self.run / "status.json"


def database_url(layout: Layout) -> str:
    # psycopg 3 through SQLAlchemy; an empty host plus host=DIR is libpq's Unix-socket form.
    return f"postgresql+psycopg://{PG_USER}@/{DATABASE}?host={layout.pg_socket_dir}"


def _q(value: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is a subset of it)."""
    return json.dumps(value)


def bgd_config(layout: Layout, port: int, instance: str) -> str:
    """BuildGrid's server config (YAML with BuildGrid's own tags)."""
    props = ", ".join(f"[{_q(k)}, {_q(v)}]" for k, v in sorted(PLATFORM.items()))
    return f"""\
# Generated by `python3 -m tools.rbe up` at each start; edits are lost.
description: "kimi-k3 loopback REAPI cluster"
# BuildGrid's default is 5 threads a core, and as many concurrent RPCs: on 2 cores, 10. Bazel
# uploads a tree input (the patched SGLang tree: thousands of files) with many RPCs at once, holds one Execute
# stream per running action (up to --jobs), and each worker's casd fetches inputs in parallel;
# past 10 BuildGrid answered "Concurrent RPC limit exceeded" and the build failed. Threads that
# outnumber the streams Bazel can hold keep the bots' sessions served; RPCs past them wait.
thread-pool-size: {THREAD_POOL_SIZE}
maximum-concurrent-rpcs: {MAXIMUM_CONCURRENT_RPCS}
server:
  - !channel
    address: {_q(f"127.0.0.1:{port}")}
    insecure-mode: true
connections:
  - !sql-connection &sql
    connection-string: {_q(database_url(layout))}
    pool-size: 5
    max-overflow: 10
storages:
  # The shared buildbox-casd (casd_argv) is the only store: each blob is kept once, not once
  # here and again per worker, and the workers' FUSE staging reads it in place.
  - !remote-storage &cas
    url: {_q(f"unix:{layout.casd_socket}")}
    instance-name: {_q(instance)}
caches:
  - !lru-action-cache &ac
    storage: *cas
    max-cached-refs: 100000
    allow-updates: true
    # A failed action is rerun, not served again from the cache.
    cache-failed-actions: false
schedulers:
  - !sql-scheduler &scheduler
    sql: *sql
    storage: *cas
    action-cache: *ac
    # Loopback, a few workers: look for work, bots and finished operations every 0.1 s instead of
    # BuildGrid's 1 s (which sets the floor of every remote action's round trip); each look is one
    # small query on the local PostgreSQL.
    poll-interval: 0.1
    bot-poll-interval: 0.1
    assigners:
      - !priority-age-assigner
        interval: 0.1
    # One fixed property set: an action whose platform is not a subset of it (another worker
    # root, another OS) is refused with FAILED_PRECONDITION at once, and a worker that offers
    # less is refused at registration.
    property-set: !static-property-set
      property-labels:
        - label: {_q(EXEC_ROOT_SET)}
          properties: [{props}]
instances:
  - name: {_q(instance)}
    services:
      - !action-cache
        cache: *ac
      - !execution
        scheduler: *scheduler
      - !cas
        storage: *cas
      - !bytestream
        storage: *cas
"""


def postgres_argv(layout: Layout) -> list[str]:
    # No TCP listener: BuildGrid reaches it on a Unix socket in the run directory. The scheduler's
    # state is rebuilt by the next `up`, so commits need not wait for the disk.
    return [f"{PG_BIN}/postgres", "-D", str(layout.pg_mount), "-c", "listen_addresses=",
            "-c", f"unix_socket_directories={layout.pg_socket_dir}", "-c", "synchronous_commit=off",
            "-c", "max_connections=100", "-c", "shared_buffers=32MB"]


# The cluster's one blob store, the ceiling before casd evicts least recently used blobs. casd
# also lowers it to the disk's free space less --reserved (2G), so on a full disk it evicts.
CASD_QUOTA = "64G"


def casd_argv(layout: Layout, instance: str) -> list[str]:
    """One buildbox-casd for the whole cluster, a CAS server of its own (no remote): BuildGrid's
    storage (`!remote-storage` on its socket) and every worker's local CAS. With a casd per worker
    proxying BuildGrid's disk CAS, every input root lay on the disk twice (the SGLang JIT
    action's is GBs; docs/measurements): the worker's casd, lowering its quota to the free space,
    evicted blobs of the tree it was staging, and the action failed ("Could not read blob" of the
    input root's Directory). Not --protect-session-blobs: a long-lived casd then cannot evict at all, and once
    the disk was short it refused every later staging (OutOfSpaceException)."""
    return ["/usr/bin/buildbox-casd", f"--local-server-instance={instance}", f"--bind=unix:{layout.casd_socket}",
            f"--quota-high={CASD_QUOTA}", "--log-level=warning", str(layout.cas)]


def worker_argv(layout: Layout, i: int, bots_remote: str, instance: str,
                runner_binds: Sequence[tuple[str, str]]) -> list[str]:
    """runner_binds: (source, path in the action), read-only; bubblewrap gives an action only
    these, its input tree, loopback and no capabilities (tools/rbe/exec_root.py says which)."""
    argv = ["/usr/bin/buildbox-worker", f"--bots-remote={bots_remote}", f"--cas-remote=unix:{layout.casd_socket}",
            f"--instance={instance}", "--buildbox-run=/usr/bin/buildbox-run-bubblewrap",
            # A worker that loses the server gives up after a few tries instead of retrying forever:
            # `up` sees it exit and names it.
            "--bots-retry-limit=3", "--bots-retry-delay=500", "--log-level=warning",
            # Stage inputs through buildbox-fuse (casd serves the tree from its own objects), not
            # copy-or-link: Bazel marks every input executable and casd keeps its objects
            # read-only, so that stager copies every file, and an input root of GBs (the SGLang
            # JIT action) lay on the disk twice while it ran. FUSE aborted actions ("No CAS server
            # configured") only while a worker's casd could lack a blob; the one casd has them all.
            "--runner-arg=--staging-mode=fuse"]
    argv += [f"--runner-arg=--ro-bind-mount={source}:{path}" for source, path in runner_binds]
    argv += [f"--platform={k}={v}" for k, v in sorted(PLATFORM.items())]
    return argv + [f"rbe-worker-{i}"]


def bazel_platform_properties() -> dict[str, str]:
    """What //rbe:platform's exec_properties must equal (tests/cpu/rbe compares the BUILD file)."""
    return dict(PLATFORM)
