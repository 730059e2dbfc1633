"""tools/pins/debian.py (version order, the resolver, the lock) and tools/fetch/debian.py (fetch,
mirror, extract and repo of .debs), through the one CLI `python3 -m tools.fetch.debian`.

Everything is generated here (Packages indexes, an archive under file://, tiny .debs built with
`dpkg-deb --build`): no network.
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError, run_cli  # noqa: E402
from tools.common.files import OUTPUT_MARKER, dir_replaced_atomically  # noqa: E402
from tools.fetch import debian as debian_fetch  # noqa: E402
from tools.pins import debian  # noqa: E402


@pytest.fixture(autouse=True)
def no_ambient_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KIMI_K3_MIRROR", raising=False)


# --- versions ----------------------------------------------------------------------------------

@pytest.mark.parametrize("a,b,expected", [
    ("1.0", "1.0", 0),
    ("1.0-1", "1.0-2", -1),
    ("1.0~rc1", "1.0", -1),           # ~ sorts before everything, even the end
    ("1.0", "1.0+deb12u1", -1),
    ("2.36-9+deb12u14", "2.36-9+deb12u7", 1),  # digit runs compare as numbers
    ("1:1.0", "2.0", 1),              # epoch first
    ("3.0.20-1~deb12u2", "3.0.20-1", -1),
    ("1.0a", "1.0", 1),
    ("1.0-1", "1.0", 1),
    ("10", "9", 1),
    ("1.0.0", "1.0", 1),
])
def test_compare_versions_follows_policy(a: str, b: str, expected: int) -> None:
    got = debian.compare_versions(a, b)
    assert (got > 0) - (got < 0) == expected
    got = debian.compare_versions(b, a)
    assert (got > 0) - (got < 0) == -expected


def test_compare_versions_agrees_with_dpkg() -> None:
    versions = ["1.0", "1.0~", "1.0~~", "1.0+b1", "1:0.1", "1.0-1~bpo1", "1.0-1", "1.0.1", "1.0a", "1.0-0",
                "12.2.0-14+deb12u1", "12.2.0-14", "2.40-2", "2.40-2+b1", "0.9"]
    for a in versions:
        for b in versions:
            dpkg_lt = subprocess.run(["dpkg", "--compare-versions", a, "lt", b]).returncode == 0
            assert (debian.compare_versions(a, b) < 0) == dpkg_lt, (a, b)


# --- resolver ----------------------------------------------------------------------------------

def stanza(name: str, version: str, depends: str = "", pre: str = "", provides: str = "", arch: str = "amd64") -> str:
    lines = [f"Package: {name}", f"Version: {version}", f"Architecture: {arch}"]
    if pre:
        lines.append(f"Pre-Depends: {pre}")
    if depends:
        lines.append(f"Depends: {depends}")
    if provides:
        lines.append(f"Provides: {provides}")
    digest = hashlib.sha256(f"{name}{version}".encode()).hexdigest()
    lines += [f"Filename: pool/main/{name[0]}/{name}/{name}_{version}_{arch}.deb", "Size: 100", f"SHA256: {digest}",
              "Description: test package", " continued description line"]
    return "\n".join(lines) + "\n"


MAIN = "\n".join([
    stanza("app", "1.0", depends="libfoo (>= 2), missing-pkg | libalt, virtual-mail, libbar:any", pre="dpkg (>= 1.15)"),
    stanza("libfoo", "2.1", depends="libc6"),
    stanza("libfoo", "1.0", depends="libold"),       # lower version: never chosen
    stanza("libalt", "1.0", depends="libc6 (>= 2.36)"),
    stanza("libc6", "2.36-9", depends="libgcc-s1"),
    stanza("libgcc-s1", "12.2.0", depends="gcc-12-base (= 12.2.0)"),
    stanza("gcc-12-base", "12.2.0"),
    stanza("postfix", "3.7", depends="perl-base", provides="virtual-mail"),
    stanza("exim4", "4.96", provides="virtual-mail"),  # sorts first among providers
    stanza("perl-base", "5.36"),
    stanza("libbar", "1.0", depends="debconf (>= 0.5) | debconf-2.0, tzdata"),
    stanza("dpkg", "1.21", depends="tar"),
    stanza("tzdata", "2024a"),
    stanza("libold", "1.0"),
    stanza("newer", "1.0", depends="libfoo (>= 3)"),
])
UPDATES = stanza("libfoo", "3.0", depends="libc6") + "\n" + stanza("tzdata", "2023a")


def index_of(*suites: tuple[str, str]) -> debian.Index:
    return debian.Index(c for text, suite in suites for c in debian.candidates_from_index(text, suite))


def test_resolver_closure_alternatives_provides_and_exclude() -> None:
    idx = index_of((MAIN, "bookworm"))
    closure = debian.resolve_closure(idx, ["app"], {"dpkg": "r", "debconf": "r"}, "t")
    names = [c.name for c in closure]
    assert names == sorted(names)
    # libalt: missing-pkg is not satisfiable, the next alternative is; exim4: first provider of
    # virtual-mail by name; dpkg (Pre-Depends) and debconf are excluded, so neither tar nor the
    # debconf-2.0 alternative is pulled; libold belongs to libfoo 1.0, which is not chosen.
    assert names == ["app", "exim4", "gcc-12-base", "libalt", "libbar", "libc6", "libfoo", "libgcc-s1", "tzdata"]
    assert {c.name: c.version for c in closure}["libfoo"] == "2.1"


def test_resolver_takes_the_highest_version_across_suites() -> None:
    idx = index_of((MAIN, "bookworm"), (UPDATES, "bookworm-updates"))
    closure = {c.name: c for c in debian.resolve_closure(idx, ["newer", "tzdata"], {}, "t")}
    assert closure["libfoo"].version == "3.0" and closure["libfoo"].suite == "bookworm-updates"
    assert closure["tzdata"].version == "2024a"  # the older one of -updates does not win
    with pytest.raises(UserError, match=r"newer 1.0 depends on libfoo \(>= 3\), which no package"):
        debian.resolve_closure(index_of((MAIN, "bookworm")), ["newer"], {}, "t")


def test_resolver_refuses_unknown_and_excluded_roots() -> None:
    idx = index_of((MAIN, "bookworm"))
    with pytest.raises(UserError, match="root package nosuch is not in the set's suites"):
        debian.resolve_closure(idx, ["nosuch"], {}, "t")
    with pytest.raises(UserError, match="root package app is also excluded"):
        debian.resolve_closure(idx, ["app"], {"app": "r"}, "t")
    with pytest.raises(UserError, match="root package virtual-mail is not in"):  # virtual names are no roots
        debian.resolve_closure(idx, ["virtual-mail"], {}, "t")


def test_meta_roots_and_provider_priority() -> None:
    text = "\n".join([
        stanza("base-files", "12") + "Essential: yes\nPriority: required\n",
        stanza("dash", "0.5", depends="awk") + "Essential: yes\nPriority: required\n",
        stanza("gawk", "5", provides="awk") + "Priority: optional\n",
        stanza("mawk", "1.3", provides="awk") + "Priority: required\n",
        stanza("apt", "2.6") + "Priority: required\n",
        stanza("vim", "9") + "Priority: optional\n",
    ])
    idx = index_of((text, "s"))
    # mawk (required) before gawk (optional) for `awk`, as apt prefers it
    assert [c.name for c in debian.resolve_closure(idx, ["?essential"], {}, "t")] == ["base-files", "dash", "mawk"]
    assert [c.name for c in debian.resolve_closure(idx, ["?priority(required)"], {"dash": "r"}, "t")] == \
        ["apt", "base-files", "mawk"]
    with pytest.raises(UserError, match=r"unknown root pattern \?standard"):
        debian.resolve_closure(idx, ["?standard"], {}, "t")


def test_check_installed_compares_names_and_versions(deb_lock: tuple[Path, Path]) -> None:
    lock, _ = deb_lock
    s = debian.load_set(lock, "tiny")
    ok = "".join(f"Package: {p.name}\nStatus: install ok installed\nVersion: {p.version}\n\n" for p in s.packages)
    debian.check_installed(s, ok, "root R")
    with pytest.raises(UserError, match=r"root R: installed packages differ .*not in the set: extra 1; in the set, "
                                        r"not installed: none"):
        debian.check_installed(s, ok + "Package: extra\nStatus: install ok installed\nVersion: 1\n", "root R")
    with pytest.raises(UserError, match=r"not in the set: hello 2.0; in the set, not installed: hello 1.0-1"):
        debian.check_installed(s, ok.replace("Version: 1.0-1", "Version: 2.0", 1), "root R")


def test_local_repository_lists_exactly_the_verified_debs(tmp_path: Path, deb_lock: tuple[Path, Path]) -> None:
    lock, _ = deb_lock
    s = debian.load_set(lock, "tiny")
    repo = debian_fetch.local_repository(s, tmp_path / "repo", cache_dir=tmp_path / "cache", mirrors=[])
    stanzas = debian.parse_stanzas((repo / "Packages").read_text())
    assert [(st["Package"], st["Version"], st["Filename"], st["SHA256"], int(st["Size"])) for st in stanzas] == \
        [(p.name, p.version, "./" + Path(p.filename).name, p.sha256, p.size) for p in s.packages]
    assert sorted(f.name for f in repo.iterdir()) == [OUTPUT_MARKER, "Packages", "hello_1.0-1_amd64.deb",
                                                     "libhello-dev_1.0-1_amd64.deb"]
    # A lock entry whose bytes are another package's .deb is refused, nothing is left behind.
    data = json.loads(lock.read_text())
    data["sets"]["tiny"]["packages"][0]["version"] = "9.9"
    lock.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"package hello 9.9: the verified .deb says hello 1.0-1"):
        debian_fetch.local_repository(debian.load_set(lock, "tiny"), tmp_path / "repo2", cache_dir=tmp_path / "cache",
                                mirrors=[])
    assert not (tmp_path / "repo2").exists() and leftovers(tmp_path, "repo2") == []


def test_versioned_relation_needs_a_versioned_provides() -> None:
    text = stanza("a", "1", depends="v (>= 2)") + "\n" + stanza("p", "1", provides="v") + "\n" + \
        stanza("q", "1", provides="v (= 2.5)")
    closure = debian.resolve_closure(index_of((text, "s")), ["a"], {}, "t")
    assert [c.name for c in closure] == ["a", "q"]


# --- archive indexes and the lock --------------------------------------------------------------

def make_archive(root: Path, suites: dict[str, str], arch: str = "amd64") -> str:
    """An archive under file://: dists/<suite>/InRelease (unsigned) listing Packages.xz."""
    for suite, text in suites.items():
        dist = root / "dists" / suite
        packages = dist / "main" / f"binary-{arch}" / "Packages.xz"
        packages.parent.mkdir(parents=True, exist_ok=True)
        data = lzma.compress(text.encode())
        packages.write_bytes(data)
        (dist / "InRelease").write_text(
            f"Origin: Test\nSuite: {suite}\nSHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} "
            f"main/binary-{arch}/Packages.xz\n")
    return root.as_uri()


def test_add_set_and_resolve_write_a_sorted_stable_lock(tmp_path: Path) -> None:
    archive = make_archive(tmp_path / "archive", {"bookworm": MAIN, "bookworm-updates": UPDATES})
    lock = tmp_path / "debian.lock.json"
    args = ["add-set", "demo", "--lock", str(lock), "--archive", archive, "--suite", "bookworm",
            "--suite", "bookworm-updates", "--packages", "app,newer", "--exclude", "dpkg=unpacked, not configured",
            "--exclude", "debconf", "--exclude-reason", "no questions asked", "--no-verify-signature"]
    assert debian_fetch.main(args) == 0
    first = lock.read_bytes()
    data = json.loads(first)
    demo = data["sets"]["demo"]
    assert data["schema_version"] == 1
    assert demo["exclude"] == {"dpkg": "unpacked, not configured", "debconf": "no questions asked"}
    assert demo["roots"] == ["app", "newer"] and demo["suites"] == ["bookworm", "bookworm-updates"]
    names = [p["name"] for p in demo["packages"]]
    assert names == sorted(names) and "dpkg" not in names and "tar" not in names
    libfoo = next(p for p in demo["packages"] if p["name"] == "libfoo")
    assert libfoo["version"] == "3.0"
    assert libfoo["urls"] == [f"{archive}/pool/main/l/libfoo/libfoo_3.0_amd64.deb"]
    assert first.endswith(b"\n") and b'  "schema_version": 1' in first
    # resolve from what the lock records: identical bytes
    assert debian_fetch.main(["resolve", "--set", "demo", "--lock", str(lock), "--no-verify-signature"]) == 0
    assert lock.read_bytes() == first


def test_index_that_does_not_match_inrelease_is_refused(tmp_path: Path) -> None:
    archive = make_archive(tmp_path / "archive", {"bookworm": MAIN})
    packages = tmp_path / "archive/dists/bookworm/main/binary-amd64/Packages.xz"
    packages.write_bytes(lzma.compress((MAIN + "\n" + stanza("evil", "1")).encode()))
    lock = tmp_path / "debian.lock.json"
    with pytest.raises(UserError, match=r"Packages.xz: .* InRelease says .* resolve again"):
        debian_fetch.main(["add-set", "demo", "--lock", str(lock), "--archive", archive, "--suite", "bookworm",
                     "--packages", "app", "--no-verify-signature"])
    assert not lock.exists()


def fake_gpgv(bin_dir: Path, exit_code: int, signed_text: str = "") -> None:
    """A stand-in gpgv on PATH (the sealed root has none): exits `exit_code`, printing
    `signed_text` as the verified content on stdout, the way `gpgv --output -` does."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "signed.txt").write_text(signed_text)
    script = bin_dir / "gpgv"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {bin_dir}/args\n"
                      + (f"cat {bin_dir}/signed.txt\n" if exit_code == 0 else
                         "echo 'gpgv: BAD signature from \"Test\"' >&2\n") + f"exit {exit_code}\n")
    script.chmod(0o755)


def test_inrelease_signature_is_checked_with_gpgv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = make_archive(tmp_path / "archive", {"bookworm": MAIN})
    keyring = tmp_path / "keyring.gpg"
    keyring.write_bytes(b"k")
    argv = ["add-set", "demo", "--lock", str(tmp_path / "l.json"), "--archive", archive, "--suite", "bookworm",
            "--packages", "app", "--exclude", "dpkg,debconf", "--exclude-reason", "r", "--keyring", str(keyring)]
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    fake_gpgv(bin_dir, 1)
    with pytest.raises(UserError, match=r"signature not verified by .*keyring.gpg \(gpgv: BAD signature"):
        debian_fetch.main(argv)
    assert not (tmp_path / "l.json").exists()
    assert (bin_dir / "args").read_text().split()[:2] == ["--keyring", str(keyring)]
    # Only what gpgv says was signed counts: here that text lists another Packages.xz digest.
    fake_gpgv(bin_dir, 0, "Suite: bookworm\nSHA256:\n " + "0" * 64 + " 5 main/binary-amd64/Packages.xz\n")
    with pytest.raises(UserError, match="InRelease says 5 bytes"):
        debian_fetch.main(argv)
    release = (tmp_path / "archive/dists/bookworm/InRelease").read_text()
    fake_gpgv(bin_dir, 0, release)
    assert debian_fetch.main(argv) == 0
    with pytest.raises(UserError, match="keyring .* not found"):
        debian_fetch.main(argv[:-1] + [str(tmp_path / "none.gpg")])


def test_lock_validation_names_the_set_and_the_fix(tmp_path: Path) -> None:
    lock = tmp_path / "debian.lock.json"
    entry = {"name": "app", "version": "1", "architecture": "amd64", "filename": "pool/main/a/app/app_1_amd64.deb",
             "size": 1, "sha256": "0" * 64, "urls": ["http://x/pool/main/a/app/app_1_amd64.deb"]}
    base = {"description": "", "archive": "http://x", "suites": ["s"], "architecture": "amd64", "roots": ["app"],
            "exclude": {}, "packages": [entry]}
    lock.write_text(json.dumps({"schema_version": 1, "sets": {"demo": base}}))
    assert [p.name for p in debian.load_set(lock, "demo").packages] == ["app"]
    for broken, message in [
        ({**base, "exclude": {"dpkg": ""}}, "excluded package dpkg needs a reason"),
        ({**base, "packages": [{**entry, "sha256": "xyz"}]}, "is not 64 hex digits"),
        ({**base, "packages": [{**entry, "filename": "../../etc/passwd.deb"}]}, "is not a pool path"),
        ({**base, "packages": [entry, entry]}, "sorted by name, each once"),
    ]:
        lock.write_text(json.dumps({"schema_version": 1, "sets": {"demo": broken}}))
        with pytest.raises(UserError, match=message):
            debian.load_set(lock, "demo")
    with pytest.raises(UserError, match="no set 'other'"):
        lock.write_text(json.dumps({"schema_version": 1, "sets": {"demo": base}}))
        debian.load_set(lock, "other")


# --- fetch, mirror, extract --------------------------------------------------------------------

def build_deb(work: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    root = work / f"{name}-build"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: amd64\nMaintainer: Test <t@example.org>\n"
        f"Description: test package {name}\n")
    # A maintainer script that must never run: extraction unpacks data only.
    (root / "DEBIAN" / "postinst").write_text(f"#!/bin/sh\ntouch {work}/POSTINST-RAN\n")
    os.chmod(root / "DEBIAN" / "postinst", 0o755)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    out = work / f"{name}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(out)], check=True,
                   capture_output=True)
    shutil.rmtree(root)
    return out


@pytest.fixture()
def deb_lock(tmp_path: Path) -> tuple[Path, Path]:
    """A lock with set 'tiny' (two generated .debs served from a file:// pool) and its pool."""
    pool = tmp_path / "archive"
    entries = []
    for name, files in [("hello", {"usr/bin/hello": b"#!/bin/sh\necho hi\n"}),
                        ("libhello-dev", {"usr/include/hello.h": b"int hello(void);\n"})]:
        deb = build_deb(tmp_path, name, "1.0-1", files)
        filename = f"pool/main/h/{name}/{deb.name}"
        (pool / filename).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(deb, pool / filename)
        data = (pool / filename).read_bytes()
        entries.append({"name": name, "version": "1.0-1", "architecture": "amd64", "filename": filename,
                        "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "urls": [f"{pool.as_uri()}/{filename}"]})
    lock = tmp_path / "debian.lock.json"
    lock.write_text(json.dumps({"schema_version": 1, "sets": {"tiny": {
        "description": "", "archive": pool.as_uri(), "suites": ["s"], "architecture": "amd64",
        "roots": ["hello", "libhello-dev"], "exclude": {}, "packages": entries}}}))
    return lock, pool


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}"))


def test_extract_unpacks_verified_debs_and_records_the_set(tmp_path: Path, deb_lock: tuple[Path, Path],
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    lock, _ = deb_lock
    out = tmp_path / "tree"
    assert debian_fetch.extract_set(lock, "tiny", out, cache_dir=tmp_path / "cache", mirrors=[]) == out.absolute()
    assert (out / "usr/bin/hello").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert (out / "usr/include/hello.h").read_bytes() == b"int hello(void);\n"
    assert not (tmp_path / "POSTINST-RAN").exists() and not (out / "DEBIAN").exists()
    marker = (out / debian.SET_MARKER).read_bytes()
    assert json.loads(marker) == {"name": "tiny", "packages": debian.load_set(lock, "tiny").entries()}
    assert b" " not in marker.replace(b"test package", b"")  # canonical JSON: no spaces
    assert "2/2 .debs verified" in capfd.readouterr().err
    # Again from the cache alone (origin gone): the same tree, replaced in one rename.
    shutil.rmtree(tmp_path / "archive")
    debian_fetch.extract_set(lock, "tiny", out, cache_dir=tmp_path / "cache", mirrors=[])
    assert (out / debian.SET_MARKER).read_bytes() == marker
    assert leftovers(tmp_path, "tree") == []


def test_mirror_fills_basenames_and_serves_an_offline_extract(tmp_path: Path, deb_lock: tuple[Path, Path]) -> None:
    lock, pool = deb_lock
    mirror = tmp_path / "mirror"
    assert run_cli(debian_fetch.main, ["mirror", str(mirror), "--set", "tiny", "--lock", str(lock),
                                 "--cache", str(tmp_path / "cache1")]) == 0
    assert sorted(p.name for p in mirror.iterdir()) == ["hello_1.0-1_amd64.deb", "libhello-dev_1.0-1_amd64.deb"]
    shutil.rmtree(pool)  # the origin is unreachable now; a fresh cache must come from the mirror
    out = debian_fetch.extract_set(lock, "tiny", tmp_path / "tree", cache_dir=tmp_path / "cache2", mirrors=[mirror])
    assert (out / "usr/bin/hello").is_file()


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert run_cli(debian_fetch.main, argv) == 2
    lines = capsys.readouterr().err.splitlines()  # progress lines, then the error
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    return lines[-1]


def test_python_m_tools_fetch_debian_runs_every_command(tmp_path: Path, deb_lock: tuple[Path, Path]) -> None:
    """The command users and tools/bazel run keeps every subcommand, the fetch stage's included."""
    lock, _ = deb_lock
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("KIMI_K3_MIRROR", None)
    cli = [sys.executable, "-m", "tools.fetch.debian"]
    helptext = subprocess.run([*cli, "--help"], capture_output=True, text=True, env=env, check=True).stdout
    for command in ("resolve", "add-set", "mirror", "extract", "repo", "check-root", "key", "show"):
        assert command in helptext, command
    out = tmp_path / "tree"
    proc = subprocess.run([*cli, "extract", "--set", "tiny", "--out", str(out), "--lock", str(lock),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == str(out.absolute()), proc.stderr
    assert (out / debian.SET_MARKER).is_file()
    key = subprocess.run([*cli, "key", "--set", "tiny", "--lock", str(lock)], capture_output=True, text=True,
                         env=env, check=True).stdout.strip()
    assert key == debian.load_set(lock, "tiny").content_key()


def test_flipped_byte_in_the_mirror_is_a_one_line_error_and_nothing_is_written(
        tmp_path: Path, deb_lock: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    lock, pool = deb_lock
    mirror = tmp_path / "mirror"
    debian_fetch.mirror_set(debian.load_set(lock, "tiny"), mirror, cache_dir=tmp_path / "cache1", mirrors=[])
    shutil.rmtree(pool)
    deb = mirror / "libhello-dev_1.0-1_amd64.deb"
    data = bytearray(deb.read_bytes())
    data[len(data) // 2] ^= 0x01
    deb.write_bytes(bytes(data))
    capsys.readouterr()
    err = one_line_error(capsys, ["extract", "--set", "tiny", "--out", str(tmp_path / "tree"), "--lock", str(lock),
                                  "--cache", str(tmp_path / "cache2"), "--mirror", str(mirror)])
    assert "pin 'tiny/libhello-dev'" in err and "sha256 mismatch" in err
    assert "python3 -m tools.fetch.debian mirror DIR --set tiny" in err
    assert not (tmp_path / "tree").exists() and leftovers(tmp_path, "tree") == []
    assert not any((tmp_path / "cache2" / "tmp").iterdir())


def test_missing_mirror_file_and_removed_version_name_the_package_and_the_fix(
        tmp_path: Path, deb_lock: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    lock, pool = deb_lock
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (pool / "pool/main/h/hello/hello_1.0-1_amd64.deb").unlink()  # Debian dropped the version
    err = one_line_error(capsys, ["extract", "--set", "tiny", "--out", str(tmp_path / "tree"), "--lock", str(lock),
                                  "--cache", str(tmp_path / "cache")])
    assert "pin 'tiny/hello'" in err and "python3 -m tools.fetch.debian mirror DIR --set tiny" in err
    assert not (tmp_path / "tree").exists() and leftovers(tmp_path, "tree") == []
    err = one_line_error(capsys, ["mirror", str(tmp_path / "m2"), "--set", "tiny", "--lock", str(lock),
                                  "--cache", str(tmp_path / "cache"), "--mirror", str(mirror)])
    assert f"mirror {mirror}: no hello_1.0-1_amd64.deb" in err and "--set tiny" in err


def test_a_deb_dpkg_deb_cannot_read_leaves_no_tree(tmp_path: Path, deb_lock: tuple[Path, Path]) -> None:
    lock, pool = deb_lock
    bogus = pool / "pool/main/h/hello/hello_1.0-1_amd64.deb"
    bogus.write_bytes(b"not an ar archive\n")
    data = json.loads(lock.read_text())
    entry = data["sets"]["tiny"]["packages"][0]
    entry["size"], entry["sha256"] = bogus.stat().st_size, hashlib.sha256(bogus.read_bytes()).hexdigest()
    lock.write_text(json.dumps(data))
    out = tmp_path / "tree"
    with dir_replaced_atomically(out, "--out", tool=debian_fetch.EXTRACT_TOOL) as previous:
        (previous / "old").write_text("previous tree\n")
    with pytest.raises(UserError, match="package hello: dpkg-deb -x failed"):
        debian_fetch.extract_set(lock, "tiny", out, cache_dir=tmp_path / "cache", mirrors=[])
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "old"] and leftovers(tmp_path, "tree") == []


# Entry fields that would pass through to a tree, a file name or a Packages index: (field, value,
# what the error says). The first entry ('hello') gets the value; every bad name still sorts first.
BAD_ENTRIES = {
    "name-path": ("name", "../../libkeyutils1", "package '../../libkeyutils1': not a Debian package name"),
    "name-upper": ("name", "LibKeyutils1", "package 'LibKeyutils1': not a Debian package name"),
    "name-newline": ("name", "hello\nEssential: yes", "package 'hello\\nEssential: yes': not a Debian package name"),
    "name-one-char": ("name", "h", "package 'h': not a Debian package name"),
    "version-newline": ("version", "1.0-1\nEssential: yes", "package hello: version '1.0-1\\nEssential: yes' is not"),
    "version-letter-first": ("version", "v1.0-1", "package hello: version 'v1.0-1' is not a Debian version"),
    "version-empty-revision": ("version", "1.0-", "package hello: version '1.0-' is not a Debian version"),
    "version-space": ("version", "1.0 -1", "package hello: version '1.0 -1' is not a Debian version"),
    "architecture-other": ("architecture", "arm64", "package hello: architecture 'arm64' is neither the set's 'amd64'"),
    "filename-field": ("filename", "pool/main/h/hello/hello_1.0-1_amd64.deb\nFilename: evil.deb",
                       "package hello: filename 'pool/main/h/hello/hello_1.0-1_amd64.deb\\nFilename: evil.deb' is not"),
    "filename-dot": ("filename", "pool/main/h/./hello_1.0-1_amd64.deb", "filename 'pool/main/h/./hello_1.0-1_amd64.deb' is not"),
    "filename-empty-part": ("filename", "pool//hello_1.0-1_amd64.deb", "filename 'pool//hello_1.0-1_amd64.deb' is not"),
    "filename-tab": ("filename", "pool/main/h/hello/hello\t1.0-1_amd64.deb", "filename 'pool/main/h/hello/hello\\t1.0"),
}
RESOLVE_FIX = "fix the entry or re-resolve with `python3 -m tools.fetch.debian resolve --set tiny`"


def break_first_entry(lock: Path, field: str, value: str) -> None:
    data = json.loads(lock.read_text())
    data["sets"]["tiny"]["packages"][0][field] = value
    lock.write_text(json.dumps(data))


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
@pytest.mark.parametrize("command", ["show", "extract", "repo"])
def test_malformed_entry_is_refused_at_load_by_every_command(command: str, case: str, tmp_path: Path,
                                                             deb_lock: tuple[Path, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Names, versions and pool paths reach .debian-set.json, file names and a Packages index."""
    field, value, message = BAD_ENTRIES[case]
    lock, _ = deb_lock
    break_first_entry(lock, field, value)
    out = tmp_path / "out"
    argv = [command, "--set", "tiny", "--lock", str(lock)]
    if command != "show":
        argv += ["--out", str(out), "--cache", str(tmp_path / "cache")]
    err = one_line_error(capsys, argv)
    assert err.startswith(f"error: {lock}: set 'tiny' package ") and message in err, err
    assert err.endswith(RESOLVE_FIX), err
    assert not out.exists() and leftovers(tmp_path, "out") == [] and not (tmp_path / "cache").exists()


def test_every_subcommand_loads_through_the_validation(tmp_path: Path, deb_lock: tuple[Path, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lock, _ = deb_lock
    root = tmp_path / "root"
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text("")
    break_first_entry(lock, "name", "../../libkeyutils1")
    before = lock.read_bytes()
    for argv in (["mirror", str(tmp_path / "mirror"), "--set", "tiny"], ["key", "--set", "tiny"],
                 ["check-root", "--set", "tiny", "--root", str(root)],
                 ["resolve", "--set", "tiny", "--no-verify-signature"]):
        err = one_line_error(capsys, argv + ["--lock", str(lock)])
        assert "package '../../libkeyutils1': not a Debian package name" in err, (argv, err)
    assert not (tmp_path / "mirror").exists() and lock.read_bytes() == before


@pytest.mark.parametrize("stanza_text, message", [
    (stanza("tzdata", "2024a beta"), "package tzdata: version '2024a beta' is not a Debian version"),
    (stanza("tzdata", "2024a", arch="arm64"), "package tzdata: architecture 'arm64' is neither the set's 'amd64'"),
    (stanza("tzdata", "2024a").replace("Filename: pool/main/t/", "Filename: pool/main/t/./"),
     "package tzdata: filename 'pool/main/t/./tzdata/tzdata_2024a_amd64.deb' is not a pool path"),
], ids=["version", "architecture", "filename"])
def test_resolve_never_writes_an_entry_the_loader_refuses(stanza_text: str, message: str, tmp_path: Path) -> None:
    archive = make_archive(tmp_path / "archive", {"bookworm": stanza_text})
    lock = tmp_path / "debian.lock.json"
    with pytest.raises(UserError, match=re.escape(message)):
        debian_fetch.main(["add-set", "demo", "--lock", str(lock), "--archive", archive, "--suite", "bookworm",
                     "--packages", "tzdata", "--no-verify-signature"])
    assert not lock.exists()


@pytest.mark.parametrize("field, value, message", [
    ("roots", ["hello", "Hello"], "root 'Hello' is neither a Debian package name"),
    ("exclude", {"x\ny": "a reason"}, "excluded name 'x\\ny' is not a Debian package name"),
    ("suites", ["../../etc"], "suite '../../etc' is not a suite name"),
    ("architecture", "amd64\n", "architecture 'amd64\\n' is not a Debian architecture name"),
])
def test_set_inputs_are_validated_at_load(field: str, value: object, message: str, deb_lock: tuple[Path, Path]) -> None:
    lock, _ = deb_lock
    data = json.loads(lock.read_text())
    data["sets"]["tiny"][field] = value
    lock.write_text(json.dumps(data))
    with pytest.raises(UserError, match=re.escape(message)):
        debian.load_set(lock, "tiny")


def test_version_syntax_follows_policy() -> None:
    good = ["1.0", "1.0-1", "1:2.36-9+deb12u7", "1.0~rc1-0~bpo12+1", "2024a-0+deb12u1", "1.0-1-2", "0"]
    bad = ["", "v1", "1.0-", "-1", ":1.0", "a:1.0", "1:2:3", "1.0 1", "1.0_1", "1.0-a_b", "1.0\n", "1.0-1\n"]
    assert [v for v in good if not debian.is_version(v)] == []
    assert [v for v in bad if debian.is_version(v)] == []


def test_content_key_follows_the_entries(deb_lock: tuple[Path, Path]) -> None:
    lock, _ = deb_lock
    s = debian.load_set(lock, "tiny")
    data = json.loads(lock.read_text())
    data["sets"]["tiny"]["packages"][1]["version"] = "1.0-2"
    lock.write_text(json.dumps(data))
    assert debian.load_set(lock, "tiny").content_key() != s.content_key()
    data["sets"]["tiny"]["description"] = "only the description changed"
    data["sets"]["tiny"]["packages"][1]["version"] = "1.0-1"
    lock.write_text(json.dumps(data))
    assert debian.load_set(lock, "tiny").content_key() == s.content_key()


@pytest.fixture()
def http_pool(deb_lock: tuple[Path, Path]) -> Iterator[str]:
    """The fixture's archive served over HTTP on 127.0.0.1 (a real 404 for a removed file)."""
    _, pool = deb_lock
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(pool))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_a_version_gone_from_the_pool_says_re_resolve_or_mirror(tmp_path: Path, deb_lock: tuple[Path, Path],
                                                                http_pool: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    lock, pool = deb_lock
    data = json.loads(lock.read_text())
    for entry in data["sets"]["tiny"]["packages"]:
        entry["urls"] = [f"{http_pool}/{entry['filename']}"]
    lock.write_text(json.dumps(data))
    (pool / "pool/main/h/hello/hello_1.0-1_amd64.deb").unlink()
    err = one_line_error(capsys, ["extract", "--set", "tiny", "--out", str(tmp_path / "tree"), "--lock", str(lock),
                                  "--cache", str(tmp_path / "cache")])
    assert "pin 'tiny/hello'" in err and "HTTP 404" in err
    assert "the origin no longer has it: re-resolve with `python3 -m tools.fetch.debian resolve --set tiny`" in err
    assert "`python3 -m tools.fetch.debian mirror DIR --set tiny`" in err
    assert not (tmp_path / "tree").exists()


def test_the_checked_in_lock_is_consistent() -> None:
    """Every set of third_party/debian.lock.json loads, holds its roots, none of its exclusions,
    and points each package at its archive's pool; re-resolving would not reorder it."""
    lock = REPO_ROOT / "third_party" / "debian.lock.json"
    sets = debian.load_sets(lock)
    assert "kernel-userland" in sets
    for s in sets.values():
        names = {p.name for p in s.packages}
        assert {r for r in s.roots if not r.startswith("?")} <= names, s.name
        assert not names & set(s.exclude), s.name
        for p in s.packages:
            assert p.urls[0] == f"{s.archive}/{p.filename}" and p.architecture in (s.architecture, "all")
    assert debian.review_json(debian.read_raw(lock)) == lock.read_bytes()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_extract_and_repo_refuse_a_users_directory_and_keep_it(tmp_path: Path, deb_lock: tuple[Path, Path]) -> None:
    """`extract --out DIR` replaced a directory of the user's whole. Refused now, in one line,
    before any download; its own previous output is still replaced."""
    lock, _ = deb_lock
    users = tmp_path / "mine"
    (users / ".git").mkdir(parents=True)
    (users / "notes.txt").write_text("keep\n")
    for call in (lambda: debian_fetch.extract_set(lock, "tiny", users, cache_dir=tmp_path / "cache", mirrors=[]),
                 lambda: debian_fetch.local_repository(debian.load_set(lock, "tiny"), users,
                                                       cache_dir=tmp_path / "cache", mirrors=[])):
        with pytest.raises(UserError) as e:
            call()
        assert "exists, is not empty and holds files that tools.fetch.debian" in str(e.value)
        assert sorted(p.name for p in users.iterdir()) == [".git", "notes.txt"]
    assert not (tmp_path / "cache").exists()  # refused before any download
    with pytest.raises(UserError, match="not a directory; pass a path under a directory"):
        debian_fetch.extract_set(lock, "tiny", users / "notes.txt" / "out", cache_dir=tmp_path / "cache", mirrors=[])


def test_the_old_cli_name_points_to_the_new_one() -> None:
    """The CLI moved to the fetch stage (no import points from pins up to fetch); the old command
    line is refused in one line naming the new one, never silently ignored."""
    proc = subprocess.run([sys.executable, "-m", "tools.pins.debian", "key", "--set", "tiny"],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: the Debian CLI is `python3 -m tools.fetch.debian key --set tiny` "
                           "(this module is its lock library)\n")
