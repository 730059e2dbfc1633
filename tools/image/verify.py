"""Verify a pushed image: its signature, every blob, its provenance and SBOM, against one public key.

Usage:
    python3 -m tools.image.verify HOST[:PORT]/PATH(:TAG|@sha256:HEX) --key PREFIX.pub \
        [--checkout DIR] [--authfile F]
    tools/bazel run //image:verify -- REF --key PREFIX.pub

One line per check, `ok` or `FAIL` with what is wrong and what to do; exit 0 only when all pass:
  digest      the reference resolves to a manifest whose sha256 is the digest checked below
  signature   skopeo, under a containers policy of one `sigstoreSigned` rule (this key, the
              repository's identity), accepts the digest's signature (REPO:sha256-<hex>.sig)
  blobs       the same skopeo copy pulls the config and every layer, each checked against its digest
              (a full pull into a temporary directory, removed afterwards)
  provenance  REPO:sha256-<hex>.att holds a DSSE envelope signed by this key whose in-toto
              statement's subject is the digest
  locks       the provenance's lock digests equal the checkout's files (third_party/*.lock*)
  sbom        REPO:sha256-<hex>.sbom holds the SPDX document whose sha256 the provenance records
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tools.common import credentials
from tools.common.errors import UserError, run_cli
from tools.common.files import scratch_dir
from tools.common.hashing import sha256_bytes, sha256_file
from tools.image import attest, layout, registry_client, signing


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def ok(self, check: str, detail: str) -> None:
        print(f"ok   {check:<10} {detail}")

    def fail(self, check: str, detail: str) -> None:
        self.failed.append(check)
        print(f"FAIL {check:<10} {detail}")


def parse_reference(raw: str) -> tuple[registry_client.Repository, str]:
    """(repository, ':TAG' or '@sha256:HEX')."""
    m = re.match(r"^(?P<repo>.+?)(?P<suffix>@sha256:[0-9a-f]{64}|:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$", raw)
    repo_text, suffix = (m.group("repo"), m.group("suffix")) if m else (raw, None)
    if suffix is None or (suffix.startswith(":") and "/" in suffix):
        raise UserError(f"REF {raw!r}: expected HOST[:PORT]/PATH:TAG or HOST[:PORT]/PATH@sha256:HEX")
    return registry_client.parse_repository(repo_text), suffix


def policy_file(work: Path, repo: registry_client.Repository, public_key: Path) -> Path:
    """A containers policy accepting only images of `repo` signed by public_key (nothing else)."""
    policy = {"default": [{"type": "reject"}],
              "transports": {"docker": {str(repo): [{"type": "sigstoreSigned", "keyPath": str(public_key.absolute()),
                                                     "signedIdentity": {"type": "matchRepository"}}]}}}
    path = work / "policy.json"
    path.write_text(json.dumps(policy))
    return path


def check_signature_and_blobs(registry: attest.Registry, digest: str, public_key: Path, report: Report) -> None:
    work = Path(tempfile.mkdtemp(prefix="pull.", dir=registry.tmpdir))
    repo, creds = registry.repo, registry.creds
    tag = attest.attachment_tag(digest, attest.SIGNATURE)
    proc = registry.try_skopeo(["--policy", str(policy_file(work, repo, public_key)), "copy", "--remove-signatures",
                                *registry_client.tls_args(repo, "src-tls-verify"), *registry_client.auth_args(creds, "src-authfile"),
                                repo.ref("@" + digest), f"oci:{work / 'image'}"])
    try:
        if proc.returncode == 0:
            _, manifest_bytes = layout.read_index_manifest(work / "image")
            manifest = json.loads(manifest_bytes)
            blobs = [manifest["config"], *manifest["layers"]]
            report.ok("signature", f"{repo}:{tag} signed by {public_key.name} (containers policy sigstoreSigned)")
            report.ok("blobs", f"{len(blobs)} blobs, {sum(int(b['size']) for b in blobs)} bytes, each matches its digest")
            return
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        last = re.sub(r'^time="[^"]*" level=\w+ msg="(.*)"$', r"\1", err[-1] if err else f"exit {proc.returncode}")
        if "Source image rejected" in last or "signature" in last.lower():
            why = "no signature at all" if "no signature" in last.lower() or "A signature was required" in last else last
            report.fail("signature", f"{repo}@{digest}: not signed by {public_key.name}: {why}; sign it (push with "
                                     "--sign-key) or check you hold the signer's public key")
            report.fail("blobs", "not pulled: the policy refused the image before any blob")
        elif "Digest did not match" in last or "digest" in last.lower():
            report.ok("signature", f"{repo}:{tag} signed by {public_key.name} (containers policy sigstoreSigned)")
            report.fail("blobs", f"{repo}@{digest}: {last}; the registry serves a tampered blob: do not run this "
                                 "image, push it again from the build")
        else:
            raise UserError(f"{repo}@{digest}: pulling failed: {last}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def provenance_envelope(registry: attest.Registry, tag: str, report: Report) -> dict[str, Any] | None:
    """The envelope at REPO:tag; None, reported, when the tag is missing or holds no envelope."""
    try:
        envelope = attest.provenance_envelope(registry.pull_artifact(tag))
    except ValueError as e:
        report.fail("provenance", f"{registry.repo}:{tag}: present but malformed ({e}); push the image with its "
                                  "attachments again to replace it (tools/bazel run //image:push)")
        report.fail("locks", "not checked: no provenance")
        return None
    if envelope is None:
        report.fail("provenance", f"{registry.repo}:{tag}: missing (no artifact under this tag); push the image "
                                  "with its attachments (tools/bazel run //image:push)")
        report.fail("locks", "not checked: no provenance")
    return envelope


def check_provenance(registry: attest.Registry, digest: str, public_key: Path, checkout: Path,
                     report: Report) -> dict[str, Any] | None:
    tag = attest.attachment_tag(digest, attest.PROVENANCE)
    envelope = provenance_envelope(registry, tag, report)
    if envelope is None:
        return None
    try:
        statement = json.loads(signing.dsse_open(envelope, signing.load_public_key(public_key),
                                                 attest.IN_TOTO_PAYLOAD_TYPE))
    except ValueError as e:
        report.fail("provenance", f"{registry.repo}:{tag}: {e}; trust it only from the signer's key")
        report.fail("locks", "not checked: the provenance is not this key's")
        return None
    subject = attest.statement_subject(statement)
    if subject != digest or statement.get("predicateType") != attest.SLSA_PROVENANCE:
        report.fail("provenance", f"{registry.repo}:{tag}: a statement about {subject or 'nothing'} "
                                  f"({statement.get('predicateType')}), not {digest}; it belongs to another image")
        report.fail("locks", "not checked: the provenance is another image's")
        return None
    params = statement["predicate"]["buildDefinition"]["externalParameters"]
    report.ok("provenance", f"{registry.repo}:{tag} signed by {public_key.name}; subject {digest}, stack "
                            f"{params.get('stack')}, kernel selection {params.get('kernel_selection') or '-'}")
    recorded = attest.lock_digests(statement)
    wrong = []
    for name in attest.LOCK_FILES:
        path = checkout / name
        mine = sha256_file(path) if path.is_file() else "(missing)"
        if recorded.get(name) != mine:
            wrong.append(f"{name} (image {(recorded.get(name) or 'unrecorded')[:12]}, checkout {mine[:12]})")
    if wrong:
        report.fail("locks", f"{', '.join(wrong)} differ from {checkout}: check out the commit the image was "
                             f"built from ({statement['predicate']['buildDefinition']['resolvedDependencies'][0].get('digest', {}).get('gitCommit', '?')})")
    else:
        report.ok("locks", f"{len(attest.LOCK_FILES)} lock files equal the checkout's ({checkout})")
    return statement


def check_sbom(registry: attest.Registry, digest: str, statement: dict[str, Any] | None, report: Report) -> None:
    tag = attest.attachment_tag(digest, attest.SBOM)
    layers = {desc.get("mediaType"): data for desc, data in registry.pull_artifact(tag) or ()}
    data = layers.get(attest.SPDX_MEDIA_TYPE)
    if data is None:
        report.fail("sbom", f"{registry.repo}:{tag}: missing; push the image with its attachments")
        return
    if statement is None:
        report.fail("sbom", f"{registry.repo}:{tag}: present but unauthenticated: no valid provenance records it")
        return
    recorded = attest.sbom_digests(statement)
    wrong = [f"{kind} {'sha256:' + sha256_bytes(layers[kind]) if kind in layers else 'missing'}, the provenance "
             f"records {expected}" for kind, expected in sorted(recorded.items())
             if kind not in layers or "sha256:" + sha256_bytes(layers[kind]) != expected]
    if not recorded or wrong:
        report.fail("sbom", f"{registry.repo}:{tag}: {'; '.join(wrong) or 'the provenance records no SBOM'}; "
                            "the SBOM was replaced: push the image with its attachments again")
        return
    doc = json.loads(data)
    report.ok("sbom", f"{registry.repo}:{tag} as the provenance records ({len(doc.get('packages', []))} packages, "
                      f"{doc.get('spdxVersion')}" + (", CycloneDX beside it" if attest.CYCLONEDX_MEDIA_TYPE in layers
                                                     else "") + ")")


def verify(reference: str, key: Path, checkout: Path, authfile: Path | None = None) -> int:
    repo, suffix = parse_reference(reference)
    if not key.is_file():
        raise UserError(f"--key {key}: no such file; pass the PREFIX.pub of the signing key{signing.BIND_HINT}")
    signing.load_public_key(key)
    report = Report()
    # The pull (gigabytes) and the credentials' auth file: scratch_dir removes what a killed
    # earlier verify left.
    with scratch_dir("kimi-k3-verify.") as tmp:
        creds = registry_client.resolve_credentials(repo, authfile, Path(tmp))
        registry = attest.Registry(repo, creds, Path(tmp))
        raw = registry.manifest(suffix)
        if raw is None:
            raise UserError(f"{reference}: the registry has no such manifest; check the reference")
        digest = "sha256:" + sha256_bytes(raw)
        if suffix.startswith("@") and suffix[1:] != digest:
            report.fail("digest", f"{reference}: the registry serves a manifest with sha256 {digest}; refusing it")
            return 1
        report.ok("digest", f"{reference} -> {repo}@{digest}")
        check_signature_and_blobs(registry, digest, key, report)
        statement = check_provenance(registry, digest, key, checkout, report)
        check_sbom(registry, digest, statement, report)
    print(f"{'verified' if not report.failed else 'NOT verified'}: {repo}@{digest}"
          + (f" ({len(report.failed)} checks failed: {', '.join(report.failed)})" if report.failed else ""))
    return 0 if not report.failed else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reference", metavar="REF")
    p.add_argument("--key", required=True, type=Path, help="the signer's PREFIX.pub")
    p.add_argument("--checkout", type=Path, help="the checkout whose locks the provenance must match "
                   "(default: $BUILD_WORKSPACE_DIRECTORY, else the current directory)")
    p.add_argument("--authfile", type=Path)
    args = p.parse_args(argv)
    credentials.restore()
    cwd = Path(os.environ.get("BUILD_WORKING_DIRECTORY", "."))
    key = args.key if args.key.is_absolute() else cwd / args.key
    checkout = args.checkout or Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."))
    return verify(args.reference, key, checkout, args.authfile)


if __name__ == "__main__":
    sys.exit(run_cli(main))
