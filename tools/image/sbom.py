"""SPDX 2.3 JSON SBOM of one image: every pin of its stack and every patch with its gate state.

Usage:
    python3 -m tools.image.sbom --lock third_party/pins.lock.json --stack default \
        [--debian-lock third_party/debian.lock.json --debian-set image-base] \
        [--gate-manifest flashinfer/manifest.json]... [--built-wheel WHEEL=PIN,PIN]... --out sbom.spdx.json

The SBOM is shipped in the image at /usr/share/kimi-k3/sbom.spdx.json (its own small top
layer) and its sha256 is the image label org.kimi-k3.sbom-sha256 (tools/image/layout.py --sbom).
Every Debian package of the base layer is listed too (name, version, .deb sha256, pool URL and a
pkg:deb purl), from the set the base was built from; that build proved the root holds exactly
those packages at those versions.
Output is canonical JSON with `created` from SOURCE_DATE_EPOCH and a documentNamespace derived
from the content, so the same pins and patches give the same bytes.

Patches are listed by series entry name and gate state only, never by content hash: the
content hashes live in the gate manifests shipped inside the FlashInfer and SGLang layers
(/usr/share/kimi-k3/patch-gate/). So a one-line change to one SGLang patch changes exactly one
layer (SGLang's) and the config, not this SBOM's layer as well.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import write_bytes_atomic
from tools.common.hashing import sha256_bytes
from tools.common.jsondata import ANY, TEXT, ListOf, Object, load_json_file
from tools.common.jsonfmt import canonical_json
from tools.image.layer_tar import source_date_epoch
from tools.image.layout import rfc3339
from tools.pins import debian
from tools.pins import lock as lockfile

IMAGE_PATH = "/usr/share/kimi-k3/sbom.spdx.json"
# Where image/BUILD.bazel puts the patch gate manifests (inside the FlashInfer/SGLang layers).
GATE_MANIFEST_DIR = "/usr/share/kimi-k3/patch-gate"
NOASSERTION = "NOASSERTION"
# Part of the SBOM's bytes, so of the sbom layer's digest and the image's manifest digest: it
# keeps the tool's name from when the image was first published (tools/sbom.py, now
# tools/image/sbom.py); renaming a module must not change an image.
CREATOR = "Tool: kimi-k3-build tools/sbom.py"


def spdx_id(kind: str, name: str) -> str:
    """SPDXRef ids allow letters, digits, '.' and '-' only."""
    return f"SPDXRef-{kind}-" + re.sub(r"[^A-Za-z0-9.-]", "-", name)


def pin_package(pin: Any) -> dict[str, Any]:
    """One SPDX package for a lock pin (file, git_diff or git_tree)."""
    pkg: dict[str, Any] = {"SPDXID": spdx_id("Pin", pin.name), "name": pin.name, "filesAnalyzed": False,
                           "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION,
                           "copyrightText": NOASSERTION}
    if pin.kind == "file":
        pkg["downloadLocation"] = pin.urls[0] if pin.urls else NOASSERTION
        pkg["packageFileName"] = pin.filename
        pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": pin.sha256}]
        if pin.package:
            pkg["name"] = pin.package.name
            pkg["versionInfo"] = pin.package.version
            pkg["externalRefs"] = [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                                    "referenceLocator": f"pkg:pypi/{pin.package.name.lower()}@{pin.package.version}"}]
    elif pin.kind == "git_diff":
        pkg["downloadLocation"] = f"git+{pin.repository}@{pin.commit}"
        pkg["versionInfo"] = pin.commit
        pkg["packageFileName"] = pin.filename
        pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": pin.sha256}]
        pkg["comment"] = f"diff {pin.parent}..{pin.commit} (trees {pin.parent_tree}..{pin.commit_tree})"
    else:
        pkg["downloadLocation"] = f"git+{pin.repository}@{pin.commit}"
        pkg["versionInfo"] = pin.commit
        pkg["comment"] = f"git tree {pin.tree}"
        if pin.paths:  # the archive holds only these directories of the tree
            pkg["comment"] += "; only " + ", ".join(f"{path} (tree {tree})" for path, tree in pin.paths.items())
        if pin.sha256:  # an archived git_tree pin: the sha256 of its canonical tar
            pkg["packageFileName"] = pin.filename
            pkg["checksums"] = [{"algorithm": "SHA256", "checksumValue": pin.sha256}]
    return pkg


def built_wheel_package(wheel: Path, source_pins: Sequence[str]) -> dict[str, Any]:
    """One SPDX package for a wheel this project builds from pins (FlashKDA's): its name and
    version from the file name, its sha256, and the pins it was built from (GENERATED_FROM)."""
    from tools.common.hashing import sha256_file

    parts = wheel.name[:-len(".whl")].split("-") if wheel.name.endswith(".whl") else []
    if len(parts) < 5:
        raise UserError(f"--built-wheel {wheel}: not a wheel file name (NAME-VERSION-PY-ABI-PLATFORM.whl)")
    name, version = parts[0], parts[1]
    return {"SPDXID": spdx_id("Built", name), "name": name, "versionInfo": version,
            "downloadLocation": NOASSERTION, "packageFileName": wheel.name, "filesAnalyzed": False,
            "checksums": [{"algorithm": "SHA256", "checksumValue": sha256_file(wheel)}],
            "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION, "copyrightText": NOASSERTION,
            "comment": f"built by this project from the pins {', '.join(source_pins)}",
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:pypi/{name.lower()}@{version}"}]}


def deb_package(pkg: debian.DebPackage) -> dict[str, Any]:
    """One SPDX package for a .deb of the base layer's Debian set."""
    return {"SPDXID": spdx_id("Deb", pkg.name), "name": pkg.name, "versionInfo": pkg.version,
            "downloadLocation": pkg.urls[0], "packageFileName": Path(pkg.filename).name, "filesAnalyzed": False,
            "checksums": [{"algorithm": "SHA256", "checksumValue": pkg.sha256}],
            "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION, "copyrightText": NOASSERTION,
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl",
                              "referenceLocator": f"pkg:deb/debian/{pkg.name}@{pkg.version}?arch={pkg.architecture}"}]}


# What the SBOMs read of a patch gate manifest (tools/patch_gate/manifest.py MANIFEST has it all).
GATE_MANIFEST_READ = Object({
    "target": Object({"pin": TEXT}, other=ANY),
    "patches": ListOf(Object({"entry": TEXT, "sha256": TEXT, "state": TEXT}, other=ANY)),
}, other=ANY)


def read_gate_manifest(path: Path) -> dict[str, Any]:
    return load_json_file(path, "--gate-manifest", GATE_MANIFEST_READ, "pass tools/patch_gate's manifest.json")


def patch_packages(manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(packages, relationships) for the patches of one gate run against its target pin.

    Name and state only (see the module docstring): no checksum, no content-derived version.
    """
    target = spdx_id("Pin", manifest["target"]["pin"])
    series = manifest.get("series", "?")
    packages, relationships = [], []
    for p in manifest["patches"]:
        ident = spdx_id("Patch", f"{manifest['target']['pin']}-{p['entry']}")
        packages.append({"SPDXID": ident, "name": p["entry"], "versionInfo": NOASSERTION,
                         "downloadLocation": NOASSERTION, "filesAnalyzed": False,
                         "licenseConcluded": NOASSERTION, "licenseDeclared": NOASSERTION,
                         "copyrightText": NOASSERTION,
                         "comment": f"patch gate state: {p['state']} (series {series}; content hashes "
                                    f"in the gate manifest under {GATE_MANIFEST_DIR})"})
        # PATCH_APPLIED only for patches whose hunks went in; 'already upstream' changed nothing.
        kind = "PATCH_APPLIED" if p["state"] == "applies" else "OTHER"
        rel: dict[str, Any] = {"spdxElementId": ident, "relationshipType": kind, "relatedSpdxElement": target}
        if kind == "OTHER":
            rel["comment"] = f"not applied: {p['state']}"
        relationships.append(rel)
    return packages, relationships


def build_sbom(lock: lockfile.Lock, stack_name: str, manifests: Sequence[dict[str, Any]], epoch: int,
               base: debian.DebSet | None = None,
               built_wheels: Sequence[tuple[Path, Sequence[str]]] = ()) -> dict[str, Any]:
    stack = lock.stack(stack_name)
    sources = [n for _, pins in built_wheels for n in pins]
    pin_names = list(dict.fromkeys([*stack.pin_names(), *(m["target"]["pin"] for m in manifests), *sources]))
    packages = [pin_package(lock.pin(n)) for n in pin_names]
    built = [(built_wheel_package(wheel, pins), pins) for wheel, pins in built_wheels]
    packages += [pkg for pkg, _ in built]
    packages += [deb_package(p) for p in (base.packages if base else ())]
    relationships = [{"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES",
                      "relatedSpdxElement": p["SPDXID"]} for p in packages]
    relationships += [{"spdxElementId": pkg["SPDXID"], "relationshipType": "GENERATED_FROM",
                       "relatedSpdxElement": spdx_id("Pin", pin)} for pkg, pins in built for pin in pins]
    for m in manifests:
        pkgs, rels = patch_packages(m)
        packages += pkgs
        relationships += rels
    doc: dict[str, Any] = {
        "spdxVersion": "SPDX-2.3", "dataLicense": "CC0-1.0", "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"kimi-k3-{stack_name}",
        "creationInfo": {"created": rfc3339(epoch), "creators": [CREATOR]},
        "packages": packages, "relationships": relationships,
    }
    # The namespace must be unique per document: derive it from the content, not from time or uuid.
    content = sha256_bytes(canonical_json(doc))
    doc["documentNamespace"] = f"https://kimi-k3.invalid/spdx/{stack_name}-{content}"
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lock", type=Path, default=lockfile.DEFAULT_LOCK)
    p.add_argument("--stack", required=True)
    p.add_argument("--gate-manifest", action="append", default=[], type=Path)
    p.add_argument("--debian-lock", type=Path, help="Debian lock holding the base layer's set")
    p.add_argument("--debian-set", help="the base layer's Debian set (with --debian-lock)")
    p.add_argument("--built-wheel", action="append", default=[], metavar="WHEEL=PIN,PIN",
                   help="a wheel built from pins (listed with them, GENERATED_FROM each)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--source-date-epoch", default=None)
    args = p.parse_args(argv)
    epoch = source_date_epoch(args.source_date_epoch)
    lock = lockfile.load(args.lock)
    if bool(args.debian_lock) != bool(args.debian_set):
        raise UserError("--debian-lock and --debian-set go together: pass both (the base layer's set) or neither")
    base = debian.load_set(args.debian_lock, args.debian_set) if args.debian_set else None
    built = []
    for value in args.built_wheel:
        wheel, sep, pins = value.partition("=")
        names = [n for n in pins.split(",") if n]
        if not sep or not wheel or not names:
            raise UserError(f"--built-wheel {value!r}: expected WHEEL=PIN[,PIN...], the wheel and the pins it is built from")
        built.append((Path(wheel), [lock.pin(n).name for n in names]))
    doc = build_sbom(lock, args.stack, [read_gate_manifest(m) for m in args.gate_manifest], epoch, base, built)
    data = canonical_json(doc) + b"\n"
    write_bytes_atomic(args.out, data)
    print(f"sbom: {args.out} sha256:{sha256_bytes(data)} "
          f"({len(doc['packages'])} packages)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
