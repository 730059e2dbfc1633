"""tools/rbe exec_image: the exec root as an OCI image, built from a stand-in root in tmp_path.

The layers hold exactly what a loopback worker's bubblewrap binds (the root's /usr, /etc and its
/bin link; the Python prefix and the venvs at their own paths), nothing else of the host; the
same root gives the same manifest digest; bad input is one line and writes nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

REPO_ROOT = Path(__file__).absolute().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.common.errors import UserError  # noqa: E402
from tools.image import compression  # noqa: E402
from tools.image.layout import blob_path, read_index_manifest  # noqa: E402
from tools.image.registry_client import Repository  # noqa: E402
from tools.rbe import exec_image, exec_root  # noqa: E402

EPOCH = 1767225600


def stand_in(tmp_path: Path) -> exec_root.ExecRoot:
    """A tiny sealed root (with what the image must leave out), a Python prefix and venvs."""
    root, prefix, venvs = tmp_path / "root", tmp_path / "py" / "3.11", tmp_path / "cache" / "venvs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "lib").mkdir()
    (root / "usr" / "lib64").mkdir()
    (root / "usr" / "bin" / "sh").write_text("#!stand-in shell\n")
    (root / "usr" / "bin" / "sh").chmod(0o700)
    (root / "usr" / "lib" / "libc.so.6").write_text("libc\n")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "etc" / "shadow").write_text("root:*::\n")
    (root / "etc" / "shadow").chmod(0o600)
    for name in ("bin", "lib", "lib64", "sbin"):
        (root / name).symlink_to(f"usr/{name}")
    # Not bound by a worker: not in the image.
    (root / "usr" / "sbin").mkdir()
    (root / "var" / "log").mkdir(parents=True)
    (root / "var" / "log" / "host.log").write_text("not for actions\n")
    (root / "home").mkdir()
    (root / ".kimi-k3-complete").write_text("")
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python3.11").write_text("#!stand-in python\n")
    (prefix / "bin" / "python3.11").chmod(0o755)
    (prefix / "bin" / "python3").symlink_to("python3.11")
    (tmp_path / "py" / "other-version").mkdir()  # beside the prefix: not in the image
    (tmp_path / "py" / "other-version" / "python").write_text("other\n")
    (venvs / "tools-abc" / "bin").mkdir(parents=True)
    (venvs / "tools-abc" / "bin" / "python3").symlink_to(prefix / "bin" / "python3.11")
    (venvs / "tools-abc" / "pyvenv.cfg").write_text(f"home = {prefix / 'bin'}\n")
    (tmp_path / "cache" / "cas").mkdir()  # the rest of the cache root: not in the image
    (tmp_path / "cache" / "cas" / "blob").write_text("cached\n")
    return exec_root.ExecRoot(root, prefix, venvs)


def layer_members(layout: Path) -> dict[str, dict[str, tuple[str, str, int]]]:
    """Layer name -> {path: (kind, link target, mode)}, read from the blobs."""
    _, manifest_bytes = read_index_manifest(layout)
    manifest = json.loads(manifest_bytes)
    layers = {}
    for desc in manifest["layers"]:
        members = {}
        with compression.open_layer_blob(blob_path(layout, desc["digest"])) as tf:
            for m in tf:
                kind = "dir" if m.isdir() else "symlink" if m.issym() else "file" if m.isreg() else "other"
                members[m.name] = (kind, m.linkname, m.mode)
                assert (m.uid, m.gid, m.mtime) == (0, 0, EPOCH), m.name
        layers[desc["annotations"]["org.kimi-k3.layer"]] = members
    return layers


def at_own_path(path: Path) -> set[str]:
    """A host path's image path and each of its parents (relative to /, as tar names them)."""
    rel = PurePosixPath(str(path)).relative_to("/")
    return {str(rel), *(str(p) for p in rel.parents if str(p) != ".")}


def test_layers_hold_exactly_what_a_worker_binds(tmp_path: Path) -> None:
    er = stand_in(tmp_path)
    image = exec_image.build(er, tmp_path / "out" / "image", EPOCH, progress=False)
    layers = layer_members(image.layout)
    assert list(layers) == list(exec_image.LAYERS)

    system = layers["exec-root-system"]
    assert set(system) == {"usr", "usr/bin", "usr/bin/sh", "usr/lib", "usr/lib/libc.so.6", "usr/lib64", "usr/sbin",
                           "etc", "etc/passwd", "etc/shadow", "bin", "lib", "lib64"}
    # /bin, /lib, /lib64 are the root's links into usr, as the worker's binds resolve them.
    assert {n: system[n][:2] for n in ("bin", "lib", "lib64")} == {
        "bin": ("symlink", "usr/bin"), "lib": ("symlink", "usr/lib"), "lib64": ("symlink", "usr/lib64")}
    assert system["usr/bin/sh"] == ("file", "", 0o755) and system["etc/passwd"] == ("file", "", 0o644)

    python = layers["exec-root-python"]
    assert set(python) == at_own_path(er.python_prefix) | {
        f"{str(er.python_prefix)[1:]}/{p}" for p in ("bin", "bin/python3.11", "bin/python3")}
    assert python[f"{str(er.python_prefix)[1:]}/bin/python3"][:2] == ("symlink", "python3.11")

    venvs = layers["exec-root-venvs"]
    v = str(er.venvs)[1:]
    assert set(venvs) == at_own_path(er.venvs) | {
        f"{v}/{p}" for p in ("tools-abc", "tools-abc/bin", "tools-abc/bin/python3", "tools-abc/pyvenv.cfg")}
    assert venvs[f"{v}/tools-abc/bin/python3"][:2] == ("symlink", str(er.python_prefix / "bin" / "python3.11"))

    # Nothing of the host outside those: not the rest of the root, the cache, the prefix's siblings.
    every = {n for members in layers.values() for n in members}
    assert {n.split("/", 1)[0] for n in system} == {"usr", "etc", "bin", "lib", "lib64"}  # no var, home, sbin
    for left_out in ("other-version", "cas", "host.log", ".kimi-k3-complete"):
        assert not [n for n in every if left_out in PurePosixPath(n).parts], left_out
    # The scratch dir of layer blobs is gone; the layout is all that was written.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["image"]

    config = json.loads(blob_path(image.layout, image.config_digest).read_bytes())
    assert config["config"]["Labels"]["org.opencontainers.image.title"] == exec_image.TITLE
    assert config["config"]["Labels"]["org.kimi-k3.exec-root"] == str(er.root)
    assert "Entrypoint" not in config["config"] and "Cmd" not in config["config"]
    assert config["created"] == "2026-01-01T00:00:00Z"


def test_same_root_same_digest(tmp_path: Path) -> None:
    er = stand_in(tmp_path)
    one = exec_image.build(er, tmp_path / "one", EPOCH, progress=False)
    two = exec_image.build(er, tmp_path / "two", EPOCH, progress=False)
    assert one.manifest_digest == two.manifest_digest
    assert [l.digest for l in one.layers] == [l.digest for l in two.layers]
    # A changed venv changes the venvs layer alone: the system and Python layers are uploaded once.
    (er.venvs / "tools-abc" / "pyvenv.cfg").write_text("home = elsewhere\n")
    three = exec_image.build(er, tmp_path / "three", EPOCH, progress=False)
    assert [l.digest for l in three.layers[:2]] == [l.digest for l in one.layers[:2]]
    assert three.layers[2].digest != one.layers[2].digest and three.manifest_digest != one.manifest_digest


def test_a_root_whose_parts_the_image_cannot_show_is_refused(tmp_path: Path) -> None:
    er = stand_in(tmp_path)
    (er.root / "lib64").unlink()
    (er.root / "lib64").symlink_to("/usr/lib64")  # the host's, for a worker's bind
    with pytest.raises(UserError, match=r"lib64: a link to '/usr/lib64', not into the root's own /usr, /etc"):
        exec_image.build(er, tmp_path / "out", EPOCH, progress=False)
    (er.root / "lib64").unlink()
    with pytest.raises(UserError, match=r"lib64: missing, and every worker binds it at /lib64"):
        exec_image.build(er, tmp_path / "out", EPOCH, progress=False)
    (er.root / "lib64").mkdir()  # a real directory is a tree of the system layer
    (er.root / "lib64" / "ld-linux-x86-64.so.2").write_text("loader\n")
    image = exec_image.build(er, tmp_path / "out", EPOCH, progress=False)
    assert layer_members(image.layout)["exec-root-system"]["lib64/ld-linux-x86-64.so.2"][0] == "file"
    system_python = exec_root.ExecRoot(er.root, Path("/usr/local"), er.venvs)
    with pytest.raises(UserError, match=r"the root's /usr and the Python prefix /usr/local overlap"):
        exec_image.build(system_python, tmp_path / "out2", EPOCH, progress=False)
    nested = exec_root.ExecRoot(er.root, er.python_prefix, er.python_prefix / "venvs")
    with pytest.raises(UserError, match=r"the Python prefix .* and the venvs .*/venvs overlap"):
        exec_image.build(nested, tmp_path / "out2", EPOCH, progress=False)
    assert not (tmp_path / "out2").exists()
    with pytest.raises(UserError, match=r"--out .*: inside the venvs .*, which the image holds"):
        exec_image.build(er, er.venvs / "image", EPOCH, progress=False)
    assert not (er.venvs / "image").exists()


def test_container_image_property() -> None:
    digest = "sha256:" + "ab" * 32
    assert exec_image.container_image_property(Repository("registry.example.com", "kimi/exec-root"), digest) == (
        f"container-image=docker://registry.example.com/kimi/exec-root@{digest}")
    with pytest.raises(UserError, match="expected sha256:<64 hex>"):
        exec_image.container_image_property(Repository("r.example", "x"), "latest")


def test_epoch_is_fixed_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert exec_image.image_epoch(None) == exec_image.default_epoch() == EPOCH  # image/constants.bzl's
    assert exec_image.image_epoch("5") == 5
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "7")
    assert exec_image.image_epoch(None) == 7


def rbe_image(tmp_path: Path, er: exec_root.ExecRoot, *args: str) -> subprocess.CompletedProcess[str]:
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / exec_root.RECORD).write_text(json.dumps({"python_prefix": str(er.python_prefix), "root": str(er.root)}))
    env = dict(os.environ, KIMI_K3_CACHE=str(cache), PYTHONPATH=str(REPO_ROOT))
    env.pop("SOURCE_DATE_EPOCH", None)
    return subprocess.run([sys.executable, "-m", "tools.rbe", "image", *args], cwd=REPO_ROOT, env=env, text=True,
                          capture_output=True, timeout=120)


def listing(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


@pytest.mark.parametrize("args, words", [
    (["--out", "{file}"], ["--out", "exists and is not a directory"]),
    (["--out", "{dir}/image", "--tag", "v1"], ["--tag", "add --push"]),
    (["--out", "{dir}/image", "--push", "Not A Repo"], ["--push", "HOST[:PORT]/PATH"]),
    (["--out", "{dir}/image", "--push", "r.example/x", "--tag", "no good"], ["--tag 'no good'", "not a valid tag"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args: list[str], words: list[str]) -> None:
    er = stand_in(tmp_path)
    (tmp_path / "work").mkdir()
    existing = tmp_path / "work" / "file"
    existing.write_text("mine\n")
    before = listing(tmp_path)
    res = rbe_image(tmp_path, er, *[a.format(file=existing, dir=tmp_path / "work") for a in args])
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0]
    assert res.stdout == ""
    assert existing.read_text() == "mine\n"
    assert listing(tmp_path) == sorted({*before, f"cache/{exec_root.RECORD}"})


def test_cli_writes_the_layout_and_prints_its_digest(tmp_path: Path) -> None:
    er = stand_in(tmp_path)
    res = rbe_image(tmp_path, er, "--out", str(tmp_path / "image"))
    assert res.returncode == 0, res.stderr
    image = exec_image.build(er, tmp_path / "again", exec_image.default_epoch(), progress=False)
    assert res.stdout == f"manifest digest: {image.manifest_digest}\n"
    assert "3 layers" in res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
