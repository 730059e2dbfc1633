"""The attached SBOM of a real image lists every package the image's own tools report.

Inputs (Bazel): KIMI_IMAGE_SBOM_LAYOUT, the pypi stack's image without its compiled layers
(//image:image_without_kernel_cache: every wheel and Debian layer of the real image, built without
the minutes of kernel compiling), and KIMI_IMAGE_SBOM, its SBOM (tools/image/image_sbom.py: syft
+ the locks). From the layers this test unpacks only what the package tools read (dpkg's
database, every dist-info's METADATA), then asks `dpkg-query --admindir` and
`pip list --path` what is installed, and finds each in the SBOM with its version (and, for each
.deb, the lock's sha256).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from tools.image.compression import open_layer_blob
from tools.image.layout import blob_path, read_index_manifest
from tools.pins import debian
from tools.pins.pypi import normalize

REPO_ROOT = Path(__file__).resolve().parents[3]
SITE_DIRS = ("usr/local/lib/python3.11/dist-packages", "usr/lib/python3/dist-packages")


def _env_path(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"${var} unset: run this test through Bazel (//tests/cpu/image:image_sbom_check_pypi)")
    return Path(value.split()[0])


def unpack_package_databases(layout: Path, root: Path) -> None:
    _, manifest_bytes = read_index_manifest(layout)
    wanted = re.compile(r"^(var/lib/dpkg/status|(%s)/[^/]+\.dist-info/METADATA)$" % "|".join(map(re.escape, SITE_DIRS)))
    for layer in json.loads(manifest_bytes)["layers"]:
        with open_layer_blob(blob_path(layout, layer["digest"])) as tar:
            for member in tar:
                name = member.name.lstrip("./")
                if member.isfile() and wanted.match(name):
                    out = root / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]


def sbom_packages(doc: dict) -> dict[str, set[tuple[str, str]]]:
    found: dict[str, set[tuple[str, str]]] = {"deb": set(), "pypi": set()}
    for pkg in doc["packages"]:
        for ref in pkg.get("externalRefs", []):
            m = re.match(r"^pkg:(deb|pypi)/(?:debian/)?([^@]+)@([^?]+)", urllib.parse.unquote(ref.get("referenceLocator", "")))
            if ref.get("referenceType") == "purl" and m:
                name = m.group(2) if m.group(1) == "deb" else normalize(m.group(2))
                found[m.group(1)].add((name, m.group(3)))
    return found


def test_sbom_lists_every_package_dpkg_query_and_pip_list_report(tmp_path: Path) -> None:
    layout, doc = _env_path("KIMI_IMAGE_SBOM_LAYOUT"), json.loads(_env_path("KIMI_IMAGE_SBOM").read_text())
    root = tmp_path / "root"
    unpack_package_databases(layout, root)
    listed = sbom_packages(doc)

    dpkg = subprocess.run(["dpkg-query", f"--admindir={root / 'var/lib/dpkg'}", "-W", "-f",
                           "${Package} ${Version} ${Architecture}\n"], check=True, capture_output=True, text=True)
    debs = [line.split() for line in dpkg.stdout.splitlines()]
    assert len(debs) > 100
    missing = [f"{n} {v}" for n, v, _ in debs if (n, v) not in listed["deb"]]
    assert not missing, f"dpkg-query reports packages the SBOM lacks: {missing[:10]}"
    base = {(p.name, p.version): p for p in debian.load_set(REPO_ROOT / "third_party/debian.lock.json", "image-base").packages}
    by_name = {p["name"]: p for p in doc["packages"] if "-deb-" in p["SPDXID"]}
    for name, version, _ in debs:
        assert by_name[name]["checksums"] == [{"algorithm": "SHA256", "checksumValue": base[(name, version)].sha256}]

    dists: list[tuple[str, str]] = []
    for site in SITE_DIRS:
        if (root / site).is_dir():
            pip = subprocess.run([sys.executable, "-m", "pip", "list", "--path", str(root / site), "--format", "json",
                                  "--disable-pip-version-check"], check=True, capture_output=True, text=True)
            dists += [(normalize(d["name"]), d["version"]) for d in json.loads(pip.stdout)]
    assert len(dists) > 100
    missing = [f"{n} {v}" for n, v in dists if (n, v) not in listed["pypi"]]
    assert not missing, f"pip list reports distributions the SBOM lacks: {missing[:10]}"
    # The patched SGLang carries the gate's patch states.
    patched = [r for r in doc["relationships"] if r["relationshipType"] == "PATCH_APPLIED"]
    assert patched, "no PATCH_APPLIED relationship: the gate manifests did not reach the SBOM"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
