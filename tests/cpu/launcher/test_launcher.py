"""CPU tests of the launcher tools/bazel (tag cpu).

tools/bazel runs against a stand-in sealed root (StandInRoot): every command it runs is an
argv-logging shim on PATH, the root holds only /bin/sh, an argv-logging env and a /usr/bin/bazel
that records what it was given. Provisioning runs with a stand-in mmdebstrap (and apt-get) over a
tiny Debian set of generated .debs. Stand-in interpreters answer the launcher's probe as Python 2.7,
3.9 or a broken script would. One test runs the real Bazel of the real sealed root on a tiny
workspace (test_a_real_bazel_run_writes_no_credential; its own target, see BUILD.bazel).

Needs root (mount namespaces, pivot_root). Under Bazel the tests run inside the sealed root (its
own mount namespace, pivoted into it), and the launcher runs there with that root's tools.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import http.server
import io
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from tools.common import credentials

REPO_ROOT = Path(__file__).resolve().parents[3]

LAUNCHER = REPO_ROOT / "tools" / "bazel"
LAUNCHER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sealed_root_key(ws: Path = REPO_ROOT) -> str:
    """The launcher's sealed-root key, computed by the launcher's own lines (debian_tool=... to
    key=...: from Debian set bazel-root's entries) with this interpreter and checkout `ws`."""
    m = re.search(r"^debian_tool=.*?^key=[^\n]*$", LAUNCHER.read_text(), re.S | re.M)
    assert m, "tools/bazel: debian_tool=... / key=... lines not found"
    script = f"set -e\nws={shlex.quote(str(ws))}\npy={shlex.quote(sys.executable)}\n{m.group(0)}\necho \"$key\""
    return subprocess.run(["bash", "-c", script], check=True, text=True, stdout=subprocess.PIPE).stdout.strip()


def test_sealed_root_key_follows_the_bazel_root_set_entries(tmp_path: Path) -> None:
    """A bumped bazel-root set is a new root directory; words in its description are not."""
    ws = tmp_path / "ws"
    (ws / "third_party").mkdir(parents=True)
    (ws / "tools").symlink_to(REPO_ROOT / "tools")
    lock = json.loads((REPO_ROOT / "third_party" / "debian.lock.json").read_text())
    root_set = lock["sets"]["bazel-root"]

    def key_with(edit) -> str:
        data = json.loads(json.dumps(lock))
        edit(data["sets"]["bazel-root"])
        (ws / "third_party" / "debian.lock.json").write_text(json.dumps(data))
        return sealed_root_key(ws)

    key = sealed_root_key()
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert key_with(lambda s: s.update(description="other words")) == key
    bazel = next(i for i, p in enumerate(root_set["packages"]) if p["name"] == "bazel-bootstrap")
    assert key_with(lambda s: s["packages"][bazel].update(version="7.7.1+ds-9")) != key
    assert key_with(lambda s: s["packages"][0].update(sha256="0" * 64)) != key


def copy_with_libs(exe: str, root: Path, dest: str) -> None:
    """exe (and the shared libraries ldd names) into root, so it runs there as its root."""
    (root / dest.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(exe), root / dest.lstrip("/"))
    ldd = subprocess.run(["ldd", exe], check=True, text=True, stdout=subprocess.PIPE).stdout
    for lib in re.findall(r"(/\S+) \(0x", ldd):
        target = root / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), target)


def kill_holders(roots: Path, key: str) -> None:
    """End the launcher's namespace holders of roots/key (the outer and the sealed one)."""
    for name in (f"{key}.mntns.pid", f"{key}.sealed.pid"):
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((roots / name).read_text()), signal.SIGKILL)


class StandInRoot:
    """A stand-in sealed root under base that tools/bazel (`info release`) runs against.

    Every command the launcher runs is found on PATH; each is a shim here that appends its argv
    (what /proc/PID/cmdline shows for that process) to a log, then execs the real command. The
    sealed root is a stand-in: /bin/sh, an argv-logging /usr/bin/env and a /usr/bin/bazel that
    records its arguments and environment. python: the interpreter the launcher uses
    (KIMI_K3_PYTHON); by default a stand-in that prints a tmp dir as its prefix. The launcher's
    namespace holder lives on between run() calls (as it does for real) until close().
    """

    def __init__(self, base: Path, python: str | None = None, ws: Path = REPO_ROOT, provisioned: bool = True) -> None:
        """ws: the checkout whose tools/bazel runs. provisioned=False: the stand-in tree is built
        at `template` instead, for a stand-in mmdebstrap to copy when the launcher provisions."""
        self.base, self.launcher = base, ws / "tools" / "bazel"
        self.cache, self.out_root, self.roots = base / "cache", base / "out", base / "roots"
        self.root = self.roots / sealed_root_key(ws)
        self.template = base / "template"
        self.log = self.cache / "argv.log"
        self.bazel_env, self.bazel_args = self.cache / "bazel.env", self.cache / "bazel.args"
        self.credentials_seen = base / "out" / "credentials.seen"
        self.fake_py = base / "py" / "bin" / "python3.11"
        # The launcher's two namespace holders: the outer namespace (where it binds host paths under
        # the root) and the sealed one (pivoted into the root, where Bazel runs).
        self.holder_pid_file = self.roots / f"{self.root.name}.mntns.pid"
        self.sealed_pid_file = self.roots / f"{self.root.name}.sealed.pid"
        self.proc: subprocess.CompletedProcess | None = None
        self.cache.mkdir(parents=True)
        root, log = (self.root if provisioned else self.template), self.log
        for d in ("etc/ssl/certs", "proc", "sys", "dev"):
            (root / d).mkdir(parents=True)
        if provisioned:
            (root / ".kimi-k3-complete").touch()
        copy_with_libs("/bin/sh", root, "/bin/sh")
        copy_with_libs(shutil.which("env") or "/usr/bin/env", root, "/usr/bin/env.real")
        (root / "usr/bin/env").write_text(f"#!/bin/sh\nprintf '%s ' \"$0\" \"$@\" >>{log}; echo >>{log}\n"
                                          'exec /usr/bin/env.real "$@"\n')
        copy_with_libs(shutil.which("stat") or "/usr/bin/stat", root, "/usr/bin/stat")
        # The credentials file exists only while the command runs: the stand-in records what it saw.
        (root / "usr/bin/bazel").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$PWD\" \"$@\" >{self.bazel_args}\n"
                                            f"/usr/bin/env.real -0 >{self.bazel_env}\n"
                                            'f=$KIMI_K3_CREDENTIALS_FILE; if [ -n "$f" ]; then '
                                            f'/usr/bin/stat -c "%a %n" "$f" "${{f%/*}}" >{self.credentials_seen}; '
                                            f'while IFS= read -r l || [ -n "$l" ]; do echo "$l"; done <"$f" >>{self.credentials_seen}; fi\n')
        for f in ("usr/bin/env", "usr/bin/bazel"):
            (root / f).chmod(0o755)
        if python is None:
            # The interpreter's prefix is bind-mounted into the root: a stand-in whose prefix is a tmp dir.
            self.fake_py.parent.mkdir(parents=True)
            # The interpreter probe hears Python 3.11 with that prefix; the query of pip's
            # configuration hears none (nothing of this machine's is bound); the rest (the
            # launcher's modules, e.g. the sealed root's key from the Debian lock) runs for real.
            self.fake_py.write_text(f"#!/bin/sh\ncase \"$2\" in\n  *version_info*) printf '3.11\\n%s\\n%s\\n' \"$0\" "
                                    f"{shlex.quote(str(base / 'py'))}; exit 0;;\n"
                                    f"  *'\"config\", \"debug\"'*) exit 0;;\nesac\n"
                                    f"exec {shlex.quote(sys.executable)} \"$@\"\n")
            self.fake_py.chmod(0o755)
            python = str(self.fake_py)
        self.python = python
        self.shims = base / "shims"
        self.shims.mkdir()
        for d in LAUNCHER_PATH.split(":"):
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                real = os.path.join(d, name)
                # sleep: the namespace holder runs `exec -a NAME sleep`, and a shim would lose NAME.
                if name == "sleep" or (self.shims / name).exists() or not os.access(real, os.X_OK) \
                        or os.path.isdir(real):
                    continue
                (self.shims / name).write_text(f"#!/bin/sh\nprintf '%s ' \"$0\" \"$@\" >>{log}; echo >>{log}\n"
                                               f'exec {real} "$@"\n')
                (self.shims / name).chmod(0o755)

    def command(self, env: dict[str, str | None]) -> tuple[list[str], dict[str, str]]:
        """The launcher's command line and environment (a None value unsets that variable)."""
        full = {"PATH": f"{self.shims}:{LAUNCHER_PATH}", "HOME": str(self.base / "home"),
                "KIMI_K3_FORCE_SEALED_ROOT": "1", "KIMI_K3_SEALED_ROOT_DIR": str(self.roots),
                "KIMI_K3_CACHE": str(self.cache), "KIMI_K3_BAZEL_OUTPUT_ROOT": str(self.out_root),
                "KIMI_K3_PYTHON": self.python, **env}
        command = [str(self.launcher), "info", "release"]
        return command, {k: v for k, v in full.items() if v is not None}

    def run(self, env: dict[str, str | None], check: bool = True) -> subprocess.CompletedProcess:
        command, full = self.command(env)
        proc = subprocess.run(command, cwd=self.cache, env=full, timeout=120,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.returncode == 0 or not check, proc.stderr
        return proc

    def start(self, env: dict[str, str | None], stderr: Path) -> subprocess.Popen:
        """The launcher started in the background (its PID is the launcher's), its stderr going to a file the test can read while it runs."""
        command, full = self.command(env)
        with open(stderr, "w") as err:
            return subprocess.Popen(command, cwd=self.cache, env=full, stdout=subprocess.DEVNULL, stderr=err, text=True)

    @property
    def lock_file(self) -> Path:
        return self.roots / f"{self.root.name}.lock"

    def close(self) -> None:
        kill_holders(self.roots, self.root.name)

    def binds(self) -> set[str]:
        """The host paths the launcher bound at their own path (from the logged `mount --rbind`s)."""
        got = set()
        for line in self.log.read_text().splitlines():
            words = line.split()
            if len(words) >= 4 and words[0].endswith("/mount") and words[1] == "--rbind" \
                    and words[3] == f"{self.root}{words[2]}" and words[2] not in ("/sys", "/dev"):
                got.add(words[2])
        return got

    def seen_inside(self, path: Path, bound_itself: bool = True) -> str | None:
        """path's text as the sealed root sees it now (through the holder's mount namespace), None
        when nothing is bound there (bound_itself=False: when it is not there, under a bound
        directory)."""
        # In the outer namespace, where the launcher binds (the sealed one receives each bind; the
        # stand-in root has no cat or mountpoint to look with).
        pid = self.holder_pid_file.read_text().strip()
        proc = subprocess.run([shutil.which("nsenter") or "/usr/bin/nsenter", "--mount", "--target", pid,
                               "sh", "-c", ('mountpoint -q "$0" && ' if bound_itself else "") + 'cat "$0"',
                               f"{self.root}{path}"],
                              stdout=subprocess.PIPE, text=True, timeout=30)
        return proc.stdout if proc.returncode == 0 else None


def run_launcher_in_stand_in_root(base: Path, env: dict[str, str], python: str | None = None) -> StandInRoot:
    """One launcher run against a fresh stand-in root (its holder gone afterwards)."""
    stand_in = StandInRoot(base, python)
    try:
        stand_in.proc = stand_in.run(env)
    finally:
        stand_in.close()
    return stand_in


FAKE_MMDEBSTRAP = r"""
import json, os, re, shutil, subprocess, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_MMDEBSTRAP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
suite, target, mirror = [a for a in args if not a.startswith("--")]
repo = re.fullmatch(r"deb \[trusted=yes\] copy://(/\S+) \./", mirror).group(1)
include = next(a for a in args if a.startswith("--include=")).split("=", 1)[1].split(",")
shutil.copytree(os.environ["FAKE_MMDEBSTRAP_TEMPLATE"], target, symlinks=True)
if os.environ.get("FAKE_MMDEBSTRAP_PIDS"):
    # A long installation: a child standing in for apt/dpkg, both PIDs recorded, then a wait for
    # FAKE_MMDEBSTRAP_RELEASE to appear (or for a signal).
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["FAKE_MMDEBSTRAP_PIDS"] + ".part", "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    os.rename(os.environ["FAKE_MMDEBSTRAP_PIDS"] + ".part", os.environ["FAKE_MMDEBSTRAP_PIDS"])
    while not os.path.exists(os.environ.get("FAKE_MMDEBSTRAP_RELEASE", "/nonexistent")):
        time.sleep(0.1)
    child.kill()
status = []
for stanza in open(os.path.join(repo, "Packages")).read().split("\n\n"):
    f = dict(l.split(": ", 1) for l in stanza.splitlines() if ": " in l and not l.startswith(" "))
    if f.get("Package") in include and f["Package"] != os.environ.get("FAKE_MMDEBSTRAP_DROP"):
        status.append(f"Package: {f['Package']}\nStatus: install ok installed\nVersion: {f['Version']}\n")
os.makedirs(os.path.join(target, "var/lib/dpkg"), exist_ok=True)
open(os.path.join(target, "var/lib/dpkg/status"), "w").write("\n".join(status))
"""


def provisioning_checkout(base: Path) -> tuple[Path, Path]:
    """A checkout (this one's tools/, its .bazelversion) whose Debian lock holds a tiny bazel-root
    set of two generated .debs, served from a mirror directory only (the origin is unreachable)."""
    ws, mirror = base / "ws", base / "mirror"
    (ws / "third_party").mkdir(parents=True)
    mirror.mkdir()
    (ws / "tools").symlink_to(REPO_ROOT / "tools")
    shutil.copy(REPO_ROOT / ".bazelversion", ws / ".bazelversion")
    entries = []
    for name in ("bazel-bootstrap", "git"):
        build = base / f"{name}-deb"
        (build / "DEBIAN").mkdir(parents=True)
        (build / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: 1.0\nArchitecture: amd64\n"
                                                  f"Maintainer: T <t@example.org>\nDescription: {name}\n")
        deb = mirror / f"{name}_1.0_amd64.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(build), str(deb)], check=True,
                       capture_output=True)
        data = deb.read_bytes()
        entries.append({"name": name, "version": "1.0", "architecture": "amd64", "size": len(data),
                        "filename": f"pool/main/x/{name}/{deb.name}", "sha256": hashlib.sha256(data).hexdigest(),
                        "urls": [f"http://127.0.0.1:9/pool/main/x/{name}/{deb.name}"]})
    (ws / "third_party" / "debian.lock.json").write_text(json.dumps({"schema_version": 1, "sets": {"bazel-root": {
        "description": "", "archive": "http://deb.debian.org/debian", "suites": ["sid"], "architecture": "amd64",
        "roots": ["bazel-bootstrap", "git"], "exclude": {}, "packages": entries}}}))
    return ws, mirror


def provisioning_stand_in(base: Path) -> tuple[StandInRoot, dict[str, str]]:
    ws, mirror = provisioning_checkout(base)
    stand_in = StandInRoot(base / "root", ws=ws, provisioned=False)
    (stand_in.template / "usr/share/bazel").mkdir(parents=True)
    (stand_in.template / "usr/share/bazel/build-label.txt").write_text((ws / ".bazelversion").read_text().strip())
    fake = stand_in.shims / "mmdebstrap"
    fake.write_text(f"#!{sys.executable}\n{FAKE_MMDEBSTRAP}")
    fake.chmod(0o755)
    env = {"KIMI_K3_MIRROR": str(mirror), "FAKE_MMDEBSTRAP_LOG": str(base / "mmdebstrap.log"),
           "FAKE_MMDEBSTRAP_TEMPLATE": str(stand_in.template)}
    return stand_in, env


def test_bazel_launcher_provisions_the_sealed_root_from_the_locked_debs(tmp_path: Path) -> None:
    """The sealed root is mmdebstrap of exactly Debian set bazel-root: its only mirror a local
    repository of the verified .debs (here from a mirror directory, the origin unreachable), every
    package named, the root's directory named by the set's entries; built once, then reused."""
    stand_in, env = provisioning_stand_in(tmp_path)
    try:
        stand_in.run(env)
        stand_in.run(env)
    finally:
        stand_in.close()
    (args,) = [json.loads(line) for line in (tmp_path / "mmdebstrap.log").read_text().splitlines()]
    assert "--variant=custom" in args and "--include=bazel-bootstrap,git" in args
    mirrors = [a for a in args if a.startswith("deb ")]
    assert len(mirrors) == 1 and re.fullmatch(rf"deb \[trusted=yes\] copy://{re.escape(str(stand_in.root))}"
                                              r"\.repo\.[0-9]+ \./", mirrors[0]), mirrors
    assert (stand_in.root / ".kimi-k3-complete").is_file() and stand_in.bazel_args.exists()
    assert sorted(p.name for p in stand_in.roots.iterdir() if ".repo." in p.name or ".tmp." in p.name) == []


def test_bazel_launcher_refuses_a_sealed_root_that_is_not_the_set(tmp_path: Path) -> None:
    stand_in, env = provisioning_stand_in(tmp_path)
    try:
        proc = stand_in.run({**env, "FAKE_MMDEBSTRAP_DROP": "git"}, check=False)
    finally:
        stand_in.close()
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: root ") and "installed packages differ from set 'bazel-root'" in last \
        and "in the set, not installed: git 1.0" in last, proc.stderr
    assert not stand_in.root.exists() and not stand_in.bazel_args.exists()
    assert [p.name for p in stand_in.roots.iterdir() if ".repo." in p.name or ".tmp." in p.name] == []


def test_bazel_launcher_refuses_an_interpreter_with_a_system_prefix(tmp_path: Path) -> None:
    """The interpreter's prefix is bound at its own path in the sealed root: a Python whose prefix
    is /usr (Debian's own python3.11) would cover the root's /usr, and its Bazel, with the host's.
    The launcher refuses it in one line naming the interpreter and the fix, and mounts nothing."""
    usr_python = tmp_path / "usrpy" / "python3.11"
    usr_python.parent.mkdir()
    # Answers the launcher's interpreter probe (and any other query: sys.base_prefix) with /usr.
    usr_python.write_text("#!/bin/sh\ncase \"$2\" in *version_info*) printf '3.11\\n%s\\n/usr\\n' \"$0\";; *) echo /usr;; esac\n")
    usr_python.chmod(0o755)
    stand_in = StandInRoot(tmp_path / "root", str(usr_python))
    try:
        proc = stand_in.run({}, check=False)
    finally:
        stand_in.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"at {usr_python} lives under /usr" in proc.stderr \
        and "KIMI_K3_PYTHON" in proc.stderr, proc.stderr
    assert not stand_in.binds() and not stand_in.bazel_args.exists()


def test_bazel_launcher_keeps_secrets_off_command_lines(tmp_path: Path) -> None:
    """tools/bazel passes KIMI_K3_*/PIP_* values into the sealed root through the environment of
    its nsenter/bash/nsenter/env chain, never as arguments: /proc/PID/cmdline is world-readable.
    The secrets must reach the stand-in root's bazel (the URL's password through the credentials
    file) and appear in no argv.
    """
    password, pip_secret = "sentinel-pw-" + os.urandom(8).hex(), "sentinel-pip-" + os.urandom(8).hex()
    env = {"UNLISTED_VAR": "dropped", "KIMI_K3_REGISTRY_USERNAME": "alice", "KIMI_K3_REGISTRY_PASSWORD": password,
           "PIP_INDEX_URL": f"https://bob:{pip_secret}@pypi.example/simple"}
    run = run_launcher_in_stand_in_root(tmp_path, env)
    cache, out_root = run.cache, run.out_root
    argv_log = run.log.read_text()
    for command in ("nsenter", "bash", "/usr/bin/env"):  # the chain really went through the shims
        assert f"{command} " in argv_log, argv_log
    assert password not in argv_log and pip_secret not in argv_log, "a secret was on a command line"
    assert run.bazel_args.read_text().splitlines() == [str(cache), f"--output_user_root={out_root}",
                                                       f"--bazelrc={cache}/tools-bazel.bazelrc", "info", "release"]
    got = dict(kv.split("=", 1) for kv in run.bazel_env.read_text().split("\0") if kv)
    assert got.pop("KIMI_K3_REGISTRY_PASSWORD") == password
    assert got.pop("PIP_INDEX_URL") == "https://pypi.example/simple"
    assert got.pop("KIMI_K3_CREDENTIALS_FILE").startswith(f"{cache}/credentials/run.")
    assert pip_secret in run.credentials_seen.read_text()
    assert got == {"HOME": "/root", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "LANG": "C.UTF-8", "TERM": "dumb", "PWD": str(cache), "OLDPWD": "/", "KIMI_K3_PYTHON": str(run.fake_py),
                   "KIMI_K3_CACHE": str(cache), "KIMI_K3_FORCE_SEALED_ROOT": "1",
                   "KIMI_K3_SEALED_ROOT_DIR": str(run.roots), "KIMI_K3_BAZEL_OUTPUT_ROOT": str(out_root),
                   "KIMI_K3_REGISTRY_USERNAME": "alice"}


def test_launcher_gives_bazel_a_disk_cache_under_the_cache_root(tmp_path: Path) -> None:
    """Every command gets Bazel's disk cache (a second clone reruns only what changed) through an
    rc file at a fixed path (a startup option: a changed path would restart the server); its
    place and size cap come from the environment, and a bad value is one line."""
    run = run_launcher_in_stand_in_root(tmp_path / "a", {"KIMI_K3_DISK_CACHE_MAX_SIZE": "7G"})
    rc = run.cache / "tools-bazel.bazelrc"
    assert f"--bazelrc={rc}" in run.bazel_args.read_text().splitlines()
    lines = [ln for ln in rc.read_text().splitlines() if not ln.startswith("#")]
    assert lines == [f"common --disk_cache={run.cache}/bazel-disk-cache",
                     "common --experimental_disk_cache_gc_max_size=7G"]
    assert (run.cache / "bazel-disk-cache").is_dir()
    off = run_launcher_in_stand_in_root(tmp_path / "b", {"KIMI_K3_DISK_CACHE": "off"})
    assert [ln for ln in (off.cache / "tools-bazel.bazelrc").read_text().splitlines() if not ln.startswith("#")] == []
    for bad, message in (({"KIMI_K3_DISK_CACHE_MAX_SIZE": "lots"}, "KIMI_K3_DISK_CACHE_MAX_SIZE=lots: expected a size"),
                         ({"KIMI_K3_DISK_CACHE": "relative/dir"}, "KIMI_K3_DISK_CACHE=relative/dir: expected an absolute")):
        stand_in = StandInRoot(tmp_path / f"c{len(message)}")
        try:
            proc = stand_in.run(bad, check=False)
        finally:
            stand_in.close()
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"tools/bazel: error: {message}"), proc.stderr


def test_bazel_launcher_binds_what_the_pip_configuration_names(tmp_path: Path) -> None:
    """The pip-related binds into the sealed root come from the user's pip configuration (the
    config files pip reads and the local paths they and the PIP_* variables name), not from a
    fixed list of one machine's directories.

    Two runs with the real interpreter (so real pip lists the config files): a baseline without a
    pip config of the test's own, and one with PIP_CONFIG_FILE (a pip.conf naming find-links, a
    file:// index, a constraints file, a missing path and an https index with a password) and
    PIP_FIND_LINKS (and PIP_PREFIX=/usr, a system directory never bound over the root's own).
    The second run binds exactly the first run's paths plus the config file and the local paths
    it and PIP_FIND_LINKS name, and no value appears in the launcher's output.
    XDG_CONFIG_DIRS and HOME point at empty tmp dirs, so only /etc/pip.conf (always read by pip)
    is left of this machine's own configuration, in both runs alike.
    """
    python = os.path.realpath(sys.executable)
    secret = "sentinel-pip-" + os.urandom(8).hex()
    cfg = tmp_path / "cfg"
    for d in ("links", "pypi/simple", "envlinks", "xdg"):
        (cfg / d).mkdir(parents=True)
    (cfg / "constraints.txt").write_text("torch<=2.14.1\n")
    conf = cfg / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {cfg / 'links'}\nindex-url = file://{cfg / 'pypi/simple'}\n"
                    f"extra-index-url = https://bob:{secret}@pypi.example/simple\n"
                    f"constraint = {cfg / 'constraints.txt'}\n[install]\nsrc = {cfg / 'missing'}\n")
    os.utime(conf, (1_000_000_000, 1_000_000_000))  # binding it must not touch the user's file
    common = {"HOME": str(cfg / "home"), "XDG_CONFIG_DIRS": str(cfg / "xdg")}
    base = run_launcher_in_stand_in_root(tmp_path / "base", common, python)
    run = run_launcher_in_stand_in_root(tmp_path / "conf", {**common, "PIP_CONFIG_FILE": str(conf),
                                                             "PIP_FIND_LINKS": str(cfg / "envlinks"),
                                                             "PIP_PREFIX": "/usr"}, python)
    assert run.binds() - {str(run.cache), str(run.out_root)} == \
        base.binds() - {str(base.cache), str(base.out_root)} | \
        {str(conf), str(cfg / "links"), str(cfg / "pypi"), str(cfg / "constraints.txt"), str(cfg / "envlinks")}
    for proc in (base.proc, run.proc):
        assert secret not in proc.stdout + proc.stderr
    assert conf.stat().st_mtime == 1_000_000_000
    etc_pip_conf = Path("/etc/pip.conf")
    named = etc_pip_conf.read_text() if etc_pip_conf.is_file() else ""
    for old in ("/opt/wheels", "/opt/pypi", "/opt/pypi-more", "/etc/xdg/pip"):
        if not re.search(re.escape(old) + r"(?![\w-])", named):
            assert not [b for b in run.binds() if b == old or b.startswith(old + "/")], f"{old} bound, no pip setting names it"


def test_bazel_launcher_follows_pip_config_edits_and_removal(tmp_path: Path) -> None:
    """A config file bind pins the inode it was made from, and the launcher's mount namespace
    outlives each command: a pip.conf since replaced (an editor saving by rename) is bound again,
    and one since removed is unbound, so the sealed root never reads a stale pip configuration.

    The file lies outside every directory the launcher binds (not under /tmp): there the kernel
    itself drops a bind whose source is renamed over, so only such a file tests the launcher."""
    outside = Path(tempfile.mkdtemp(prefix="kimi-k3-pipconf-", dir="/var/tmp"))
    conf = outside / "pip.conf"
    (outside / "pip.conf").write_text("[global]\ntimeout = 1\n")
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_DIRS": str(tmp_path / "xdg"), "PIP_CONFIG_FILE": str(conf)}
    stand_in = StandInRoot(tmp_path / "stand-in", os.path.realpath(sys.executable))
    try:
        stand_in.run(env)
        assert stand_in.seen_inside(conf) == "[global]\ntimeout = 1\n"
        (outside / "pip.conf.new").write_text("[global]\ntimeout = 2\n")
        os.replace(outside / "pip.conf.new", outside / "pip.conf")
        stand_in.run(env)
        assert stand_in.seen_inside(conf) == "[global]\ntimeout = 2\n"
        (outside / "pip.conf").unlink()
        stand_in.run(env)
        assert stand_in.seen_inside(conf) is None
    finally:
        stand_in.close()
        shutil.rmtree(outside)



def test_bazel_launcher_binds_a_directory_made_again_at_the_same_path(tmp_path: Path) -> None:
    """A bound directory removed and made again at its path (a checkout cloned anew, a mirror
    filled anew) is another inode: the long-lived namespace must bind the new one, not keep
    showing the deleted one (Bazel then failed with `getcwd() failed`). Outside /tmp, as above."""
    outside = Path(tempfile.mkdtemp(prefix="kimi-k3-mirror-", dir="/var/tmp"))
    mirror = outside
    (outside / "old.whl").write_text("old\n")
    env = {"KIMI_K3_MIRROR": str(mirror)}
    stand_in = StandInRoot(tmp_path / "stand-in")
    try:
        stand_in.run(env)
        assert stand_in.seen_inside(mirror / "old.whl", bound_itself=False) == "old\n"
        shutil.rmtree(outside)
        outside.mkdir()
        (outside / "new.whl").write_text("new\n")
        stand_in.run(env)
        assert stand_in.seen_inside(mirror / "new.whl", bound_itself=False) == "new\n"
        assert stand_in.seen_inside(mirror / "old.whl", bound_itself=False) is None
    finally:
        stand_in.close()
        shutil.rmtree(outside, ignore_errors=True)


def test_a_sealed_namespace_that_stopped_receiving_binds_is_replaced(tmp_path: Path) -> None:
    """Seen after a main job on a fresh machine: the sealed namespace's root had turned private,
    so a bind made for a later command (a second checkout outside /tmp, a new mirror directory)
    never reached it, and Bazel in the second checkout said "not within a workspace". The
    launcher replaces such a namespace (ending its holder) and keeps one that still receives."""
    outside = Path(tempfile.mkdtemp(prefix="kimi-k3-mirror-", dir="/var/tmp"))
    (outside / "a.whl").write_text("a\n")
    stand_in = StandInRoot(tmp_path / "stand-in")
    try:
        stand_in.run({})
        sealed = stand_in.sealed_pid_file.read_text().strip()
        # What the main job's action did, in the sealed namespace: its root made private.
        subprocess.run([sys.executable, "-c", (
            "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True)\n"
            f"fd = os.open('/proc/{sealed}/ns/mnt', os.O_RDONLY)\n"
            "assert libc.setns(fd, 0x00020000) == 0, os.strerror(ctypes.get_errno())\n"
            "assert libc.mount(None, b'/', None, 0x4000 | 0x40000, None) == 0, os.strerror(ctypes.get_errno())")],
            check=True, timeout=30)
        proc = stand_in.run({"KIMI_K3_MIRROR": str(outside)})
        assert "no longer receives new binds; starting a new one" in proc.stderr
        replaced = stand_in.sealed_pid_file.read_text().strip()
        assert replaced != sealed
        for _ in range(50):
            if not Path(f"/proc/{sealed}").exists():
                break
            time.sleep(0.1)
        assert not Path(f"/proc/{sealed}").exists(), "the old holder still runs"
        assert (Path(f"/proc/{replaced}/root") / str(outside).lstrip("/") / "a.whl").read_text() == "a\n"
        proc = stand_in.run({"KIMI_K3_MIRROR": str(outside)})
        assert stand_in.sealed_pid_file.read_text().strip() == replaced and "no longer receives" not in proc.stderr
    finally:
        stand_in.close()
        shutil.rmtree(outside, ignore_errors=True)


def no_sentinel_in_files(top: Path, sentinels: list[str], skip: tuple[Path, ...] = ()) -> list[str]:
    """'path: sentinel' for every regular file under top (symlinks not followed) holding one."""
    hits = []
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = Path(dirpath) / name
            if path in skip or path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            hits += [f"{path}: {s}" for s in sentinels if s.encode() in data]
    return hits


# ---------------------------------------------------------------- credentials of forwarded variables

def test_credentials_are_stripped_from_every_url_of_a_forwarded_value() -> None:
    s = "sentinel-" + os.urandom(4).hex()
    assert credentials.strip("https_proxy", f"http://bob:{s}@proxy.example:3128") == "http://proxy.example:3128"
    assert credentials.strip("HTTP_PROXY", f"bob:{s}@proxy.example:3128") == "proxy.example:3128"  # no scheme
    assert credentials.strip("PIP_EXTRA_INDEX_URL", f"https://{s}@a.example/simple  https://u:p@ss{s}@b.example/x") \
        == "https://a.example/simple  https://b.example/x"  # a token alone; a raw '@' in a password
    assert credentials.strip("PIP_INDEX_URL", f"git+https://u:{s}@h.example/r.git@v1") == "git+https://h.example/r.git@v1"
    for plain in ("https://pypi.org/simple", "/opt/wheels file:///srv/index", "127.0.0.1,localhost", "user@host"):
        assert credentials.strip("PIP_FIND_LINKS", plain) == plain
    stripped, originals = credentials.split({"https_proxy": f"http://u:{s}@p:1", "no_proxy": "localhost"},
                                            ["https_proxy", "no_proxy", "PIP_INDEX_URL"])
    assert stripped == {"https_proxy": "http://p:1"} and originals == {"https_proxy": f"http://u:{s}@p:1"}


def test_credentials_are_restored_only_where_the_stripped_value_was_passed(tmp_path: Path) -> None:
    """A tool gets back the original of each variable it was given in the stripped form; one it
    was not given, or was given changed, stays as it is. The file is created 0600, never over one."""
    originals = {"https_proxy": "http://u:pw@p:1", "http_proxy": "http://u:pw@p:1", "PIP_INDEX_URL": "https://t@i/s"}
    path = tmp_path / "credentials.json"
    credentials.write_private(path, originals)
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        credentials.write_private(path, originals)
    env = {credentials.ENV: str(path), "https_proxy": "http://p:1", "http_proxy": "http://other:2"}
    credentials.restore(env)
    assert env == {credentials.ENV: str(path), "https_proxy": "http://u:pw@p:1", "http_proxy": "http://other:2"}
    gone = {credentials.ENV: str(tmp_path / "ended"), "https_proxy": "http://p:1"}
    credentials.restore(gone)  # the command that wrote it has ended: nothing to restore, no error
    assert gone["https_proxy"] == "http://p:1"


def test_launcher_gives_bazel_no_credential_of_a_forwarded_variable(tmp_path: Path) -> None:
    """Bazel logs its client environment into the output base (java.log) and repository markers
    record watched values, so the launcher hands Bazel every forwarded URL without its
    user:password@. The originals wait in a 0600 file of a 0700 directory under the cache root,
    named by KIMI_K3_CREDENTIALS_FILE while the command runs, removed when it ends; no sentinel is
    in any file the run leaves, nor in any argv."""
    s = ["sentinel-" + os.urandom(6).hex() for _ in range(5)]
    env = {"https_proxy": f"http://proxyuser:{s[0]}@127.0.0.1:9", "HTTP_PROXY": f"proxyuser:{s[1]}@127.0.0.1:9",
           "PIP_INDEX_URL": f"https://indexuser:{s[2]}@pypi.example/simple",
           "PIP_EXTRA_INDEX_URL": f"https://{s[3]}@a.example/simple https://b.example/simple",
           "KIMI_K3_INDEX_URL": f"https://u:{s[4]}@pypi.example/simple", "no_proxy": "localhost"}
    run = run_launcher_in_stand_in_root(tmp_path, env)
    got = dict(kv.split("=", 1) for kv in run.bazel_env.read_text().split("\0") if kv)
    assert {k: got.get(k) for k in env} == {
        "https_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "127.0.0.1:9", "PIP_INDEX_URL": "https://pypi.example/simple",
        "PIP_EXTRA_INDEX_URL": "https://a.example/simple https://b.example/simple",
        "KIMI_K3_INDEX_URL": "https://pypi.example/simple", "no_proxy": "localhost"}
    cred_file = Path(got["KIMI_K3_CREDENTIALS_FILE"])
    assert cred_file.name == "credentials.json" and cred_file.parent.parent == run.cache / "credentials"
    file_mode, dir_mode, text = run.credentials_seen.read_text().split("\n", 2)
    assert (file_mode, dir_mode) == (f"600 {cred_file}", f"700 {cred_file.parent}")
    assert json.loads(text) == {k: v for k, v in env.items() if k != "no_proxy"}
    assert list((run.cache / "credentials").iterdir()) == [], "the credentials directory outlived the command"
    assert no_sentinel_in_files(tmp_path, s, skip=(run.credentials_seen,)) == []
    assert not [x for x in s if x in run.proc.stdout + run.proc.stderr]


def test_a_host_bazel_gets_no_credential_either(tmp_path: Path) -> None:
    """With BAZEL_REAL (or a Bazel 7 on PATH) the launcher runs that Bazel on the host: it strips
    the forwarded URLs' credentials for it the same way, and removes the file when it ends."""
    secret = "sentinel-" + os.urandom(6).hex()
    seen = tmp_path / "seen"
    bazel = tmp_path / "bazel"
    bazel.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "bazel 7.7.1"; exit 0; fi\n'
                     f'env -0 >{seen}.env; cat "$KIMI_K3_CREDENTIALS_FILE" >{seen}.credentials\n')
    bazel.chmod(0o755)
    env = {"PATH": LAUNCHER_PATH, "HOME": str(tmp_path / "home"), "BAZEL_REAL": str(bazel),
           "KIMI_K3_PYTHON": os.path.realpath(sys.executable), "KIMI_K3_CACHE": str(tmp_path / "cache"),
           "https_proxy": f"http://u:{secret}@proxy.example:3128"}
    proc = subprocess.run([str(LAUNCHER), "info"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = dict(kv.split("=", 1) for kv in Path(f"{seen}.env").read_text().split("\0") if kv)
    assert got["https_proxy"] == "http://proxy.example:3128" and secret not in Path(f"{seen}.env").read_text()
    assert json.loads(Path(f"{seen}.credentials").read_text()) == {"https_proxy": env["https_proxy"]}
    assert list((tmp_path / "cache" / "credentials").iterdir()) == []


class AuthProxy(http.server.ThreadingHTTPServer):
    """A forward HTTP proxy on 127.0.0.1 that wants Proxy-Authorization and serves every host
    itself from `files` ({(host, path): bytes}); a host named in `logins` also wants that Basic
    login. Records (host, path, status) of each request."""

    def __init__(self, proxy_login: str, files: dict[tuple[str, str], bytes], logins: dict[str, str]) -> None:
        self.proxy_login, self.files, self.logins, self.seen = proxy_login, files, logins, []
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _basic(login: str) -> str:
    return "Basic " + base64.b64encode(login.encode()).decode()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: AuthProxy

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        m = re.fullmatch(r"http://([^/]+)(/.*)", self.path)
        host, path = (m.group(1), m.group(2)) if m else ("", self.path)
        if self.headers.get("Proxy-Authorization") != _basic(self.server.proxy_login):
            status, body, extra = 407, b"proxy login wanted\n", {"Proxy-Authenticate": 'Basic realm="proxy"'}
        elif host in self.server.logins and self.headers.get("Authorization") != _basic(self.server.logins[host]):
            status, body, extra = 401, b"login wanted\n", {"WWW-Authenticate": 'Basic realm="index"'}
        elif (host, path) in self.server.files:
            body = self.server.files[(host, path)]
            status, extra = 200, {"Content-Type": "text/html" if path.endswith("/") else "application/octet-stream"}
        else:
            status, body, extra = 404, b"not here\n", {}
        self.server.seen.append((host, path, status))
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **extra}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def auth_proxy_secrets() -> Iterator[tuple[str, str]]:
    yield "sentinel-proxy-" + os.urandom(6).hex(), "sentinel-index-" + os.urandom(6).hex()


def test_fetch_takes_the_proxy_credentials_from_the_private_file(tmp_path: Path,
                                                                 auth_proxy_secrets: tuple[str, str]) -> None:
    """Under the launcher a repository rule's fetch gets http_proxy without its password (what
    Bazel saw) and KIMI_K3_CREDENTIALS_FILE: tools.fetch takes the password back from the file,
    so a proxy that wants a login still delivers the pin."""
    secret, _ = auth_proxy_secrets
    data = b"pinned bytes\n"
    proxy = AuthProxy(f"proxyuser:{secret}", {("pins.invalid", "/tiny.bin"): data}, {})
    try:
        lock = tmp_path / "pins.lock.json"
        lock.write_text(json.dumps({"schema_version": 1, "stacks": {}, "pins": {"tiny": {
            "kind": "file", "filename": "tiny.bin", "urls": ["http://pins.invalid/tiny.bin"],
            "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}}))
        full = proxy.url.replace("http://", f"http://proxyuser:{secret}@")
        cred_dir = tmp_path / "credentials"
        cred_dir.mkdir(mode=0o700)
        credentials.write_private(cred_dir / "credentials.json", {"http_proxy": full})
        env = {"PATH": os.environ.get("PATH", LAUNCHER_PATH), "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1",
               "KIMI_K3_CACHE": str(tmp_path / "cache"), "http_proxy": proxy.url,
               credentials.ENV: str(cred_dir / "credentials.json")}
        proc = subprocess.run([sys.executable, "-m", "tools.fetch", "fetch", "--lock", str(lock), "--pin", "tiny",
                               "--out", str(tmp_path / "tiny.bin")], env=env, capture_output=True, text=True, timeout=60)
    finally:
        proxy.shutdown()
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tiny.bin").read_bytes() == data
    assert proxy.seen == [("pins.invalid", "/tiny.bin", 200)]
    assert secret not in proc.stdout + proc.stderr


def tiny_wheel(name: str, version: str) -> bytes:
    """A pure-Python wheel holding one module."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": b"VALUE = 1\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
                     for p, b in files.items()) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p, b in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(zipfile.ZipInfo(p, (2020, 1, 1, 0, 0, 0)), b)
    return buf.getvalue()


class TinyIndex:
    """A one-wheel package index at http://pypi.invalid/simple/ (wants `indexuser:index_secret`)
    and a pinned file at http://pins.invalid/tiny.bin, both behind an AuthProxy that wants
    `proxyuser:proxy_secret`."""

    WHEEL = "kimi_tinypkg-1.0-py3-none-any.whl"
    PIN_DATA = b"pinned bytes\n"

    def __init__(self, proxy_secret: str, index_secret: str) -> None:
        wheel = tiny_wheel("kimi_tinypkg", "1.0")
        self.wheel_sha = hashlib.sha256(wheel).hexdigest()
        page = f'<a href="http://pypi.invalid/files/{self.WHEEL}#sha256={self.wheel_sha}">{self.WHEEL}</a>\n'.encode()
        self.proxy = AuthProxy(f"proxyuser:{proxy_secret}", {
            ("pypi.invalid", "/simple/kimi-tinypkg/"): page, ("pypi.invalid", f"/files/{self.WHEEL}"): wheel,
            ("pins.invalid", "/tiny.bin"): self.PIN_DATA}, {"pypi.invalid": f"indexuser:{index_secret}"})
        self.proxy_url = self.proxy.url.replace("http://", f"http://proxyuser:{proxy_secret}@")
        self.index_url = f"http://indexuser:{index_secret}@pypi.invalid/simple/"
        self.requirements = f"kimi-tinypkg==1.0 --hash=sha256:{self.wheel_sha}\n"

    def pip_conf(self, path: Path) -> Path:
        path.write_text("[global]\ntrusted-host = pypi.invalid\nretries = 0\n")  # a plain-HTTP index
        return path

    def pins_lock(self) -> str:
        return json.dumps({"schema_version": 1, "stacks": {}, "pins": {"tiny": {
            "kind": "file", "filename": "tiny.bin", "urls": ["http://pins.invalid/tiny.bin"],
            "sha256": hashlib.sha256(self.PIN_DATA).hexdigest(), "size": len(self.PIN_DATA)}}})

    def statuses(self) -> dict[tuple[str, str], int]:
        return {(host, path): status for host, path, status in self.proxy.seen}


def test_venv_build_takes_pip_credentials_from_the_private_file(tmp_path: Path,
                                                                auth_proxy_secrets: tuple[str, str]) -> None:
    """The venv rule's build script (tools/pins/private/python_venv.bzl, run as that rule runs it)
    gets PIP_INDEX_URL and http_proxy without their passwords (what Bazel saw) and
    KIMI_K3_CREDENTIALS_FILE: pip gets both logins back and installs from the index behind the
    proxy; nothing the venv holds names them."""
    proxy_secret, index_secret = auth_proxy_secrets
    index = TinyIndex(proxy_secret, index_secret)
    script = re.search(r'^_BUILD_SCRIPT = """(.*?)"""$', (REPO_ROOT / "tools/pins/private/python_venv.bzl").read_text(),
                       re.S | re.M).group(1)
    assert "\\" not in script, "the Starlark string has escapes: read it as Starlark would"
    lock = tmp_path / "requirements_lock.txt"
    lock.write_text(index.requirements)
    cred_dir = tmp_path / "credentials"
    cred_dir.mkdir(mode=0o700)
    credentials.write_private(cred_dir / "credentials.json", {"http_proxy": index.proxy_url,
                                                              "PIP_INDEX_URL": index.index_url})
    env = {"PATH": os.environ.get("PATH", LAUNCHER_PATH), "HOME": str(tmp_path / "home"),
           "PIP_CONFIG_FILE": str(index.pip_conf(tmp_path / "pip.conf")),
           "PIP_INDEX_URL": credentials.strip("PIP_INDEX_URL", index.index_url),
           "http_proxy": credentials.strip("http_proxy", index.proxy_url), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PYTHONDONTWRITEBYTECODE": "1", credentials.ENV: str(cred_dir / "credentials.json")}
    venv = tmp_path / "venv"
    try:
        proc = subprocess.run([os.path.realpath(sys.executable), "-c", script, str(venv), str(lock), str(REPO_ROOT)],
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        index.proxy.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(venv.glob("lib/python3.11/site-packages/kimi_tinypkg.py")) and (venv / ".kimi-k3-complete").is_file()
    assert index.statuses() == {("pypi.invalid", "/simple/kimi-tinypkg/"): 200,
                                ("pypi.invalid", f"/files/{TinyIndex.WHEEL}"): 200}, index.proxy.seen
    assert no_sentinel_in_files(venv, [proxy_secret, index_secret]) == []
    assert proxy_secret not in proc.stdout + proc.stderr and index_secret not in proc.stdout + proc.stderr


def against_real_sealed_root(roots: Path, command: list[str]) -> list[str]:
    """command, run so that roots/KEY is the real sealed root this checkout's launcher uses. By hand
    on the host, roots/KEY links to that root's directory. Under Bazel this test runs inside that
    root (/ is it): / is bound (without what is mounted on it) at roots/KEY in a mount namespace of
    the command's own, leaving the namespace of the Bazel server running this test untouched."""
    key = sealed_root_key()
    if Path("/.kimi-k3-complete").is_file():
        (roots / key).mkdir()
        return [shutil.which("unshare") or "/usr/bin/unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind / "$0" && exec "$@"', str(roots / key), *command]
    parent = os.environ.get("KIMI_K3_SEALED_ROOT_DIR") or \
        os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kimi-k3-bazel-root")
    root = Path(parent) / key
    if not (root / ".kimi-k3-complete").is_file():
        pytest.fail(f"no provisioned sealed root at {root}: run tools/bazel once first")
    (roots / key).symlink_to(root)
    return command


def test_a_real_bazel_run_writes_no_credential(tmp_path: Path, auth_proxy_secrets: tuple[str, str]) -> None:
    """The real Bazel (the real sealed root, a fresh output root, cache and namespace of its own)
    on a tiny workspace whose repository rules take the forwarded variables: the venv rule
    (pip through http_proxy from an index that wants a login) and a pin (tools.fetch through the
    proxy). The proxy and index logins, and a KIMI_K3_REGISTRY_PASSWORD, are sentinels: the
    build succeeds (the credentials reached pip and the fetch) and no sentinel is in any file
    under the output root, the cache root or the workspace."""
    proxy_secret, index_secret = auth_proxy_secrets
    registry_secret = "sentinel-registry-" + os.urandom(6).hex()
    sentinels = [proxy_secret, index_secret, registry_secret]
    index = TinyIndex(proxy_secret, index_secret)

    ws, cache, out_root, roots, home = (tmp_path / d for d in ("ws", "cache", "out", "roots", "home"))
    for d in (ws / "third_party", roots, home):
        d.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "tools", ws / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "third_party" / "bazel_offline", ws / "third_party" / "bazel_offline")
    for f in (".bazelversion", ".bazelrc", "third_party/debian.lock.json"):
        shutil.copy(REPO_ROOT / f, ws / f)
    (ws / "MODULE.bazel").write_text(
        'module(name = "launcher_secrets_test")\n'
        'bazel_dep(name = "rules_python", version = "0.22.1")\n'
        'python_venv = use_extension("//tools/pins:extensions.bzl", "python_venv")\n'
        'python_venv.venv(name = "tiny_python", requirements_lock = "//:requirements_lock.txt")\n'
        'use_repo(python_venv, "tiny_python")\n'
        'pins = use_extension("//tools/pins:extensions.bzl", "pins")\n'
        'pins.lock(file = "//:pins.lock.json")\n'
        'use_repo(pins, "pins")\n')
    (ws / "BUILD.bazel").write_text('exports_files(["requirements_lock.txt", "pins.lock.json"])\n')
    (ws / "third_party" / "BUILD.bazel").write_text("")
    (ws / "requirements_lock.txt").write_text(index.requirements)
    (ws / "pins.lock.json").write_text(index.pins_lock())

    python = os.path.realpath(sys.executable)
    env = {"PATH": LAUNCHER_PATH, "HOME": str(home), "KIMI_K3_FORCE_SEALED_ROOT": "1",
           "KIMI_K3_SEALED_ROOT_DIR": str(roots), "KIMI_K3_CACHE": str(cache), "KIMI_K3_BAZEL_OUTPUT_ROOT": str(out_root),
           "KIMI_K3_PYTHON": python, "PIP_CONFIG_FILE": str(index.pip_conf(tmp_path / "pip.conf")),
           "PIP_INDEX_URL": index.index_url, "http_proxy": index.proxy_url, "https_proxy": index.proxy_url,
           "KIMI_K3_REGISTRY_USERNAME": "alice", "KIMI_K3_REGISTRY_PASSWORD": registry_secret}
    command = against_real_sealed_root(roots, [str(ws / "tools" / "bazel"), "--batch", "build", "--nobuild",
                                               "@tiny_python//:python_path.txt", "@pins//:tiny"])
    try:
        proc = subprocess.run(command, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    finally:
        index.proxy.shutdown()
        kill_holders(roots, sealed_root_key())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert index.statuses() == {("pypi.invalid", "/simple/kimi-tinypkg/"): 200,
                                ("pypi.invalid", f"/files/{TinyIndex.WHEEL}"): 200,
                                ("pins.invalid", "/tiny.bin"): 200}, index.proxy.seen
    venv = next((cache / "venvs").glob("requirements_lock-*/.kimi-k3-complete")).parent
    assert list(venv.glob("lib/python3.11/site-packages/kimi_tinypkg.py"))
    assert any(out_root.glob("*/java.log*")), "no java.log: the check below would prove nothing"
    assert no_sentinel_in_files(out_root, sentinels) + no_sentinel_in_files(cache, sentinels) + \
        no_sentinel_in_files(ws, sentinels) == []
    assert not any((cache / "credentials").iterdir())
    assert not [x for x in sentinels if x in proc.stdout + proc.stderr]


# ---------------------------------------------------------------- the interpreter, checked once

def python_stand_in(path: Path, version: tuple[int, int]) -> str:
    """An interpreter that runs Python code as a Python `version` does as far as the launcher can
    tell: sys.version_info says it, and before 3.3 sys.base_prefix does not exist."""
    prelude = (f"import sys; sys.version_info = ({version[0]}, {version[1]}, 0, 'final', 0); "
               f"sys.version = '{version[0]}.{version[1]}.0'")
    if version < (3, 3):
        prelude += "; del sys.base_prefix"
    path.write_text(f'#!/bin/sh\n[ "$1" = -c ] || exit 9\nexec {shlex.quote(os.path.realpath(sys.executable))} -c '
                    f'"{prelude}; exec(compile(sys.argv[1], \'<string>\', \'exec\'))" "$2"\n')
    path.chmod(0o755)
    return str(path)


def bad_interpreter(tmp_path: Path, case: str) -> str:
    d = tmp_path / "interp"
    d.mkdir()
    if case == "python2.7":
        return python_stand_in(d / "python2.7", (2, 7))
    if case == "python3.9":
        return python_stand_in(d / "python3.9", (3, 9))
    if case == "exits 3":
        (d / "python").write_text("#!/bin/sh\nexit 3\n")
        (d / "python").chmod(0o755)
        return str(d / "python")
    if case == "not executable":
        (d / "python").write_text("#!/bin/sh\nexit 0\n")
        return str(d / "python")
    if case == "a directory":
        return str(d)
    return str(d / "missing")


INTERPRETER_CASES = {
    "python2.7": "is Python 2.7; the pinned cp311 wheels need Python 3.11",
    "python3.9": "is Python 3.9; the pinned cp311 wheels need Python 3.11",
    "exits 3": "does not run as Python (exit 3)",
    "not executable": "is not executable",
    "a directory": "is a directory, not an interpreter",
    "missing": "does not exist",
}


@pytest.mark.parametrize("named_by, case", [("KIMI_K3_PYTHON", case) for case in sorted(INTERPRETER_CASES)] +
                         [("PATH", "python3.9"), ("PATH", "exits 3")])
def test_launcher_refuses_a_wrong_interpreter_in_one_line(tmp_path: Path, named_by: str, case: str) -> None:
    """KIMI_K3_PYTHON, or without it the python3.11 found on PATH, is checked once, before anything
    uses it: a wrong one is one line naming it, what is wrong and the fix; nothing is mounted,
    Bazel never runs."""
    python = bad_interpreter(tmp_path, case)
    stand_in = StandInRoot(tmp_path / "root", python)
    env: dict[str, str | None] = {}
    what, fix = f"KIMI_K3_PYTHON={python}", "point KIMI_K3_PYTHON at a python3.11"
    if named_by == "PATH":
        found = stand_in.shims / "python3.11"
        found.unlink(missing_ok=True)
        shutil.move(python, found)
        env["KIMI_K3_PYTHON"] = None
        what, fix = f"python3.11 from PATH ({found})", "set KIMI_K3_PYTHON=/path/to/python3.11"
    try:
        proc = stand_in.run(env, check=False)
    finally:
        stand_in.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"tools/bazel: error: {what} {INTERPRETER_CASES[case]}: {fix}\n", proc.stderr
    assert not stand_in.binds() and not stand_in.bazel_args.exists()


def test_launcher_python_version_is_the_venvs() -> None:
    """The launcher and the venv rule ask for the same Python."""
    bzl = (REPO_ROOT / "tools/pins/private/python_venv.bzl").read_text()
    venv = re.search(r'^_WANT_PYTHON = "([0-9.]+)"$', bzl, re.M).group(1)
    assert re.search(rf"^want_python={re.escape(venv)}$", LAUNCHER.read_text(), re.M)


# ---------------------------------------------------------------- provisioning: signals and locks

def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(pid)
    return alive


def lock_is_free(path: Path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def wait_for(what: str, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def provisioning_under_way(tmp_path: Path, **extra: str) -> Iterator[tuple[StandInRoot, dict[str, str],
                                                                            subprocess.Popen, list[int]]]:
    """A first run started in the background, its stand-in mmdebstrap (and that one's child, a
    stand-in apt) running: (stand_in, env, the launcher, [mmdebstrap's PID, its child's]). What
    is left of them afterwards is killed."""
    stand_in, env = provisioning_stand_in(tmp_path)
    pids_file = tmp_path / "mmdebstrap.pids"
    env = {**env, "FAKE_MMDEBSTRAP_PIDS": str(pids_file), **extra}
    proc = stand_in.start(env, tmp_path / "stderr")
    pids: list[int] = []
    try:
        wait_for("the stand-in mmdebstrap", pids_file.exists)
        pids += [int(p) for p in pids_file.read_text().split()]
        yield stand_in, env, proc, pids
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids_alive(pids):
            os.kill(pid, signal.SIGKILL)
        stand_in.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_provisioning_ends_mmdebstrap_and_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    """A signal to tools/bazel while mmdebstrap builds the root ends mmdebstrap and its children
    (a stand-in apt), removes the temp root and the local repository, and frees the lock."""
    with provisioning_under_way(tmp_path) as (stand_in, _env, proc, pids):
        proc.send_signal(sig)
        proc.wait(timeout=60)
        wait_for("mmdebstrap and its child to end", lambda: not pids_alive(pids), timeout=10)
    assert proc.returncode == -sig, (proc.returncode, (tmp_path / "stderr").read_text())
    assert (tmp_path / "stderr").read_text().splitlines()[-1] == \
        f"tools/bazel: stopped by SIG{sig.name[3:]}: ended what it had started and removed what that was writing"
    assert [p.name for p in stand_in.roots.iterdir() if ".tmp." in p.name or ".repo." in p.name] == []
    assert not stand_in.root.exists() and lock_is_free(stand_in.lock_file)


def test_killed_launcher_takes_mmdebstrap_with_it(tmp_path: Path) -> None:
    """Even SIGKILL, which no trap sees: mmdebstrap gets SIGTERM when the launcher dies, so the lock
    is free again and the next run provisions the root."""
    with provisioning_under_way(tmp_path) as (stand_in, env, proc, pids):
        proc.kill()
        proc.wait(timeout=10)
        wait_for("mmdebstrap to end with the launcher", lambda: not pids_alive(pids[:1]), timeout=10)
        wait_for("the lock to be free", lambda: lock_is_free(stand_in.lock_file), timeout=10)
        stand_in.run({**env, "FAKE_MMDEBSTRAP_PIDS": None})  # a run that completes
    assert (stand_in.root / ".kimi-k3-complete").is_file()
    assert [p.name for p in stand_in.roots.iterdir() if ".tmp." in p.name or ".repo." in p.name] == []


def test_second_run_says_which_run_it_waits_for(tmp_path: Path) -> None:
    """Two first runs: the second does not block silently on the lock the first holds while it
    provisions; it names the first's PID and what it does, then uses the root it built."""
    release = tmp_path / "release"
    with provisioning_under_way(tmp_path, FAKE_MMDEBSTRAP_RELEASE=str(release)) as (stand_in, env, first, _pids):
        second = stand_in.start(env, tmp_path / "second.stderr")
        try:
            line = (f"tools/bazel: waiting for PID {first.pid} (provisioning the sealed root {stand_in.root}: "
                    "mmdebstrap) to finish ...")
            wait_for("the waiting line", lambda: line in (tmp_path / "second.stderr").read_text(), timeout=30)
            assert second.poll() is None and first.poll() is None
            release.touch()
            assert first.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
            assert second.wait(timeout=60) == 0, (tmp_path / "second.stderr").read_text()
        finally:
            if second.poll() is None:
                second.kill()
    assert len((tmp_path / "mmdebstrap.log").read_text().splitlines()) == 1
    assert "provisioning" not in (tmp_path / "second.stderr").read_text().replace(line, "")


def sealed_holders(stand_in: StandInRoot) -> list[int]:
    """PIDs of the processes holding a sealed namespace under the stand-in's outer one (the
    launcher names each after the root's key and its outer holder's PID; a real sealed root of
    this checkout has the same key, another outer holder)."""
    outer = stand_in.holder_pid_file.read_text().strip()
    name = f"kimi-k3-sealed-{stand_in.root.name}-{outer}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(name):
                found.append(int(entry.name))
    return found


def test_two_runs_that_find_no_namespace_start_one_and_both_enter_it(tmp_path: Path) -> None:
    """Two runs that both found no namespace holder (the first run after provisioning, and one
    beside it) wait for the lock, one after the other: the first starts the holders, the second
    finds them under the lock and enters the same sealed namespace. It must not start another: that
    would remove the pid file the first is about to enter by (seen as `nsenter: invalid PID
    argument`) and leave the first holder running."""
    stand_in = StandInRoot(tmp_path)
    runs: list[subprocess.Popen] = []
    try:
        with open(stand_in.lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # as another run starting the holders would
            for n in range(2):
                runs.append(stand_in.start({}, tmp_path / f"run{n}.stderr"))
            for n in range(2):
                wait_for(f"run {n} to wait for the lock",
                         lambda: "waiting for PID" in (tmp_path / f"run{n}.stderr").read_text(), timeout=30)
            assert not stand_in.sealed_pid_file.exists() and all(r.poll() is None for r in runs)
        for n, run in enumerate(runs):
            assert run.wait(timeout=60) == 0, (tmp_path / f"run{n}.stderr").read_text()
        holders = sealed_holders(stand_in)
        assert holders == [int(stand_in.sealed_pid_file.read_text())], holders
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
        with contextlib.suppress(OSError, ValueError):
            for pid in sealed_holders(stand_in):
                os.kill(pid, signal.SIGKILL)
        stand_in.close()


FAKE_APT_GET = r"""
import fcntl, json, os, shutil, struct, sys, time
with open(os.environ["FAKE_APT_LOG"], "a") as log:
    log.write(json.dumps([time.time()] + sys.argv[1:]) + "\n")
lock = os.environ["FAKE_APT_LOCK"]
fd = os.open(lock, os.O_RDWR | os.O_CREAT)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    pid = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)))[4]
    sys.exit(f"E: Could not get lock {lock}. It is held by process {pid}")
if "install" in sys.argv:
    shutil.copy(os.environ["FAKE_APT_MMDEBSTRAP"], os.path.join(os.path.dirname(sys.argv[0]), "mmdebstrap"))
"""


def test_provisioning_waits_for_another_apt_to_install_mmdebstrap(tmp_path: Path) -> None:
    """Without mmdebstrap the launcher installs it with apt-get. Another apt/dpkg run holding the
    dpkg lock (the other of two first runs, unattended-upgrades) is waited for, by PID, instead of
    failing at once; apt-get install is also given DPkg::Lock::Timeout."""
    stand_in, env = provisioning_stand_in(tmp_path)
    mmdebstrap = stand_in.shims / "mmdebstrap"
    shutil.move(mmdebstrap, tmp_path / "mmdebstrap.fake")
    state = tmp_path / "apt"
    for d in ("dpkg", "lists", "archives"):
        (state / d).mkdir(parents=True)
    (state / "apt.conf").write_text(f'Dir::State::status "{state}/dpkg/status";\nDir::State::Lists "{state}/lists/";\n'
                                    f'Dir::Cache::Archives "{state}/archives/";\n')
    fake = stand_in.shims / "apt-get"
    fake.unlink(missing_ok=True)
    fake.write_text(f"#!{sys.executable}\n{FAKE_APT_GET}")
    fake.chmod(0o755)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(state / 'dpkg/lock-frontend')!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(4)\n"
                               "print(time.time(), flush=True)"],  # then it exits, releasing the lock
                              stdout=subprocess.PIPE, text=True)
    # PATH: the shims (no mmdebstrap among them) and sleep, which has no shim.
    (tmp_path / "sleep").mkdir()
    (tmp_path / "sleep" / "sleep").symlink_to(shutil.which("sleep") or "/bin/sleep")
    try:
        assert holder.stdout.readline() == "locked\n"
        proc = stand_in.run({**env, "PATH": f"{stand_in.shims}:{tmp_path / 'sleep'}", "APT_CONFIG": str(state / "apt.conf"),
                             "FAKE_APT_LOG": str(tmp_path / "apt.log"), "FAKE_APT_LOCK": str(state / "dpkg/lock-frontend"),
                             "FAKE_APT_MMDEBSTRAP": str(tmp_path / "mmdebstrap.fake")}, check=False)
        released = float(holder.stdout.readline())
        holder.wait(timeout=30)
    finally:
        holder.kill()
        stand_in.close()
    assert proc.returncode == 0, proc.stderr
    assert f"tools/bazel: waiting for PID {holder.pid} (" in proc.stderr and \
        f"holding {state}/dpkg/lock-frontend) to finish ..." in proc.stderr, proc.stderr
    calls = [json.loads(line) for line in (tmp_path / "apt.log").read_text().splitlines()]
    assert [c[3:] for c in calls] == [["update", "-qq"], ["install", "-y", "-qq", "mmdebstrap"]], calls
    assert all(c[0] >= released for c in calls), (released, calls)
    assert all(len(c) > 2 and c[1] == "-o" and re.fullmatch(r"DPkg::Lock::Timeout=[0-9]+", c[2]) for c in calls), calls
    assert (stand_in.root / ".kimi-k3-complete").is_file()


def test_namespace_holder_keeps_no_descriptor_of_the_run(tmp_path: Path) -> None:
    """The namespace holder lives on after the run. It keeps no descriptor but its /dev/null stdio:
    not the lock's, nor one the caller passed (here a pipe): the caller's end of it would never
    see EOF while the holder lives, and a caller waiting for it (a CI runner) would hang."""
    stand_in = StandInRoot(tmp_path / "root")
    read_end, write_end = os.pipe()
    try:
        command, env = stand_in.command({})
        proc = subprocess.run(command, cwd=stand_in.cache, env=env, pass_fds=(write_end,), timeout=120,
                              capture_output=True, text=True)
        os.close(write_end)
        assert proc.returncode == 0, proc.stderr
        readable = select.select([read_end], [], [], 10)[0]
        got_eof = bool(readable) and os.read(read_end, 1) == b""
        fds = {f.name: sorted(int(fd) for fd in os.listdir(f"/proc/{f.read_text().strip()}/fd"))
               for f in (stand_in.holder_pid_file, stand_in.sealed_pid_file)}
    finally:
        os.close(read_end)
        stand_in.close()
    assert got_eof, "a namespace holder keeps the caller's pipe open"
    assert fds == {stand_in.holder_pid_file.name: [0, 1, 2], stand_in.sealed_pid_file.name: [0, 1, 2]}, fds

if __name__ == "__main__":
    # Arguments select tests (BUILD.bazel's targets, --test_arg=-k --test_arg=NAME).
    sys.exit(pytest.main([__file__, "-v", *sys.argv[1:]]))
