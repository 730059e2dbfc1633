"""Bazel-level CPU test of //image wiring (tag cpu): the small layers and the SBOM as Bazel
builds them for the selected stack, without building the GB-sized layers.

Env (set by tests/cpu/image/BUILD.bazel from the //image targets and image/constants.bzl): KIMI_IMAGE_SBOM (the SBOM), KIMI_DEBIAN_LOCK (the Debian lock), KIMI_GATE_MANIFESTS
(space-separated gate manifests), KIMI_LAYER_ENTRYPOINT / KIMI_LAYER_KERNEL_CACHE / KIMI_LAYER_SBOM
(layer blobs), KIMI_ENTRYPOINT_SRC (image/entrypoint.py), KIMI_PROFILES (image/profiles/*.json);
the BUILD file's constants KIMI_SOURCE_DATE_EPOCH, KIMI_ENTRYPOINT_IMAGE_PATH, KIMI_PROFILES_IMAGE_PATH,
KIMI_SBOM_IMAGE_PATH, KIMI_IMAGE_CUDA_ARCH. An unset variable fails the test.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from tests.cpu.conftest import env_path

from tools.image import layer as oci_layer
from tools.image import compression
from tools.image.sbom import spdx_id

SITE = "usr/local/lib/python3.11/dist-packages"


def layer_blob(var: str) -> Path:
    """The blob of a layer target: $var is its $(rootpaths), the blob and its descriptor."""
    paths = str(env_path(var)).split()
    blobs = [p for p in paths if p.endswith((".tar.zst", ".tar.gz"))]
    if len(blobs) != 1:
        pytest.fail(f"{var}={' '.join(paths)}: expected one layer blob (.tar.zst or .tar.gz) among the layer target's files")
    return Path(blobs[0])


def layer_members(var: str) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    with open(layer_blob(var), "rb") as raw, tarfile.open(fileobj=io.BytesIO(compression.decompressed(raw).read())) as tf:
        return {m.name: (m, tf.extractfile(m).read() if m.isfile() else None) for m in tf.getmembers()}


def test_sbom_lists_every_gated_patch_by_name_and_state_only() -> None:
    sbom_bytes = env_path("KIMI_IMAGE_SBOM").read_bytes()
    doc = json.loads(sbom_bytes)
    names = {p["name"]: p for p in doc["packages"]}
    manifests = [json.loads(Path(m).read_text()) for m in str(env_path("KIMI_GATE_MANIFESTS")).split()]
    assert len(manifests) == 2, "both gate manifests (flashinfer, sglang) are SBOM inputs"
    for manifest in manifests:
        assert spdx_id("Pin", manifest["target"]["pin"]) in {p["SPDXID"] for p in doc["packages"]}
        for patch in manifest["patches"]:
            pkg = names[patch["entry"]]
            assert patch["state"] in pkg["comment"]
            assert "checksums" not in pkg
            # A project patch's content hash must not be in the SBOM: then editing the patch
            # changes only the layer holding the patched package (and its gate manifest), not
            # the SBOM layer. (A `pin:` entry, e.g. #4460, is a lock pin: its sha256 is listed
            # with the pin and changes only with the lock.)
            if patch["entry"].startswith("file:"):
                assert patch["sha256"].encode() not in sbom_bytes


def test_sbom_lists_every_base_package_of_the_debian_set() -> None:
    doc = json.loads(env_path("KIMI_IMAGE_SBOM").read_bytes())
    listed = {p["name"]: (p["versionInfo"], p["checksums"][0]["checksumValue"]) for p in doc["packages"]
              if p["SPDXID"].startswith("SPDXRef-Deb-")}
    base = json.loads(env_path("KIMI_DEBIAN_LOCK").read_text())["sets"]["image-base"]["packages"]
    assert listed == {p["name"]: (p["version"], p["sha256"]) for p in base}


def test_sbom_layer_ships_the_sbom() -> None:
    members = layer_members("KIMI_LAYER_SBOM")
    _, data = members["usr/share/kimi-k3/sbom.spdx.json"]
    assert data == env_path("KIMI_IMAGE_SBOM").read_bytes()


def profile_files() -> list[Path]:
    return [Path(p) for p in str(env_path("KIMI_PROFILES")).split()]


def test_entrypoint_layer_is_executable_guard_with_the_launch_profiles() -> None:
    members = layer_members("KIMI_LAYER_ENTRYPOINT")
    member, data = members["usr/local/bin/kimi-k3-entrypoint"]
    assert member.mode == 0o755 and member.uid == 0 and member.gid == 0
    assert data == env_path("KIMI_ENTRYPOINT_SRC").read_bytes()
    shipped = env_value("KIMI_PROFILES_IMAGE_PATH").lstrip("/")
    assert len(profile_files()) >= 3
    for src in profile_files():
        member, data = members[f"{shipped}/{src.name}"]
        assert member.mode == 0o644 and data == src.read_bytes()


def test_kernel_cache_layer_targets_flashinfer_aot_dir() -> None:
    members = layer_members("KIMI_LAYER_KERNEL_CACHE")
    assert f"{SITE}/flashinfer/data/aot" in members
    assert all(n == f"{SITE}/flashinfer/data/aot" or n.startswith(f"{SITE}/flashinfer/data/aot/")
               or f"{SITE}/flashinfer/data/aot".startswith(n + "/") for n in members), sorted(members)
    # The default stack ships a cache, the PyPI stack an empty directory; a cache is the image's arch.
    cache_json = members.get(f"{SITE}/flashinfer/data/aot/kernel_cache.json")
    if cache_json is not None:
        assert json.loads(cache_json[1])["arch_list"] == env_value("KIMI_IMAGE_CUDA_ARCH")
    else:
        assert not any(n.endswith(".so") for n in members), "modules without kernel_cache.json"


def env_value(var: str) -> str:
    """A constant of image/constants.bzl that the test target passes in $var."""
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this test through Bazel (//tests/cpu/image:test_image_wiring)")
    return value


def test_layer_descriptors_name_their_blobs() -> None:
    # The descriptor's digest is the blob's sha256: what the manifest will reference.
    for var in ("KIMI_LAYER_ENTRYPOINT", "KIMI_LAYER_KERNEL_CACHE", "KIMI_LAYER_SBOM"):
        blob = layer_blob(var)
        desc = json.loads(blob.with_name(blob.name.rsplit(".tar.", 1)[0] + ".layer.json").read_text())
        assert desc["digest"] == "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()


def entrypoint_layer_inputs() -> list[tuple[Path, str]]:
    """(source, IMAGE_PATH[:MODE]) of each file of //image:layer_entrypoint."""
    shipped = env_value("KIMI_PROFILES_IMAGE_PATH")
    return [(env_path("KIMI_ENTRYPOINT_SRC"), env_value("KIMI_ENTRYPOINT_IMAGE_PATH") + ":755"),
            *((p, f"{shipped}/{p.name}") for p in profile_files())]


def sbom_layer_inputs() -> list[tuple[Path, str]]:
    return [(env_path("KIMI_IMAGE_SBOM"), env_value("KIMI_SBOM_IMAGE_PATH"))]


@pytest.mark.parametrize("layer_var,name,inputs", [
    ("KIMI_LAYER_ENTRYPOINT", "entrypoint", entrypoint_layer_inputs),
    ("KIMI_LAYER_SBOM", "sbom", sbom_layer_inputs),
])
def test_small_layers_rebuild_byte_identical_from_their_inputs(tmp_path: Path, layer_var: str, name: str,
                                                              inputs) -> None:
    """Rebuild the layer from its declared inputs, twice, from copies at other paths with other
    host modes (the same execute bit: a file's only mode bit a layer keeps) and mtimes: each
    rebuild must equal Bazel's blob byte for byte."""
    bazel_blob = layer_blob(layer_var).read_bytes()
    for i, mtime in enumerate((1, 2_000_000_000)):
        work = tmp_path / f"rebuild-{i}" / ("deeper/" * i)
        (work / "in").mkdir(parents=True)
        file_args = []
        for j, (source, image_path) in enumerate(inputs()):
            executable = os.stat(source).st_mode & 0o111 != 0
            file_mode = (0o700 if executable else 0o600) if i == 0 else (0o775 if executable else 0o664)
            src = work / "in" / f"input-{i}-{j}"
            shutil.copyfile(source, src)
            os.chmod(src, file_mode)
            os.utime(src, (mtime, mtime))
            path, _, mode = image_path.partition(":")
            file_args += ["--file", f"{path}={src}" + (f":{mode}" if mode else "")]
        out = work / "out"
        compression = "gzip" if layer_blob(layer_var).name.endswith(".tar.gz") else "zstd"
        assert oci_layer.main(["--name", name, "--out", str(out / "l.blob"), "--descriptor", str(out / "l.json"),
                               *file_args, "--source-date-epoch", env_value("KIMI_SOURCE_DATE_EPOCH"),
                               "--compression", compression]) == 0
        rebuilt = (out / "l.blob").read_bytes()
        if rebuilt != bazel_blob:  # no pytest diff of two blobs: it takes minutes
            at = next((j for j, (a, b) in enumerate(zip(rebuilt, bazel_blob)) if a != b), min(len(rebuilt), len(bazel_blob)))
            pytest.fail(f"rebuild {i} of layer {name} differs from Bazel's blob at byte {at} "
                        f"({len(rebuilt)} vs {len(bazel_blob)} bytes)")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
