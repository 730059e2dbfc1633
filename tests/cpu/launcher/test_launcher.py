"""CPU tests of the launcher tools/bazel (tag cpu).

tools/bazel runs against a stand-in sealed root (StandInRoot): every command it runs is an
argv-logging shim on PATH, the root holds only /bin/sh, an argv-logging env and a /usr/bin/bazel
that records what it was given. Provisioning runs with a stand-in mmdebstrap over a tiny Debian
set of generated .debs.

Needs root (chroot, mount namespaces). Under Bazel the tests run inside the sealed root, where
the launcher runs chrooted into the host root the sealed root mounts at /run/kimi-k3-host.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]

LAUNCHER = REPO_ROOT / "tools" / "bazel"
# Inside the sealed root (where Bazel runs this test) / is not a mount point, so the launcher's
# `unshare --propagation private` cannot work there; the launcher then runs chrooted into the host
# root that it mounts at this path (every path the test uses is the same in both roots).
HOST_ROOT = Path("/run/kimi-k3-host")
LAUNCHER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sealed_root_key(ws: Path = REPO_ROOT) -> str:
    """The launcher's sealed-root key, computed by the launcher's own lines (debian_tool() ...
    key=...: from Debian set bazel-root's entries) with this interpreter and checkout `ws`."""
    m = re.search(r"^debian_tool\(\) .*?^key=[^\n]*$", LAUNCHER.read_text(), re.S | re.M)
    assert m, "tools/bazel: debian_tool() / key=... lines not found"
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
    """exe (and the shared libraries ldd names) into root, so it runs chrooted there."""
    (root / dest.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(exe), root / dest.lstrip("/"))
    ldd = subprocess.run(["ldd", exe], check=True, text=True, stdout=subprocess.PIPE).stdout
    for lib in re.findall(r"(/\S+) \(0x", ldd):
        target = root / lib.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(lib), target)


def host_root_prefix() -> str:
    """HOST_ROOT where this test runs inside the sealed root (the host's files are there), else ""."""
    # A bind mount of the same file system: os.path.ismount cannot tell, mountinfo can.
    in_sealed_root = any(line.split()[4] == str(HOST_ROOT) for line in open("/proc/self/mountinfo"))
    return str(HOST_ROOT) if in_sealed_root else ""


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
        self.fake_py = base / "py" / "bin" / "python3.11"
        self.holder_pid_file = self.roots / f"{self.root.name}.mntns.pid"
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
        (root / "usr/bin/bazel").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$PWD\" \"$@\" >{self.bazel_args}\n"
                                            f"/usr/bin/env.real -0 >{self.bazel_env}\n")
        for f in ("usr/bin/env", "usr/bin/bazel"):
            (root / f).chmod(0o755)
        if python is None:
            # The interpreter's prefix is bind-mounted into the root: a stand-in whose prefix is a tmp dir.
            self.fake_py.parent.mkdir(parents=True)
            # `-m tools.pins.debian` (the sealed root's key from the Debian lock) runs for real.
            self.fake_py.write_text(f"#!/bin/sh\nif [ \"$1 $2\" = '-m tools.pins.debian' ]; then "
                                    f"exec {shlex.quote(sys.executable)} \"$@\"; fi\necho {base / 'py'}\n")
            self.fake_py.chmod(0o755)
            python = str(self.fake_py)
        self.python = python
        self.where = host_root_prefix()
        self.shims = base / "shims"
        self.shims.mkdir()
        for d in LAUNCHER_PATH.split(":"):
            if not os.path.isdir(self.where + d):
                continue
            for name in os.listdir(self.where + d):
                real = os.path.join(d, name)
                # sleep: the namespace holder runs `exec -a NAME sleep`, and a shim would lose NAME.
                if name == "sleep" or (self.shims / name).exists() or not os.access(self.where + real, os.X_OK) \
                        or os.path.isdir(self.where + real):
                    continue
                (self.shims / name).write_text(f"#!/bin/sh\nprintf '%s ' \"$0\" \"$@\" >>{log}; echo >>{log}\n"
                                               f'exec {real} "$@"\n')
                (self.shims / name).chmod(0o755)

    def run(self, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
        env = {"PATH": f"{self.shims}:{LAUNCHER_PATH}", "HOME": str(self.base / "home"),
               "KIMI_K3_FORCE_SEALED_ROOT": "1", "KIMI_K3_SEALED_ROOT_DIR": str(self.roots),
               "KIMI_K3_CACHE": str(self.cache), "KIMI_K3_BAZEL_OUTPUT_ROOT": str(self.out_root),
               "KIMI_K3_PYTHON": self.python, **env}
        command = [str(self.launcher), "info", "release"]
        if self.where:
            command = [shutil.which("chroot") or "/usr/sbin/chroot", self.where, "/bin/sh", "-c", 'cd "$0" && exec "$@"',
                       str(self.cache), *command]
        proc = subprocess.run(command, cwd=self.cache, env=env, timeout=120,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.returncode == 0 or not check, proc.stderr
        return proc

    def close(self) -> None:
        if self.holder_pid_file.is_file():  # the launcher's namespace holder for this stand-in root
            os.kill(int(self.holder_pid_file.read_text()), signal.SIGKILL)

    def binds(self) -> set[str]:
        """The host paths the launcher bound at their own path (from the logged `mount --rbind`s)."""
        got = set()
        for line in self.log.read_text().splitlines():
            words = line.split()
            if len(words) >= 4 and words[0].endswith("/mount") and words[1] == "--rbind" \
                    and words[3] == f"{self.root}{words[2]}" and words[2] not in ("/sys", "/dev"):
                got.add(words[2])
        return got

    def seen_inside(self, path: Path) -> str | None:
        """path's text as the sealed root sees it now (through the holder's mount namespace), None
        when nothing is bound there."""
        # Through nsenter, not /proc/PID/root: when this test runs in the sealed root, the holder is
        # chrooted into HOST_ROOT while the launcher mounts relative to its namespace's own root.
        pid = self.holder_pid_file.read_text().strip()
        proc = subprocess.run([shutil.which("nsenter") or "/usr/bin/nsenter", "--mount", "--target", pid,
                               "sh", "-c", 'mountpoint -q "$0" && cat "$0"', f"{self.root}{path}"],
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
import json, os, re, shutil, sys
args = sys.argv[1:]
with open(os.environ["FAKE_MMDEBSTRAP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
suite, target, mirror = [a for a in args if not a.startswith("--")]
repo = re.fullmatch(r"deb \[trusted=yes\] copy://(/\S+) \./", mirror).group(1)
include = next(a for a in args if a.startswith("--include=")).split("=", 1)[1].split(",")
shutil.copytree(os.environ["FAKE_MMDEBSTRAP_TEMPLATE"], target, symlinks=True)
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
    usr_python.write_text("#!/bin/sh\necho /usr\n")  # answers sys.base_prefix (and any query) with /usr
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
    its nsenter/bash/chroot/env chain, never as arguments: /proc/PID/cmdline is world-readable.
    The secrets must reach the stand-in root's bazel and appear in no argv.
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
    assert run.bazel_args.read_text().splitlines() == [str(cache), f"--output_user_root={out_root}", "info", "release"]
    got = dict(kv.split("=", 1) for kv in run.bazel_env.read_text().split("\0") if kv)
    assert got.pop("KIMI_K3_REGISTRY_PASSWORD") == password
    assert got.pop("PIP_INDEX_URL") == env["PIP_INDEX_URL"]
    assert got == {"HOME": "/root", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "LANG": "C.UTF-8", "TERM": "dumb", "PWD": str(cache), "OLDPWD": "/", "KIMI_K3_PYTHON": str(run.fake_py),
                   "KIMI_K3_CACHE": str(cache), "KIMI_K3_FORCE_SEALED_ROOT": "1",
                   "KIMI_K3_SEALED_ROOT_DIR": str(run.roots), "KIMI_K3_BAZEL_OUTPUT_ROOT": str(out_root),
                   "KIMI_K3_REGISTRY_USERNAME": "alice"}


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
    etc_pip_conf = Path(host_root_prefix() + "/etc/pip.conf")
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
    where = host_root_prefix()
    outside = Path(tempfile.mkdtemp(prefix="kimi-k3-pipconf-", dir=where + "/var/tmp"))
    conf = Path(str(outside / "pip.conf")[len(where):])  # the path as the launcher (host root) sees it
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
