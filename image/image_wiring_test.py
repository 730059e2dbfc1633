"""Bazel-level CPU test of //image wiring (tag cpu): the small layers and the SBOM as Bazel
builds them for the selected stack, without building the GB-sized layers.

Env (set by image/BUILD.bazel from the targets): KIMI_IMAGE_SBOM (the SBOM), KIMI_GATE_MANIFESTS
(space-separated gate manifests), KIMI_LAYER_ENTRYPOINT / KIMI_LAYER_KERNEL_CACHE / KIMI_LAYER_SBOM
(layer blobs), KIMI_ENTRYPOINT_SRC (image/entrypoint.py). An unset variable fails the test.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from tools.sbom import spdx_id

SITE = "usr/local/lib/python3.11/dist-packages"


def env_path(var: str) -> Path:
    """The path in $var; for a layer target ($(rootpaths): blob and descriptor), the blob."""
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run this test through Bazel (//image:image_wiring_test)")
    paths = value.split()
    blobs = [p for p in paths if p.endswith(".tar.gz")]
    return Path(blobs[0] if blobs else paths[0])


def layer_members(var: str) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(env_path(var), "r:gz") as tf:
        return {m.name: (m, tf.extractfile(m).read() if m.isfile() else None) for m in tf.getmembers()}


def test_sbom_lists_every_gated_patch_by_name_and_state_only() -> None:
    sbom_bytes = env_path("KIMI_IMAGE_SBOM").read_bytes()
    doc = json.loads(sbom_bytes)
    names = {p["name"]: p for p in doc["packages"]}
    manifests = [json.loads(Path(m).read_text()) for m in os.environ.get("KIMI_GATE_MANIFESTS", "").split()]
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


def test_sbom_layer_ships_the_sbom() -> None:
    members = layer_members("KIMI_LAYER_SBOM")
    _, data = members["usr/share/kimi-k3/sbom.spdx.json"]
    assert data == env_path("KIMI_IMAGE_SBOM").read_bytes()


def test_entrypoint_layer_is_executable_guard() -> None:
    member, data = layer_members("KIMI_LAYER_ENTRYPOINT")["usr/local/bin/kimi-k3-entrypoint"]
    assert member.mode == 0o755 and member.uid == 0 and member.gid == 0
    assert data == env_path("KIMI_ENTRYPOINT_SRC").read_bytes()


def test_kernel_cache_layer_targets_flashinfer_aot_dir() -> None:
    members = layer_members("KIMI_LAYER_KERNEL_CACHE")
    assert f"{SITE}/flashinfer/data/aot" in members
    assert all(n == f"{SITE}/flashinfer/data/aot" or n.startswith(f"{SITE}/flashinfer/data/aot/")
               or f"{SITE}/flashinfer/data/aot".startswith(n + "/") for n in members), sorted(members)


def test_layers_are_reproducible_by_content() -> None:
    # The descriptor's digest is the blob's sha256: what the manifest will reference.
    for var in ("KIMI_LAYER_ENTRYPOINT", "KIMI_LAYER_KERNEL_CACHE", "KIMI_LAYER_SBOM"):
        blob = env_path(var)
        desc = json.loads(blob.with_name(blob.name.replace(".tar.gz", ".layer.json")).read_text())
        assert desc["digest"] == "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
