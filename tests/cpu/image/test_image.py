"""CPU tests of the image stages with a tiny image (tag cpu).

The tiny image goes through the same code as the real one: tools/image/rootfs.py builds a base rootfs
that holds only this machine's python (the chroot smoke test really runs it), tools/image/layer.py
writes the layers, tools/image/layout.py the layout, tools/image/push.py pushes it to Debian's
docker-registry on 127.0.0.1, skopeo reads it back, tools/image/smoke.py unpacks and chroots.

Needs (Debian): docker-registry, skopeo, umoci, apache2-utils (htpasswd); pip: installer. Root
for chroot. Everything is written under pytest's tmp_path. KIMI_TEST_FLASHINFER_WHEEL (the default
stack's pinned flashinfer-python wheel) is required by the real-wheel layer test.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
import zstandard
from tests.cpu.conftest import artifact
from tests.cpu.image.registry_fixtures import isolated_env, registry  # noqa: F401 (fixtures)

from tools.common.errors import UserError
from tools.image import layer as oci_layer
from tools.image import compression
from tools.image import driver_stub
from tools.image.layer_tar import source_date_epoch
from tools.image import layout as oci_image
from tools.image import push as oci_push
from tools.image import image_contents
from tools.image import image_rootfs
from tools.image import local_registry
from tools.image import registry_client
from tools.image import rootfs
from tools.image import sbom
from tools.image import smoke as image_smoke

REPO_ROOT = Path(__file__).resolve().parents[3]

EPOCH = 1700000000
ENTRYPOINT = REPO_ROOT / "image" / "entrypoint.py"
SITE = "usr/local/lib/python3.11/dist-packages"


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def host_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # image/entrypoint.py imports typing and, for its guard (also run inside the chroot),
    # importlib.metadata (the installed Mooncake's version).
    return rootfs.host_python_rootfs(tmp_path_factory.mktemp("rootfs") / "root",
                                     ["typing", "__future__", "importlib.metadata"])


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def layer_tar(blob: Path) -> tarfile.TarFile:
    """The tar inside a layer blob (any encoding), for random access."""
    with open(blob, "rb") as raw:
        return tarfile.open(fileobj=io.BytesIO(compression.decompressed(raw).read()))


def build_layer(out_dir: Path, name: str, **sources: list[str]) -> tuple[Path, Path]:
    suffix = {"gzip": ".tar.gz", "none": ".tar"}.get((sources.get("compression") or ["zstd"])[0], ".tar.zst")
    blob, desc = out_dir / f"{name}{suffix}", out_dir / f"{name}.json"
    argv = ["--name", name, "--out", str(blob), "--descriptor", str(desc)]
    for flag, values in sources.items():
        for v in values:
            argv += [f"--{flag.replace('_', '-')}", v]
    assert oci_layer.main(argv) == 0
    return desc, blob


def build_tiny_image(work: Path, host_rootfs: Path, sglang_text: str = "PATCHED = 1\n",
                     flashinfer_text: str = "VALUE = 42\n") -> Path:
    """base (python) / flashinfer-like / kernel cache / sglang-like / entrypoint / sbom layers."""
    src = work / "src"
    fi = write_tree(src / "flashinfer", {"tinyfi/__init__.py": flashinfer_text})
    aot = write_tree(src / "aot", {"tinyfi/data/aot/mod/mod.so": "not really a shared object\n"})
    sg = write_tree(src / "sglang", {"tinysg/__init__.py": sglang_text})
    sbom_file = work / "sbom.spdx.json"
    sbom_file.write_text('{"spdxVersion":"SPDX-2.3"}\n')
    layers = work / "layers"
    specs = [
        ("base", {"tree": [f"/={host_rootfs}"]}),
        ("flashinfer", {"site_tree": [str(fi)]}),
        ("kernel-cache", {"site_tree": [str(aot)]}),
        ("sglang", {"site_tree": [str(sg)]}),
        ("entrypoint", {"file": [f"/usr/local/bin/kimi-k3-entrypoint={ENTRYPOINT}:755"]}),
        ("sbom", {"file": [f"{sbom.IMAGE_PATH}={sbom_file}"]}),
    ]
    argv = ["--out", str(work / "layout"), "--stack", "tiny", "--sbom", str(sbom_file),
            "--entrypoint", "/usr/local/bin/kimi-k3-entrypoint", "--env", "FLASHINFER_DISABLE_JIT=1"]
    for name, sources in specs:
        desc, blob = build_layer(layers, name, **sources)
        argv += ["--layer", str(desc), str(blob)]
    assert oci_image.main(argv) == 0
    return work / "layout"


def manifest_of(layout: Path) -> dict:
    _, data = oci_image.read_index_manifest(layout)
    return json.loads(data)


def layer_digests(layout: Path) -> dict[str, str]:
    return {l["annotations"]["org.kimi-k3.layer"]: l["digest"] for l in manifest_of(layout)["layers"]}


def test_push_prints_each_layer_and_kernel_module_digest(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """What `bazel run //image:push` prints so two machines can find the layer, and in a layer of
    compiled modules (the kernel cache, SGLang's JIT modules) the module, whose bytes differ
    (docs/DIGESTS.md records the reference)."""
    cache_json = {"modules": {"norm": {"sha256": "a" * 64}, "silu_and_mul": {"sha256": "b" * 64}}}
    kc = write_tree(tmp_path / "kc", {"flashinfer/data/aot/kernel_cache.json": json.dumps(cache_json),
                                      "flashinfer/data/aot/norm/norm.so": "x"})
    jit_json = {"modules": [{"module": "sgl_kernel_jit_kda_fused_decode_true", "so_sha256": "c" * 64}]}
    jit = write_tree(tmp_path / "jit", {"kimi-k3-sglang-jit.json": json.dumps(jit_json)})
    other = write_tree(tmp_path / "other", {"etc/hostname": "x\n"})
    argv = ["--out", str(tmp_path / "layout")]
    for name, tree in (("base", f"/={other}"), ("kernel_cache", f"/={kc}"),
                       ("sglang_jit", f"/usr/share/kimi-k3/sglang-jit={jit}")):
        desc, blob = build_layer(tmp_path / "layers", name, tree=[tree])
        argv += ["--layer", str(desc), str(blob)]
    assert oci_image.main(argv) == 0
    layers, modules = image_contents.image_contents(tmp_path / "layout")
    assert [n for n, _, _ in layers] == ["base", "kernel_cache", "sglang_jit"]
    assert layers[1][1] == layer_digests(tmp_path / "layout")["kernel_cache"]
    assert modules == {"kernel_cache": {"norm": "a" * 64, "silu_and_mul": "b" * 64},
                       "sglang_jit": {"sgl_kernel_jit_kda_fused_decode_true": "c" * 64}}
    capsys.readouterr()
    image_contents.print_contents(tmp_path / "layout")
    out = capsys.readouterr().out
    assert f"layer kernel_cache  {layers[1][1]} {layers[1][2]} bytes" in out
    assert f"kernel module norm" in out and "sha256:" + "a" * 64 in out
    assert "sglang-jit module sgl_kernel_jit_kda_fused_decode_true sha256:" + "c" * 64 in out


def registry_tags(reg_host: str, path: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://{reg_host}/v2/{path}/tags/list", timeout=5) as r:
            return list(json.loads(r.read()).get("tags") or [])
    except urllib.error.HTTPError:
        return []


# ---------------------------------------------------------------- layers

def test_layer_bytes_do_not_depend_on_host_metadata(tmp_path: Path) -> None:
    a = write_tree(tmp_path / "a", {"pkg/__init__.py": "x = 1\n", "pkg/bin/tool": "#!/bin/sh\n"})
    b = write_tree(tmp_path / "b", {"pkg/bin/tool": "#!/bin/sh\n", "pkg/__init__.py": "x = 1\n"})
    os.chmod(a / "pkg/bin/tool", 0o700)
    os.chmod(b / "pkg/bin/tool", 0o775)
    os.chmod(b / "pkg/__init__.py", 0o600)
    os.utime(b / "pkg/__init__.py", (1, 1))
    (a / "pkg" / "link").symlink_to("__init__.py")
    (b / "pkg" / "link").symlink_to("__init__.py")
    da, ba = build_layer(tmp_path / "out-a", "t", tree=[f"opt/x={a}"])
    db, bb = build_layer(tmp_path / "out-b", "t", tree=[f"opt/x={b}"])
    assert ba.read_bytes() == bb.read_bytes()
    desc = json.loads(da.read_text())
    assert desc["digest"] == "sha256:" + hashlib.sha256(ba.read_bytes()).hexdigest()
    raw = ba.read_bytes()
    # zstd (the default): one frame, no content size or checksum flag (the bytes depend only on
    # the input, level and library), decompressing to the tar of the diff_id.
    assert raw[:4] == b"\x28\xb5\x2f\xfd" and desc["mediaType"].endswith("tar+zstd")
    assert desc["compression"] == f"zstd-{'.'.join(map(str, zstandard.ZSTD_VERSION))}-level3"
    tar_bytes = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    assert desc["diff_id"] == "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
    # gzip (--//image:layer_compression=gzip): the same tar; the header carries no name or time.
    dg, bg = build_layer(tmp_path / "out-g", "t", tree=[f"opt/x={a}"], compression=["gzip"])
    gz = bg.read_bytes()
    assert gz[:3] == b"\x1f\x8b\x08" and gz[3] & 0x08 == 0, "gzip header must carry no file name"
    assert gz[4:8] == b"\0\0\0\0", "gzip header mtime must be 0"
    assert gzip.decompress(gz) == tar_bytes and json.loads(dg.read_text())["diff_id"] == desc["diff_id"]
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
        members = tf.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert names[:3] == ["opt", "opt/x", "opt/x/pkg"], "parents come first"
    by_name = {m.name: m for m in members}
    assert by_name["opt/x/pkg/bin/tool"].mode == 0o755
    assert by_name["opt/x/pkg/__init__.py"].mode == 0o644
    assert by_name["opt/x/pkg/link"].issym() and by_name["opt/x/pkg/link"].linkname == "__init__.py"
    assert all(m.mtime == EPOCH and m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in members)


def test_base_tar_keeps_owners_special_bits_and_orders_hardlinks(tmp_path: Path) -> None:
    src = tmp_path / "base.tar"
    with tarfile.open(src, "w", format=tarfile.GNU_FORMAT) as tf:
        def add(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = kind, mode, uid, gid
            info.uname, info.mtime, info.linkname, info.size = "someone", 12345, link, len(data)
            tf.addfile(info, io.BytesIO(data) if data else None)
        add("./usr/bin/zz", tarfile.REGTYPE, 0o4755, data=b"suid")
        add("./usr/bin/aa", tarfile.LNKTYPE, 0o4755, link="./usr/bin/zz")  # link sorts before target
        add("./tmp", tarfile.DIRTYPE, 0o1777)
        add("./etc/shadow", tarfile.REGTYPE, 0o640, gid=42, data=b"root:*:\n")
        add("./dev/null", tarfile.CHRTYPE, 0o666)
    _, blob = build_layer(tmp_path / "out", "base", tar=[str(src)])
    with layer_tar(blob) as tf:
        m = {x.name: x for x in tf.getmembers()}
        assert m["tmp"].mode == 0o1777
        assert m["etc/shadow"].gid == 42 and m["etc/shadow"].mode == 0o640 and m["etc/shadow"].gname == ""
        assert m["usr/bin/aa"].isreg() and tf.extractfile("usr/bin/aa").read() == b"suid"
        assert m["usr/bin/zz"].islnk() and m["usr/bin/zz"].linkname == "usr/bin/aa"
        assert m["usr/bin/aa"].mode == 0o4755 and m["dev/null"].ischr()
        assert all(x.mtime == EPOCH for x in m.values())


def make_wheel(path: Path) -> Path:
    """A tiny wheel with a module, a console script and a correct RECORD."""
    files = {
        "tinywheel/__init__.py": b"def main():\n    print('hi')\n",
        "tinywheel-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinywheel\nVersion: 1.0\n",
        "tinywheel-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "tinywheel-1.0.dist-info/entry_points.txt": b"[console_scripts]\ntinywheel = tinywheel:main\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "tinywheel-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("tinywheel-1.0.dist-info/RECORD", record)
    return path


def test_wheel_layer_installs_for_debian_python(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "tinywheel-1.0-py3-none-any.whl")
    d1, b1 = build_layer(tmp_path / "o1", "w", wheel=[str(wheel)])
    d2, b2 = build_layer(tmp_path / "o2", "w", wheel=[str(wheel)])
    assert b1.read_bytes() == b2.read_bytes()
    with compression.open_layer_blob(b1) as tf:
        names, script = [], b""
        for m in tf:
            names.append(m.name)
            if m.name == "usr/local/bin/tinywheel":
                script = tf.extractfile(m).read()
    assert f"{SITE}/tinywheel/__init__.py" in names
    assert f"{SITE}/tinywheel-1.0.dist-info/INSTALLER" in names
    assert not [n for n in names if n.endswith(".pyc")], "no host byte-code in layers"
    assert script.startswith(b"#!/usr/bin/python3\n")
    with open(b1, "rb") as raw:
        assert str(tmp_path).encode() not in compression.decompressed(raw).read(), "no build path leaks into the layer"


def test_cuda_home_layer_links_the_cuda_wheels_and_holds_no_compiler(tmp_path: Path) -> None:
    """--cuda-home (the torch layer's): /usr/local/cuda, where an unset CUDA_HOME resolves, as
    links into the CUDA wheels' headers and libraries, and no bin/: DeepGEMM's import asserts a
    CUDA home (SGLang's Kimi-K3 model imports it), and an nvcc there would change every SGLang JIT
    key. Extracted, the links reach the wheel's files; the layer bytes are the same twice."""
    from tools.common import cuda_home
    tree = write_tree(tmp_path / "t", {f"{SITE}/nvidia/cu13/include/cuda.h": "header\n",
                                       f"{SITE}/nvidia/cu13/lib/libcudart.so.13": "runtime\n",
                                       f"{SITE}/nvidia/cu13/bin/nvcc": "nvcc\n"})
    def torch_layer(out: Path) -> Path:
        blob = out / "torch.tar.zst"
        assert oci_layer.main(["--name", "torch", "--out", str(blob), "--descriptor", str(out / "torch.json"),
                               "--tree", f"={tree}", "--cuda-home"]) == 0
        return blob

    b1 = torch_layer(tmp_path / "o1")
    with compression.open_layer_blob(b1) as tf:
        members = {m.name: m for m in tf}
    assert members["usr/local/cuda"].isdir()
    links = {n: m.linkname for n, m in members.items() if n.startswith("usr/local/cuda/")}
    assert links == {"usr/local/cuda/include": "../lib/python3.11/dist-packages/nvidia/cu13/include",
                     "usr/local/cuda/lib64": "../lib/python3.11/dist-packages/nvidia/cu13/lib"}
    root = tmp_path / "root"
    with compression.open_layer_blob(b1) as tf:
        tf.extractall(root, filter="fully_trusted")
    assert (root / "usr/local/cuda/include/cuda.h").read_text() == "header\n"
    assert (root / "usr/local/cuda/lib64/libcudart.so.13").read_text() == "runtime\n"
    assert not (root / "usr/local/cuda/bin").exists()
    # The SGLang JIT build's scratch root gets the same directory (tools/jit_cache/sglang_aot.py).
    made = cuda_home.make(tmp_path / "scratch", "/" + SITE)
    assert {p.name: os.readlink(p) for p in made.iterdir()} == {n.rsplit("/", 1)[1]: t for n, t in links.items()}
    b2 = torch_layer(tmp_path / "o2")
    assert b1.read_bytes() == b2.read_bytes()


def test_wheel_dir_layer_equals_wheel_layer(tmp_path: Path) -> None:
    # Bazel passes a repacked +kimik3 wheel as a directory output (its file name is only known
    # after the build): installing from the directory must give the very same layer.
    (tmp_path / "dir").mkdir()
    wheel = make_wheel(tmp_path / "dir" / "tinywheel-1.0-py3-none-any.whl")
    d1, _ = build_layer(tmp_path / "o1", "w", wheel=[str(wheel)])
    d2, _ = build_layer(tmp_path / "o2", "w", wheel_dir=[str(wheel.parent)])
    assert json.loads(d1.read_text())["digest"] == json.loads(d2.read_text())["digest"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .whl file"):
        build_layer(tmp_path / "o3", "w", wheel_dir=[str(tmp_path / "empty")])


def test_layer_from_the_installed_tree_equals_the_wheel_layer(tmp_path: Path) -> None:
    # The Bazel rule installs a layer's wheels in one action (the tree the profile check mounts)
    # and writes the blob from that tree in another: the blob must be the one-step layer's.
    wheel = make_wheel(tmp_path / "tinywheel-1.0-py3-none-any.whl")
    (tmp_path / "x").mkdir()
    other = make_wheel(tmp_path / "x" / "tinywheel-1.0-py3-none-any.whl")
    d1, _ = build_layer(tmp_path / "o1", "w", wheel=[str(wheel)])
    tree = tmp_path / "installed"
    tree.mkdir()  # Bazel declares a tree output as an empty directory
    assert oci_layer.main(["--out-tree", str(tree), "--wheel", str(wheel)]) == 0
    assert (tree / SITE / "tinywheel" / "__init__.py").is_file() and (tree / "usr/local/bin/tinywheel").is_file()
    d2, _ = build_layer(tmp_path / "o2", "w", tree=[f"={tree}"])
    assert json.loads(d1.read_text())["digest"] == json.loads(d2.read_text())["digest"]
    # Two wheels installing one file: one line naming the file and both sources, nothing left.
    clash = tmp_path / "clash"
    with pytest.raises(UserError, match=r"'usr/local/bin/tinywheel' is already installed by tinywheel-1.0-py3-none-any.whl"):
        oci_layer.main(["--out-tree", str(clash), "--wheel", str(wheel), "--wheel", str(other)])
    assert not clash.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(UserError, match=r"--out-tree .*: exists, is not empty and holds files"):
        oci_layer.main(["--out-tree", str(tree), "--wheel", str(wheel)])
    with pytest.raises(UserError, match="installs wheels only: drop --file"):
        oci_layer.main(["--out-tree", str(tmp_path / "t2"), "--wheel", str(wheel), "--file", f"/x={ENTRYPOINT}"])


def test_real_flashinfer_wheel_layer_is_reproducible(tmp_path: Path) -> None:
    wheel = str(artifact("KIMI_TEST_FLASHINFER_WHEEL"))
    d1, _ = build_layer(tmp_path / "o1", "fi", wheel=[wheel])
    d2, _ = build_layer(tmp_path / "o2", "fi", wheel=[wheel])
    assert json.loads(d1.read_text())["digest"] == json.loads(d2.read_text())["digest"]


def test_layer_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="SOURCE_DATE_EPOCH"):
        source_date_epoch("yesterday")
    with pytest.raises(UserError, match="not a directory"):
        build_layer(tmp_path, "x", tree=[f"/={tmp_path / 'missing'}"])
    with pytest.raises(UserError, match=r"\.\."):
        build_layer(tmp_path, "x", file=[f"../etc/x={ENTRYPOINT}"])
    t = write_tree(tmp_path / "t", {"a": "1"})
    with pytest.raises(UserError, match="already in this layer"):
        build_layer(tmp_path, "x", tree=[f"/={t}", f"/={t}"])



def kernel_cache_tree(root: Path, arch: str | None, modules: bool = True) -> Path:
    """A kernel cache tree as tools/kernel_cache assembles it (arch None: no kernel_cache.json)."""
    files = {"flashinfer/data/aot/mod/mod.so": "not really a shared object\n"} if modules else {}
    if arch is not None:
        files["flashinfer/data/aot/kernel_cache.json"] = json.dumps({"schema_version": 1, "arch_list": arch}) + "\n"
    (root / "flashinfer/data/aot").mkdir(parents=True, exist_ok=True)
    return write_tree(root, files)


def test_kernel_cache_layer_refuses_a_cache_for_another_arch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = kernel_cache_tree(tmp_path / "sm120", "12.0f")
    _, plain = build_layer(tmp_path / "plain", "kc", tree=[f"{SITE}={good}"])
    _, guarded = build_layer(tmp_path / "guarded", "kc", tree=[f"{SITE}={good}"], kernel_cache_arch=["12.0f"])
    assert guarded.read_bytes() == plain.read_bytes(), "the guard changes no byte of the layer"
    build_layer(tmp_path / "empty", "kc", tree=[f"{SITE}={kernel_cache_tree(tmp_path / 'none', None, modules=False)}"],
                kernel_cache_arch=["12.0f"])  # a stack without a cache: an empty flashinfer/data/aot
    bad = [
        ("sm90", {"tree": [f"{SITE}={kernel_cache_tree(tmp_path / 'sm90', '9.0a')}"]}, r"built for arch '9\.0a', this layer is for '12\.0f'"),
        ("sm90-site", {"site_tree": [str(kernel_cache_tree(tmp_path / 'sm90', '9.0a'))]}, r"built for arch '9\.0a'"),
        ("nojson", {"tree": [f"{SITE}={kernel_cache_tree(tmp_path / 'nojson', None)}"]}, "holds modules but no kernel_cache.json"),
        ("notcache", {"tree": [f"{SITE}={write_tree(tmp_path / 'other', {'x': '1'})}"]}, "no flashinfer/data/aot in it"),
        ("notree", {"file": [f"/x={ENTRYPOINT}"]}, "no --tree/--site-tree to check"),
    ]
    capsys.readouterr()
    for name, sources, message in bad:
        out = tmp_path / f"out-{name}"
        argv = ["--name", "kc", "--out", str(out / "kc.tar.gz"), "--descriptor", str(out / "kc.json"),
                "--source-date-epoch", str(EPOCH), "--kernel-cache-arch", "12.0f"]
        for flag, values in sources.items():
            for v in values:
                argv += [f"--{flag.replace('_', '-')}", v]
        assert oci_layer.run_cli(oci_layer.main, argv) == 2, name
        err = capsys.readouterr().err.strip()
        assert re.search(message, err) and "\n" not in err, (name, err)
        assert not out.exists() or not list(out.iterdir()), f"{name}: nothing may be written"


# ---------------------------------------------------------------- image, push, change

def test_same_inputs_same_digests_and_labels(tmp_path: Path, host_rootfs: Path) -> None:
    one = build_tiny_image(tmp_path / "one", host_rootfs)
    two = build_tiny_image(tmp_path / "two", host_rootfs)
    assert (one / "index.json").read_bytes() == (two / "index.json").read_bytes()
    assert sorted(p.name for p in (one / "blobs/sha256").iterdir()) == sorted(p.name for p in (two / "blobs/sha256").iterdir())
    manifest = manifest_of(one)
    config = json.loads(oci_image.blob_path(one, manifest["config"]["digest"]).read_bytes())
    labels = config["config"]["Labels"]
    assert labels["org.kimi-k3.stack"] == "tiny"
    assert labels["org.kimi-k3.base-digest"] == config["rootfs"]["diff_ids"][0]
    sbom_bytes = (tmp_path / "one" / "sbom.spdx.json").read_bytes()
    assert labels["org.kimi-k3.sbom-sha256"] == "sha256:" + hashlib.sha256(sbom_bytes).hexdigest()
    assert config["created"] == "2023-11-14T22:13:20Z"
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/kimi-k3-entrypoint"]
    for blob in (one / "blobs/sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name


def tiny_lock(path: Path, sha_other: str = "b" * 64, sha_mine: str = "a" * 64) -> Path:
    def pin(name: str, sha: str) -> dict:
        return {"kind": "file", "package": {"name": name, "version": "1.0"}, "filename": f"{name}-1.0-py3-none-any.whl",
                "urls": [f"https://files.pythonhosted.org/{name}-1.0-py3-none-any.whl"], "sha256": sha, "size": 1}
    path.write_text(json.dumps({"schema_version": 1, "pins": {"mine-1.0": pin("mine", sha_mine), "other-1.0": pin("other", sha_other)},
                                "stacks": {"tiny": {"description": "t", "sglang": "mine-1.0"},
                                           "other": {"description": "o", "sglang": "other-1.0"}}}))
    return path


def test_pins_label_covers_only_the_stacks_pins(tmp_path: Path) -> None:
    base = tiny_lock(tmp_path / "a.json")
    other_edited = tiny_lock(tmp_path / "b.json", sha_other="c" * 64)
    mine_edited = tiny_lock(tmp_path / "c.json", sha_mine="d" * 64)
    digests = [oci_image.stack_pins_digest(p, "tiny") for p in (base, other_edited, mine_edited)]
    assert digests[0] == digests[1] != digests[2]
    payload = write_tree(tmp_path / "p", {"x": "1"})
    desc, blob = build_layer(tmp_path / "layers", "p", tree=[f"/opt={payload}"])
    with pytest.raises(UserError, match="--stack"):
        oci_image.main(["--out", str(tmp_path / "l"), "--layer", str(desc), str(blob), "--lock", str(base)])


def test_push_read_back_change_one_layer_and_repush(tmp_path: Path, host_rootfs: Path,
                                                    registry: local_registry.RegistryProcess) -> None:
    repo = registry_client.Repository(registry.host, "kimi-k3/tiny")
    first = build_tiny_image(tmp_path / "v1", host_rootfs)
    r1 = oci_push.push(first, repo, ["v1"])
    assert r1.blobs_uploaded == 1 + len(manifest_of(first)["layers"])
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{repo}:v1"],
                         check=True, stdout=subprocess.PIPE).stdout
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == r1.manifest_digest
    assert raw == oci_image.blob_path(first, r1.manifest_digest).read_bytes(), "manifest pushed byte for byte"

    second = build_tiny_image(tmp_path / "v2", host_rootfs, sglang_text="PATCHED = 2\n")
    before, after = layer_digests(first), layer_digests(second)
    assert [n for n in before if before[n] != after[n]] == ["sglang"], "one patch change -> one layer"
    r2 = oci_push.push(second, repo, ["v2"])
    changed_layer = next(l for l in manifest_of(second)["layers"] if l["digest"] == after["sglang"])
    config_size = manifest_of(second)["config"]["size"]
    assert r2.blobs_uploaded == 2 and r2.bytes_uploaded == changed_layer["size"] + config_size
    assert sorted(registry_tags(registry.host, "kimi-k3/tiny")) == ["v1", "v2"]


class CuttingProxy:
    """A loopback TCP proxy that drops every connection once `cut_after` upload bytes passed."""

    def __init__(self, upstream_port: int, cut_after: int | None) -> None:
        self.upstream_port, self.cut_after, self.sent = upstream_port, cut_after, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while data := src.recv(65536):
                if upload:
                    self.sent += len(data)
                    if self.cut_after is not None and self.sent > self.cut_after:
                        raise OSError("cut")
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_registry_down_mid_push_leaves_no_tag_and_rerun_completes(tmp_path: Path, host_rootfs: Path,
                                                                  registry: local_registry.RegistryProcess) -> None:
    payload = tmp_path / "big"
    payload.mkdir()
    (payload / "random.bin").write_bytes(os.urandom(3 << 20))  # incompressible: the upload is ~3 MiB
    desc, blob = build_layer(tmp_path / "layers", "big", tree=[f"/opt/big={payload}"])
    layout = tmp_path / "layout"
    assert oci_image.main(["--out", str(layout), "--layer", str(desc), str(blob)]) == 0
    proxy = CuttingProxy(registry.port, cut_after=1 << 20)
    repo = registry_client.Repository(f"127.0.0.1:{proxy.port}", "kimi-k3/cut")
    with pytest.raises(UserError, match="no tag was written; rerun"):
        oci_push.push(layout, repo, ["latest"])
    assert registry_tags(registry.host, "kimi-k3/cut") == []
    proxy.cut_after = None
    result = oci_push.push(layout, repo, ["latest"])
    assert registry_tags(registry.host, "kimi-k3/cut") == ["latest"]
    assert result.blobs_uploaded is not None and result.blobs_uploaded >= 1


def test_bad_credentials_give_a_clear_error(tmp_path: Path, host_rootfs: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("htpasswd") is None:
        pytest.fail("htpasswd is not installed: apt-get install -y apache2-utils")
    htpasswd = tmp_path / "htpasswd"
    subprocess.run(["htpasswd", "-Bbc", str(htpasswd), "alice", "right-password"], check=True, capture_output=True)
    reg = local_registry.start_registry(tmp_path / "auth-registry", htpasswd=htpasswd)
    try:
        payload = write_tree(tmp_path / "p", {"x": "1"})
        desc, blob = build_layer(tmp_path / "layers", "p", tree=[f"/opt={payload}"])
        layout = tmp_path / "layout"
        assert oci_image.main(["--out", str(layout), "--layer", str(desc), str(blob)]) == 0
        monkeypatch.setenv(registry_client.USER_ENV, "alice")
        monkeypatch.setenv(registry_client.PASSWORD_ENV, "wrong-password")
        rc = oci_push.run_cli(oci_push.main, ["--layout", str(layout), "--repository", f"{reg.host}/kimi-k3/auth", "--tag", "t"])
        err = capsys.readouterr().err
        assert rc == 2 and "rejected the credentials" in err and "wrong-password" not in err
        with pytest.raises(UserError, match="refused by the registry|rejected the credentials"):
            monkeypatch.delenv(registry_client.USER_ENV)
            monkeypatch.delenv(registry_client.PASSWORD_ENV)
            oci_push.push(layout, registry_client.Repository(reg.host, "kimi-k3/auth"), ["t"])
        monkeypatch.setenv(registry_client.USER_ENV, "alice")
        monkeypatch.setenv(registry_client.PASSWORD_ENV, "right-password")
        assert oci_push.push(layout, registry_client.Repository(reg.host, "kimi-k3/auth"), ["t"]).tags == ("t",)
        assert "right-password" not in capsys.readouterr().out
    finally:
        local_registry.stop_registry(reg)


def test_default_local_registry_is_started_reused_and_stopped(tmp_path: Path, host_rootfs: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    payload = write_tree(tmp_path / "p", {"x": "1"})
    desc, blob = build_layer(tmp_path / "layers", "p", tree=[f"/opt={payload}"])
    layout = tmp_path / "layout"
    assert oci_image.main(["--out", str(layout), "--layer", str(desc), str(blob), "--stack", "Tiny Stack"]) == 0
    capsys.readouterr()
    try:
        assert oci_push.main(["--layout", str(layout)]) == 0
        out1 = capsys.readouterr().out
        state = json.loads((tmp_path / "cache/registry/state.json").read_text())
        assert oci_push.main(["--layout", str(layout), "--tag", "again"]) == 0
        out2 = capsys.readouterr().out
        assert json.loads((tmp_path / "cache/registry/state.json").read_text()) == state, "reused, not restarted"
        for label in ("manifest digest:", "config digest:", "index digest:", "pushed:"):
            assert label in out1
        assert f"pushed:          127.0.0.1:{state['port']}/kimi-k3/tiny-stack@sha256:" in out1
        assert "uploaded:        0 of 2 blobs, 0 bytes" in out2
    finally:
        # As the README says: the script run directly (not through Bazel) stops the registry.
        stop = subprocess.run([sys.executable, "-m", "tools.image.push", "--stop-local-registry"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
    assert f"stopped local registry pid {state['pid']}" in stop.stderr
    assert not local_registry._pid_alive(state["pid"])
    assert not (tmp_path / "cache/registry/state.json").exists()


def test_push_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="HOST"):
        registry_client.parse_repository("no-host")
    with pytest.raises(UserError, match="index.json"):
        oci_push.push(tmp_path, registry_client.Repository("127.0.0.1:1", "x/y"), [])
    assert registry_client.parse_repository("registry.example.com/kimi/k3").loopback is False
    assert registry_client.tls_args(registry_client.parse_repository("registry.example.com/kimi/k3"), "dest-tls-verify") == ["--dest-tls-verify=true"]
    assert registry_client.tls_args(registry_client.parse_repository("localhost:5000/kimi/k3"), "dest-tls-verify") == ["--dest-tls-verify=false"]



class RecordingServer:
    """A loopback HTTP server: `handle(path, headers)` -> (status, headers, body); every request's
    (path, headers) is kept in `seen`."""

    def __init__(self, handle) -> None:  # type: ignore[no-untyped-def]
        import http.server

        seen: list[tuple[str, dict[str, str]]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self) -> None:
                seen.append((self.path, dict(self.headers.items())))
                status, headers, body = handle(self.path, self.headers)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = _reply

            def log_message(self, *args: object) -> None:
                pass

        self.seen = seen
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_registry_probe_drops_authorization_on_cross_host_redirect() -> None:
    storage = RecordingServer(lambda path, headers: (200, {}, b""))

    def registry_handle(path: str, headers):  # type: ignore[no-untyped-def]
        if "Authorization" not in headers:
            return 401, {"WWW-Authenticate": 'Basic realm="r"'}, b""
        if path.endswith("/blobs/sha256:aa"):  # blob reads go to storage on another host:port
            return 307, {"Location": f"http://localhost:{storage.port}/blob"}, b""
        if path.endswith("/blobs/sha256:bb"):  # a redirect within the registry itself
            return 307, {"Location": "/v2/kimi/x/moved"}, b""
        return 200, {}, b""

    registry = RecordingServer(registry_handle)
    try:
        creds = registry_client.Credentials(None, ("alice", "pw"), "test")
        client = registry_client.RegistryClient(registry_client.Repository(f"127.0.0.1:{registry.port}", "kimi/x"), creds)
        assert client.blob_exists("sha256:aa") is True
        assert [p for p, _ in storage.seen] == ["/blob"]
        assert "Authorization" not in storage.seen[0][1], "credentials followed a redirect to another host"
        assert client.blob_exists("sha256:bb") is True
        moved = [h for p, h in registry.seen if p == "/v2/kimi/x/moved"]
        assert moved and moved[0].get("Authorization", "").startswith("Basic "), "same-origin redirect keeps it"
    finally:
        registry.close()
        storage.close()


def test_bearer_realm_must_be_https_or_loopback_and_named() -> None:
    repo = registry_client.Repository("registry.example.com", "kimi/k3")
    client = registry_client.RegistryClient(repo, registry_client.Credentials(None, ("alice", "pw"), "test"))
    with pytest.raises(UserError, match=r"token realm http://auth\.example\.com/token is not https") as e:
        client._authenticate('Bearer realm="http://auth.example.com/token",service="reg"')
    assert "\n" not in str(e.value) and client.authorization is None
    with pytest.raises(UserError, match=r"registry\.example\.com/kimi/k3: .*Bearer challenge names no realm") as e:
        client._authenticate('Bearer service="reg"')
    assert "\n" not in str(e.value)
    tokens = RecordingServer(lambda path, headers: (200, {"Content-Type": "application/json"}, b'{"token": "tok"}'))
    try:  # plain http is fine for a token service on this machine
        assert client._authenticate(f'Bearer realm="http://127.0.0.1:{tokens.port}/token",service="reg"')
        assert client.authorization == "Bearer tok"
        assert tokens.seen[0][1]["Authorization"] == "Basic " + base64.b64encode(b"alice:pw").decode()
    finally:
        tokens.close()


@pytest.mark.parametrize("auth", ["not base64!", base64.b64encode(b"no-colon").decode(), base64.b64encode(b"\xff\xfe:x").decode()])
def test_auth_file_with_bad_auth_value_is_one_line_error(tmp_path: Path, auth: str) -> None:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"auths": {"registry.example.com": {"auth": auth}}}))
    with pytest.raises(UserError) as e:
        registry_client.credentials_from_file(path, registry_client.Repository("registry.example.com", "kimi/k3"))
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "base64 of USER:PASSWORD" in msg and "skopeo login" in msg
    assert "\n" not in msg


def test_concurrent_default_pushes_share_one_local_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    real_start = local_registry.start_registry
    started: list[local_registry.RegistryProcess] = []

    def slow_start(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.5)  # widen the window between "no registry recorded" and recording one
        reg = real_start(*args, **kwargs)
        started.append(reg)
        return reg

    monkeypatch.setattr(local_registry, "start_registry", slow_start)
    barrier = threading.Barrier(2)
    results: list[object] = []

    def push_side() -> None:
        barrier.wait()
        try:
            results.append(local_registry.local_registry())
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            results.append(e)

    threads = [threading.Thread(target=push_side) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(started) == 1, f"{len(started)} registries started on one storage"
        assert results == [started[0], started[0]]
    finally:
        for reg in started:
            local_registry.stop_registry(reg)


def test_concurrent_pushes_of_one_repository_to_the_local_registry_all_succeed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docker-registry 2.8 rewrites a repository's link files in place (truncate, then write): a
    push reading its manifest back while another push of the same repository rewrote that link
    got HTTP 500 "invalid checksum digest format". Pushes to the local registry take turns per
    repository: three started at once all succeed, and each says it waits."""
    payload = write_tree(tmp_path / "p", {"x": "1"})
    desc, blob = build_layer(tmp_path / "layers", "p", tree=[f"/opt={payload}"])
    layout = tmp_path / "layout"
    assert oci_image.main(["--out", str(layout), "--layer", str(desc), str(blob), "--stack", "race"]) == 0
    reg = local_registry.local_registry()
    repo = registry_client.Repository(reg.host, image_contents.default_repository_path(layout))
    results: dict[int, object] = {}

    def push_side(i: int) -> None:
        try:
            results[i] = oci_push.main(["--layout", str(layout), "--tag", f"t{i}", "--tag", "shared"])
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            results[i] = e

    threads = [threading.Thread(target=push_side, args=(i,)) for i in range(3)]
    err = ""
    try:
        # Held here first, so that all three are surely waiting, then go at once.
        with local_registry.local_push_lock(reg.root, repo):
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while err.count(f"waiting for another push of {repo} (pid {os.getpid()})") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
                err += capsys.readouterr().err
        for t in threads:
            t.join(120)
        err += capsys.readouterr().err
        assert results == {0: 0, 1: 0, 2: 0}, err
        assert err.count(f"waiting for another push of {repo}") >= 3, err
        assert {"t0", "t1", "t2", "shared"} <= set(registry_client.tags(repo, registry_client.Credentials(None, None, "none")))
    finally:
        local_registry.stop_local_registry()


# ---------------------------------------------------------------- smoke test in a chroot

def test_chroot_smoke_on_tiny_image(tmp_path: Path, host_rootfs: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the chroot smoke test needs root (CI runs tests as root)")
    layout = build_tiny_image(tmp_path / "img", host_rootfs)
    good = tmp_path / "gate.json"
    sha = hashlib.sha256(b"PATCHED = 1\n").hexdigest()
    good.write_text(json.dumps({"changed_files": [{"path": "tinysg/__init__.py", "sha256_after": sha},
                                                  {"path": "tinysg/removed.py", "sha256_after": None}]}))
    report = image_smoke.smoke(layout, tmp_path, ["tinyfi", "tinysg"], [good],
                               [f"/{SITE}/tinyfi/data/aot", "/usr/bin/python3"], [f"/{SITE}/flashinfer_jit_cache"], [])
    assert report.failures == [], report.failures
    assert any(p.startswith(f"import tinysg: /{SITE}/tinysg/__init__.py") for p in report.passes)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"changed_files": [{"path": "tinysg/__init__.py", "sha256_after": "0" * 64}]}))
    report = image_smoke.smoke(layout, tmp_path, ["tinysg", "not_in_image"], [bad], [], [f"/{SITE}/tinyfi"], [])
    assert len(report.failures) == 3, report.failures  # wrong hash, forbidden path present, failed import
    assert not list(tmp_path.glob("smoke.*")), "the unpacked rootfs is removed"


_MOUNT_PLAN = r"""
import json, os, subprocess, sys
from pathlib import Path
from tools.image import image_chroot, image_rootfs
plan, work, base = map(Path, sys.argv[1:4])
with image_rootfs.mounted_rootfs_plan(plan, work, runfiles=base) as (root, env):
    run = image_chroot.run_in_chroot(root, ["/usr/bin/python3", "-c",
        "import os, tinysg; print(tinysg.PATCHED, oct(os.stat('/usr/local/bin/kimi-k3-entrypoint').st_mode & 0o777))"],
        env, network=False)
    (root / "tmp" / "written").write_text("upper")
    print(json.dumps({"env": env, "out": run.stdout.strip(), "err": run.stderr[-500:],
                      "base_file": (root / "etc" / "from-base").read_text()}))
"""


def test_rootfs_plan_mounts_the_layers_parts_without_blobs(tmp_path: Path, host_rootfs: Path) -> None:
    """oci_rootfs's plan (what :profiles_check mounts): the base tar extracted, a wheel layer's
    installed tree as a lower directory as it is, files with their modes, the image's env over the
    defaults; writes go to `work`, and the overlay never shows in this test's own namespace."""
    if os.geteuid() != 0:
        pytest.fail("the rootfs plan is mounted with an overlay: it needs root (CI runs tests as root)")
    base = tmp_path / "runfiles"
    write_tree(host_rootfs, {"etc/from-base": "base\n"})
    base_tar = base / "_main" / "base.tar"
    base_tar.parent.mkdir(parents=True)
    subprocess.run(["tar", "-c", "--numeric-owner", "-f", str(base_tar), "-C", str(host_rootfs), "."], check=True)
    installed = write_tree(base / "_main" / "sg.installed", {f"{SITE}/tinysg/__init__.py": "PATCHED = 7\n"})
    installed.chmod(0o555)  # Bazel's outputs are read-only
    ep = base / "_main" / "entrypoint.py"
    ep.write_text("#!/usr/bin/python3\n")
    plan = tmp_path / "plan.rootfs.json"
    plan.write_text(json.dumps({"schema": "kimi-k3-rootfs-plan/1", "env": ["LD_LIBRARY_PATH=/x"], "layers": [
        {"name": "base", "tars": ["_main/base.tar"], "installed": None, "trees": [], "site_trees": [], "files": []},
        {"name": "sglang", "tars": [], "installed": "_main/sg.installed", "trees": [], "site_trees": [], "files": []},
        {"name": "entrypoint", "tars": [], "installed": None, "trees": [], "site_trees": [],
         "files": [["/usr/local/bin/kimi-k3-entrypoint:755", "_main/entrypoint.py"]]}]}))
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-c", _MOUNT_PLAN, str(plan), str(work), str(base)],
                          capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["out"] == "7 0o755", seen["err"]
    assert seen["base_file"] == "base\n"
    assert seen["env"][0].startswith("PATH=") and "LD_LIBRARY_PATH=/x" in seen["env"]
    assert (work / "upper" / "tmp" / "written").read_text() == "upper", "writes land in work"
    assert not (installed / "tmp").exists(), "the layer's own tree is never written"
    mounts = subprocess.run(["findmnt", "-n", "-o", "TARGET", "-t", "overlay"], capture_output=True, text=True).stdout
    assert str(work) not in mounts, "the overlay lived in the child's own mount namespace"
    with pytest.raises(UserError, match="not a kimi-k3-rootfs-plan/1 file"):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        with image_rootfs.mounted_rootfs_plan(bad, tmp_path / "w2", runfiles=base):
            pass


def test_smoke_driver_stub_stands_in_for_libcuda(tmp_path: Path, host_rootfs: Path) -> None:
    """mooncake.engine needs libcuda.so.1, which only GPU hosts have: without the stub the failure
    says how to check anyway; with it the import passes and the report says a stand-in was used."""
    # The tiny image's python has no ctypes: the module looks for the library the way the dynamic
    # loader would (LD_LIBRARY_PATH); the real dlopen is what the image's own smoke run checks.
    needs_driver = ("import os\n"
                    "if not any(os.path.exists(os.path.join(d, 'libcuda.so.1'))\n"
                    "           for d in os.environ.get('LD_LIBRARY_PATH', '').split(':') if d):\n"
                    "    raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    layout = build_tiny_image(tmp_path / "img", host_rootfs, flashinfer_text=needs_driver)
    report = image_smoke.smoke(layout, tmp_path, ["tinyfi"], [], [], [], [])
    assert len(report.failures) == 1 and "--driver-stub" in report.failures[0], report.failures
    report = image_smoke.smoke(layout, tmp_path, ["tinyfi"], [], [], [], [], driver_stub=True)
    assert report.failures == [], report.failures
    assert report.passes[-1].endswith("(with a stand-in libcuda.so.1 of 0 driver symbols)"), report.passes
    assert driver_stub.with_library_path(["A=1", "LD_LIBRARY_PATH=/x"], "/s") == ["A=1", "LD_LIBRARY_PATH=/s:/x"]
    assert driver_stub.with_library_path(["A=1"], "/s") == ["A=1", "LD_LIBRARY_PATH=/s"]


def test_entrypoint_guard_runs_inside_the_image(tmp_path: Path, host_rootfs: Path) -> None:
    layout = build_tiny_image(tmp_path / "img", host_rootfs)
    root = image_rootfs.unpack(layout, tmp_path / "bundle")
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    proc = subprocess.run([chroot, str(root), "/usr/local/bin/kimi-k3-entrypoint", "--disaggregation-mode", "decode"],
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert proc.returncode == 2 and "kvcache-ai/Mooncake#2511" in proc.stderr, proc.stderr
    proc = subprocess.run([chroot, str(root), "/usr/local/bin/kimi-k3-entrypoint", "--model-path", "x"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert "No module named 'sglang'" in proc.stderr, "it execs python3 -m sglang.launch_server"


def test_base_image_pulled_by_digest(tmp_path: Path, host_rootfs: Path, registry: local_registry.RegistryProcess) -> None:
    payload = write_tree(tmp_path / "p", {"etc/os-release": "ID=tiny\n"})
    desc, blob = build_layer(tmp_path / "layers", "os", tree=[f"/={payload}"])
    base = tmp_path / "base-src"
    assert oci_image.main(["--out", str(base), "--layer", str(desc), str(blob), "--env", "FROM_BASE=1"]) == 0
    pushed = oci_push.push(base, registry_client.Repository(registry.host, "kimi-k3/base"), [])
    pulled = tmp_path / "base"
    assert rootfs.main(["pull", "--reference", pushed.reference, "--out", str(pulled)]) == 0
    top_desc, top_blob = build_layer(tmp_path / "layers", "top", file=[f"/opt/top={ENTRYPOINT}"])
    image = tmp_path / "image"
    assert oci_image.main(["--out", str(image), "--base-layout", str(pulled), "--layer", str(top_desc), str(top_blob)]) == 0
    manifest = manifest_of(image)
    config = json.loads(oci_image.blob_path(image, manifest["config"]["digest"]).read_bytes())
    assert config["config"]["Labels"]["org.kimi-k3.base-digest"] == pushed.manifest_digest
    assert "FROM_BASE=1" in config["config"]["Env"]
    assert [l["digest"] for l in manifest["layers"]] == [json.loads(desc.read_text())["digest"],
                                                         json.loads(top_desc.read_text())["digest"]]
    with pytest.raises(UserError, match="pin the base by digest"):
        rootfs.main(["pull", "--reference", f"{registry.host}/kimi-k3/base:latest", "--out", str(pulled)])


def test_smoke_paths_never_resolve_onto_the_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/python3").symlink_to("/etc/hostname")  # exists on the host, not in the image
    (root / "up").symlink_to("../../../../etc")
    assert not image_rootfs.inside(root, "/usr/bin/python3").exists()
    assert image_rootfs.inside(root, "/up/passwd") == root / "etc/passwd"


# ---------------------------------------------------------------- SBOM

def tiny_sbom_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A two-pin lock with stack `tiny` and a gate manifest of two patches, for SBOM tests."""
    lock = tmp_path / "pins.lock.json"
    lock.write_text(json.dumps({"schema_version": 1, "pins": {
        "tiny-1.0": {"kind": "file", "package": {"name": "tiny", "version": "1.0"}, "filename": "tiny-1.0-py3-none-any.whl",
                     "urls": ["https://files.pythonhosted.org/tiny-1.0-py3-none-any.whl"], "sha256": "a" * 64, "size": 1},
        "tinysg-2.0": {"kind": "file", "package": {"name": "tinysg", "version": "2.0"}, "filename": "tinysg-2.0-py3-none-any.whl",
                       "urls": ["https://files.pythonhosted.org/tinysg-2.0-py3-none-any.whl"], "sha256": "b" * 64, "size": 1}},
        "stacks": {"tiny": {"description": "t", "sglang": "tinysg-2.0", "flashinfer": "tiny-1.0"}}}))
    gate = tmp_path / "gate.json"
    gate.write_text(json.dumps({"series": "s.series", "target": {"pin": "tinysg-2.0"}, "patches": [
        {"entry": "0001-fix.patch", "sha256": "c" * 64, "state": "applies"},
        {"entry": "0002-old.patch", "sha256": "d" * 64, "state": "already upstream"}]}))
    return lock, gate


def test_sbom_lists_pins_and_patches_reproducibly(tmp_path: Path) -> None:
    lock, gate = tiny_sbom_inputs(tmp_path)
    outs = []
    for name in ("a.json", "b.json"):
        argv = ["--lock", str(lock), "--stack", "tiny", "--gate-manifest", str(gate), "--out", str(tmp_path / name)]
        assert sbom.main(argv) == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]
    doc = json.loads(outs[0])
    assert doc["spdxVersion"] == "SPDX-2.3" and doc["creationInfo"]["created"] == "2023-11-14T22:13:20Z"
    pkgs = {p["name"]: p for p in doc["packages"]}
    assert pkgs["tinysg"]["versionInfo"] == "2.0"
    assert pkgs["tinysg"]["checksums"] == [{"algorithm": "SHA256", "checksumValue": "b" * 64}]
    assert pkgs["tinysg"]["downloadLocation"].startswith("https://files.pythonhosted.org/")
    assert "applies" in pkgs["0001-fix.patch"]["comment"] and "already upstream" in pkgs["0002-old.patch"]["comment"]
    kinds = {r["spdxElementId"]: r["relationshipType"] for r in doc["relationships"]}
    assert kinds[pkgs["0001-fix.patch"]["SPDXID"]] == "PATCH_APPLIED"
    assert kinds[pkgs["0002-old.patch"]["SPDXID"]] == "OTHER"
    # Patches by name and state only: their content hashes live in the gate manifests inside
    # the FlashInfer/SGLang layers, so editing a patch must not change the SBOM layer too.
    assert "checksums" not in pkgs["0001-fix.patch"] and "c" * 12 not in outs[0].decode()
    gate_data = json.loads(gate.read_text())
    gate_data["patches"][0]["sha256"] = "e" * 64
    gate.write_text(json.dumps(gate_data))
    argv = ["--lock", str(lock), "--stack", "tiny", "--gate-manifest", str(gate), "--out", str(tmp_path / "c.json")]
    assert sbom.main(argv) == 0
    assert (tmp_path / "c.json").read_bytes() == outs[0]
    gate_data["patches"][1]["state"] = "applies"
    gate.write_text(json.dumps(gate_data))
    assert sbom.main([*argv[:-1], str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d.json").read_bytes() != outs[0]
    with pytest.raises(UserError, match="patch_gate"):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        sbom.read_gate_manifest(bad)


def test_sbom_lists_a_built_wheel_with_the_pins_it_is_built_from(tmp_path: Path) -> None:
    # The kda_prefill=flashkda variant: FlashKDA's wheel, GENERATED_FROM its git_tree pins.
    lock, gate = tiny_sbom_inputs(tmp_path)
    data = json.loads(lock.read_text())
    data["pins"]["kda"] = {"kind": "git_tree", "repository": "https://github.invalid/o/kda", "commit": "1" * 40,
                           "tree": "2" * 40, "filename": "kda-11111111.tar", "sha256": "e" * 64}
    data["pins"]["kda-cutlass"] = {"kind": "git_tree", "repository": "https://github.invalid/o/cutlass",
                                   "commit": "3" * 40, "tree": "4" * 40, "paths": {"include": "5" * 40}}
    lock.write_text(json.dumps(data))
    wheel = tmp_path / "flash_kda-0.0.1+1111111.sm120a-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"wheel bytes")
    base = ["--lock", str(lock), "--stack", "tiny", "--gate-manifest", str(gate)]
    assert sbom.main([*base, "--out", str(tmp_path / "plain.json")]) == 0
    assert sbom.main([*base, "--built-wheel", f"{wheel}=kda,kda-cutlass", "--out", str(tmp_path / "kda.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert "kda" not in {p["name"] for p in plain["packages"]}  # the default image lists no FlashKDA
    doc = json.loads((tmp_path / "kda.json").read_text())
    pkgs = {p["name"]: p for p in doc["packages"]}
    built = pkgs["flash_kda"]
    assert built["versionInfo"] == "0.0.1+1111111.sm120a" and built["packageFileName"] == wheel.name
    assert built["checksums"] == [{"algorithm": "SHA256", "checksumValue": hashlib.sha256(b"wheel bytes").hexdigest()}]
    assert pkgs["kda"]["downloadLocation"] == "git+https://github.invalid/o/kda@" + "1" * 40
    assert pkgs["kda"]["checksums"] == [{"algorithm": "SHA256", "checksumValue": "e" * 64}]
    # A pin with `paths` says the package is only those directories of the tree.
    assert "checksums" not in pkgs["kda-cutlass"]
    assert pkgs["kda-cutlass"]["comment"] == f"git tree {'4' * 40}; only include (tree {'5' * 40})"
    generated = {r["relatedSpdxElement"] for r in doc["relationships"]
                 if r["spdxElementId"] == built["SPDXID"] and r["relationshipType"] == "GENERATED_FROM"}
    assert generated == {pkgs["kda"]["SPDXID"], pkgs["kda-cutlass"]["SPDXID"]}
    for bad, expected in ((f"{wheel}", "expected WHEEL=PIN"), (f"{wheel}=kdaa", "pin 'kdaa' is not in the lock")):
        with pytest.raises(UserError, match=expected):
            sbom.main([*base, "--built-wheel", bad, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


# sha256 of what tools/sbom.py and tools/oci_layer.py wrote for these inputs when the image was
# first published (before the tools moved into tools/image): moving or refactoring a tool must not
# change one output byte, or every image digest changes with it.
PUBLISHED_SBOM_SHA256 = "9c02b1bdcf916801a0e4bad282a7e95952221c578f38f3c51d55f363e80a0a61"
PUBLISHED_TAR_LAYER_SHA256 = "3b550dfe5851ee8cb02a4dce2d183e45c18af85bac26c7118d91fd735b78db1c"
PUBLISHED_DESCRIPTOR_SHA256 = "d2e319f79364968a21054aec8ecc663ae71e3e37b5ada35dd3693dc17776af57"


def test_sbom_and_layer_bytes_are_those_of_the_published_tools(tmp_path: Path) -> None:
    lock, gate = tiny_sbom_inputs(tmp_path)
    assert sbom.main(["--lock", str(lock), "--stack", "tiny", "--gate-manifest", str(gate),
                      "--out", str(tmp_path / "sbom.json"), "--source-date-epoch", "1700000000"]) == 0
    # Files, an executable, a hard link, a symlink, a --file with a mode; uncompressed, so the
    # bytes do not depend on the zlib build.
    tree = tmp_path / "tree"
    (tree / "pkg" / "sub").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("x = 1\n")
    (tree / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tree / "pkg" / "run.sh", 0o700)
    (tree / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 3)
    os.link(tree / "pkg" / "sub" / "data.bin", tree / "pkg" / "sub" / "again.bin")
    os.symlink("sub/data.bin", tree / "pkg" / "link")
    entry = tmp_path / "entry.py"
    entry.write_text("print('hi')\n")
    assert oci_layer.main(["--name", "tiny", "--out", str(tmp_path / "l.tar"), "--descriptor", str(tmp_path / "l.json"),
                           "--tree", f"opt/tiny={tree}", "--file", f"/usr/local/bin/tiny={entry}:755",
                           "--compression", "none", "--source-date-epoch", "1700000000"]) == 0
    digests = {name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() for name in ("sbom.json", "l.tar", "l.json")}
    assert digests == {"sbom.json": PUBLISHED_SBOM_SHA256, "l.tar": PUBLISHED_TAR_LAYER_SHA256,
                       "l.json": PUBLISHED_DESCRIPTOR_SHA256}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.parametrize("text, where", [
    ('["not", "an", "object"]', "$: expected an object, found a list"),
    ('{"auths": {"registry.example.com": "dXNlcjpwdw=="}}', '$.auths["registry.example.com"]: expected an object'),
    ('{"auths": {"registry.example.com": {"auth": 1}}}', '$.auths["registry.example.com"].auth: expected a string'),
    ('{"auths": {"a": {}, "a": {}}}', "key 'a' appears twice"),
    ('{"auths": {', "invalid JSON at line 1"),
])
def test_an_auth_file_of_the_wrong_shape_is_one_line(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "auth.json"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        registry_client.credentials_from_file(path, registry_client.Repository("registry.example.com", "kimi/k3"))
    msg = str(e.value)
    assert msg.startswith(f"auth file {path}: ") and where in msg and "\n" not in msg, msg
