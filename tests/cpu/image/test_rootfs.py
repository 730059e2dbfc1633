"""tools/image/rootfs.py debian: the base rootfs from a Debian set of the lock.

The cache key follows the set's entries (and nothing else of the lock); the cached tar is
re-hashed on use; the root must hold exactly the set. mmdebstrap is a stand-in on PATH (the real
one needs root and minutes; the real build's times: docs/measurements/): it records its
arguments and writes a tar whose dpkg status lists the packages of its only mirror. No network.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.image import rootfs, sbom  # noqa: E402
from tools.pins import debian  # noqa: E402
from tools.pins import lock as lockfile  # noqa: E402

FAKE_MMDEBSTRAP = r'''
import io, json, os, re, sys, tarfile
args = sys.argv[1:]
if args == ["--version"]:
    print("mmdebstrap 0.0-fake"); sys.exit(0)
with open(os.environ["FAKE_MMDEBSTRAP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
suite, out, mirror = [a for a in args if not a.startswith("--")]
repo = re.fullmatch(r"deb \[trusted=yes\] copy://(/\S+) \./", mirror).group(1)
include = next(a for a in args if a.startswith("--include=")).split("=", 1)[1].split(",")
drop = os.environ.get("FAKE_MMDEBSTRAP_DROP")
status = []
for stanza in open(os.path.join(repo, "Packages")).read().split("\n\n"):
    fields = dict(l.split(": ", 1) for l in stanza.splitlines() if ": " in l and not l.startswith(" "))
    if fields.get("Package") in include and fields["Package"] != drop:
        status.append(f"Package: {fields['Package']}\nStatus: install ok installed\nVersion: {fields['Version']}\n")
if os.environ.get("FAKE_MMDEBSTRAP_FAIL"):
    open(out, "wb").write(b"half"); sys.exit(1)
with tarfile.open(out, "w") as tar:
    data = "\n".join(status).encode()
    info = tarfile.TarInfo("./var/lib/dpkg/status"); info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
'''


def build_deb(work: Path, name: str, version: str) -> Path:
    root = work / f"{name}-build"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: {version}\nArchitecture: amd64\n"
                                             f"Maintainer: T <t@example.org>\nDescription: {name}\n")
    (root / "usr/share" / name).mkdir(parents=True)
    (root / "usr/share" / name / "file").write_text(f"{name} {version}\n")
    out = work / f"{name}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(out)], check=True,
                   capture_output=True)
    shutil.rmtree(root)
    return out


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A lock with set 'base' (two generated .debs in a mirror dir), a cache and a fake mmdebstrap."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    entries = []
    for name, version in [("base-files", "1"), ("python3", "3.11.2-1")]:
        deb = build_deb(tmp_path, name, version)
        shutil.move(deb, mirror / deb.name)
        data = (mirror / deb.name).read_bytes()
        entries.append({"name": name, "version": version, "architecture": "amd64",
                        "filename": f"pool/main/x/{name}/{deb.name}", "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "urls": [f"http://127.0.0.1:9/pool/main/x/{name}/{deb.name}"]})  # unreachable origin
    lock = tmp_path / "debian.lock.json"
    lock.write_text(json.dumps({"schema_version": 1, "sets": {"base": {
        "description": "test", "archive": "http://deb.example.org/debian", "suites": ["bookworm"],
        "architecture": "amd64", "roots": ["python3"], "exclude": {}, "packages": entries}}}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "mmdebstrap"
    fake.write_text(f"#!{sys.executable}\n{FAKE_MMDEBSTRAP}")
    fake.chmod(0o755)
    log = tmp_path / "mmdebstrap.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MMDEBSTRAP_LOG", str(log))
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KIMI_K3_MIRROR", str(mirror))
    return {"lock": lock, "mirror": mirror, "log": log, "cache": tmp_path / "cache"}


def runs(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def edit_set(lock: Path, **changes: object) -> None:
    data = json.loads(lock.read_text())
    for key, value in changes.items():
        if key == "version0":
            data["sets"]["base"]["packages"][0]["version"] = value
        else:
            data["sets"]["base"][key] = value
    lock.write_text(json.dumps(data))


def test_key_follows_the_set_entries_only(env: dict[str, Path]) -> None:
    lock = env["lock"]
    key = rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000000, "mmdebstrap 1")
    assert key == rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000000, "mmdebstrap 1")
    assert key != rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000001, "mmdebstrap 1")
    assert key != rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000000, "mmdebstrap 2")
    edit_set(lock, description="only words changed", roots=["python3", "base-files"])
    assert rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000000, "mmdebstrap 1") == key
    edit_set(lock, version0="2")  # one locked package changed
    assert rootfs.rootfs_key(debian.load_set(lock, "base"), 1700000000, "mmdebstrap 1") != key


def test_built_from_the_verified_debs_only_then_cached_and_rehashed(tmp_path: Path, env: dict[str, Path],
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "base.tar"
    digest = rootfs.debian_rootfs(out, env["lock"], "base", 1700000000)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    (args,) = runs(env["log"])
    mirror_args = [a for a in args if a.startswith("deb ")]
    assert len(mirror_args) == 1 and mirror_args[0].startswith("deb [trusted=yes] copy:///")
    assert "--variant=custom" in args and "--include=base-files,python3" in args
    assert any("deb http://deb.example.org/debian bookworm main" in a for a in args if a.startswith("--customize"))
    cached = next((env["cache"] / "rootfs").glob("base-*.tar"))
    assert (cached.parent / (cached.name + ".sha256")).read_text().strip() == digest
    assert [p.name for p in (env["cache"] / "rootfs").iterdir() if p.name.startswith(".")] == []  # no temps
    # Again: from the cache, re-hashed, no mmdebstrap.
    assert rootfs.debian_rootfs(tmp_path / "again.tar", env["lock"], "base", 1700000000) == digest
    assert len(runs(env["log"])) == 1
    # A flipped byte in the cached tar: noticed on use, built again.
    data = bytearray(cached.read_bytes())
    data[100] ^= 1
    os.chmod(cached, 0o644)
    cached.write_bytes(bytes(data))
    capfd.readouterr()
    assert rootfs.debian_rootfs(tmp_path / "third.tar", env["lock"], "base", 1700000000) == digest
    assert len(runs(env["log"])) == 2 and "is corrupt" in capfd.readouterr().err
    # One locked package changed: another key, another build.
    edit_set(env["lock"], version0="2")
    with pytest.raises(UserError, match="base-files"):  # the mirror's .deb no longer matches the lock
        rootfs.debian_rootfs(tmp_path / "fourth.tar", env["lock"], "base", 1700000000)


def test_a_root_that_is_not_exactly_the_set_is_refused(tmp_path: Path, env: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MMDEBSTRAP_DROP", "base-files")
    with pytest.raises(UserError, match=r"installed packages differ from set 'base' .*in the set, not installed: "
                                        r"base-files 1\)"):
        rootfs.debian_rootfs(tmp_path / "base.tar", env["lock"], "base", 1700000000)
    monkeypatch.delenv("FAKE_MMDEBSTRAP_DROP")
    monkeypatch.setenv("FAKE_MMDEBSTRAP_FAIL", "1")
    with pytest.raises(UserError, match="mmdebstrap of Debian set 'base' failed"):
        rootfs.debian_rootfs(tmp_path / "base.tar", env["lock"], "base", 1700000000)
    assert not (tmp_path / "base.tar").exists()
    assert [p.name for p in (env["cache"] / "rootfs").iterdir()] == []  # nothing cached, no temps


def test_missing_deb_names_the_package_and_the_fill_command(tmp_path: Path, env: dict[str, Path]) -> None:
    (env["mirror"] / "python3_3.11.2-1_amd64.deb").unlink()
    with pytest.raises(UserError, match=r"pin 'base/python3'.*python3 -m tools.fetch.debian mirror DIR --set base"):
        rootfs.debian_rootfs(tmp_path / "base.tar", env["lock"], "base", 1700000000)
    assert runs(env["log"]) == [] and not (tmp_path / "base.tar").exists()


def test_sbom_lists_every_base_package_with_version_and_sha256(tmp_path: Path, env: dict[str, Path]) -> None:
    pins = tmp_path / "pins.lock.json"
    lockfile.write(pins, {"schema_version": 1, "pins": {}, "stacks": {"tiny": {}}})
    out = tmp_path / "sbom.json"
    assert sbom.main(["--lock", str(pins), "--stack", "tiny", "--debian-lock", str(env["lock"]), "--debian-set",
                      "base", "--out", str(out), "--source-date-epoch", "1700000000"]) == 0
    doc = json.loads(out.read_text())
    debs = {p["name"]: p for p in doc["packages"] if p["SPDXID"].startswith("SPDXRef-Deb-")}
    for entry in json.loads(env["lock"].read_text())["sets"]["base"]["packages"]:
        pkg = debs[entry["name"]]
        assert pkg["versionInfo"] == entry["version"]
        assert pkg["checksums"] == [{"algorithm": "SHA256", "checksumValue": entry["sha256"]}]
        assert pkg["externalRefs"][0]["referenceLocator"] == f"pkg:deb/debian/{entry['name']}@{entry['version']}?arch=amd64"
    assert len(debs) == 2
    with pytest.raises(UserError, match="--debian-lock and --debian-set go together"):
        sbom.main(["--lock", str(pins), "--stack", "tiny", "--debian-set", "base", "--out", str(out),
                   "--source-date-epoch", "1700000000"])


def test_the_cache_root_of_a_bazel_action_comes_from_its_file(tmp_path: Path, env: dict[str, Path]) -> None:
    # Bazel actions run without $KIMI_K3_CACHE: the @debian_<set> repository records the root.
    recorded = tmp_path / "recorded-cache"
    (tmp_path / "cache_root.txt").write_text(f"{recorded}\n")
    assert rootfs.main(["debian", "--out", str(tmp_path / "base.tar"), "--lock", str(env["lock"]), "--set", "base",
                        "--cache-root-file", str(tmp_path / "cache_root.txt"), "--source-date-epoch",
                        "1700000000"]) == 0
    assert len(list((recorded / "rootfs").glob("base-*.tar"))) == 1
    assert list((recorded / "cas" / "sha256").iterdir())  # the .debs were fetched into it too
    assert not env["cache"].exists()


def test_rootfs_tar_members_are_read_not_trusted(tmp_path: Path) -> None:
    tar_path = tmp_path / "x.tar"
    with tarfile.open(tar_path, "w"):
        pass
    with pytest.raises(UserError, match="no var/lib/dpkg/status"):
        rootfs.dpkg_status_of(tar_path)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def test_pull_base_refuses_a_users_directory_before_pulling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pull --out DIR` removed DIR when it existed; a user's directory is refused now, before skopeo runs."""
    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep\n")
    pulled = []
    monkeypatch.setattr(rootfs.subprocess, "run", lambda *a, **k: pulled.append(a))
    with pytest.raises(UserError) as e:
        rootfs.pull_base("127.0.0.1:5000/base@sha256:" + "0" * 64, users)
    assert str(e.value).startswith(f"--out {users}: exists, is not empty and holds files that "
                                   f"{rootfs.PULL_TOOL} did not write")
    assert pulled == [] and [p.name for p in users.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
