"""The image's attachments beside its digest: SBOM, signed provenance, sigstore signature.

Where they live: registries without the OCI 1.1 referrers API (Debian's docker-registry 2.8
among them) get the tag scheme that cosign-style tools read, one tag per kind beside the image:

    REPO:sha256-<hex>.sbom   an artifact whose layers are the SPDX JSON (text/spdx+json) and,
                             when built, syft's CycloneDX (application/vnd.cyclonedx+json)
    REPO:sha256-<hex>.att    an artifact whose one layer is a DSSE envelope (in-toto statement,
                             SLSA provenance v1), signed with the same key as the image
    REPO:sha256-<hex>.sig    skopeo's sigstore signature of the manifest digest (skopeo writes it:
                             `use-sigstore-attachments` in a registries.d file of our own)

The image manifest is never rewritten: its digest is the same signed or not.
Pushing twice uploads nothing: an attachment already there is kept when it says the same thing
(the same SBOM bytes; a provenance with the same statement signed by this key; a signature by
this key), because ECDSA signatures differ on every signing.
"""
from __future__ import annotations

import base64
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.hashing import sha256_file
from tools.common.jsonfmt import canonical_json
from tools.image import registry_client
from tools.image import signing
from tools.image.layout import CONFIG_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, blob_path, read_index_manifest, sha256_digest

SBOM, PROVENANCE, SIGNATURE = "sbom", "att", "sig"
SPDX_MEDIA_TYPE = "text/spdx+json"
CYCLONEDX_MEDIA_TYPE = "application/vnd.cyclonedx+json"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://kimi-k3.invalid/build-types/bazel-image/v1"
BUILDER_ID = "https://kimi-k3.invalid/builders/tools-bazel"
COSIGN_SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
SIGSTORE_SIGNATURE_MEDIA_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
# The files `verify` compares with the checkout (workspace paths): every pin of the build.
LOCK_FILES = ("third_party/pins.lock.json", "third_party/debian.lock.json", "third_party/requirements_lock.txt")


def attachment_tag(digest: str, kind: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    return f"{algorithm}-{hexpart}.{kind}"


# ---------------------------------------------------------------- the provenance statement

@dataclass(frozen=True)
class Source:
    uri: str
    commit: str  # "" when the workspace is not a git checkout
    dirty: bool


def workspace_source(workspace: Path) -> Source:
    """The commit a build came from; a tree with uncommitted changes to tracked files is `dirty`."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(workspace), *args], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""
    commit = git("rev-parse", "HEAD")
    if not commit:
        return Source(uri=f"file://{workspace}", commit="", dirty=True)
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    remote = git("config", "--get", "remote.origin.url")
    return Source(uri="git+" + (remote or "file://" + str(workspace)), commit=commit, dirty=dirty)


def provenance_statement(*, manifest_digest: str, stack: str, kernel_selection: str,
                         locks: Mapping[str, Path], toolchain_pins: Sequence[Mapping[str, str]],
                         gate_manifests: Mapping[str, Path], sbom: Path, source: Source,
                         sbom_cyclonedx: Path | None = None) -> dict[str, Any]:
    """An in-toto statement (SLSA provenance v1) of the image with this manifest digest.

    No time and no host name: the same build gives the same statement, so a second push finds
    the provenance it would write already there."""
    source_dep: dict[str, Any] = {"name": "source", "uri": source.uri,
                                  "annotations": {"dirty": source.dirty}}
    if source.commit:
        source_dep["digest"] = {"gitCommit": source.commit}
    deps = [source_dep]
    deps += [{"name": name, "digest": {"sha256": sha256_file(path)}} for name, path in sorted(locks.items())]
    deps += [{"name": f"gate-manifest/{name}", "digest": {"sha256": sha256_file(path)}}
             for name, path in sorted(gate_manifests.items())]
    deps += [{"name": f"toolchain/{p['toolchain']}/{p['name']}", "uri": p["uri"], "digest": {"sha256": p["sha256"]}}
             for p in toolchain_pins]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"kimi-k3-{stack}", "digest": {"sha256": manifest_digest.split(":", 1)[1]}}],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"target": "//image:image", "stack": stack, "kernel_selection": kernel_selection},
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID},
                "byproducts": [{"name": "sbom.spdx.json", "mediaType": SPDX_MEDIA_TYPE,
                                "digest": {"sha256": sha256_file(sbom)}}]
                + ([{"name": "sbom.cdx.json", "mediaType": CYCLONEDX_MEDIA_TYPE,
                     "digest": {"sha256": sha256_file(sbom_cyclonedx)}}] if sbom_cyclonedx else []),
            },
        },
    }


def toolchain_pins(lock: Any) -> list[dict[str, str]]:
    """Every pin of the lock's compiler toolchains (the kernel stage's CUDA), for the provenance."""
    out = []
    for name, toolchain in sorted(lock.toolchains.items()):
        for pin_name in toolchain.pins:
            pin = lock.pin(pin_name)
            out.append({"toolchain": name, "name": pin_name, "uri": pin.urls[0] if pin.urls else "",
                        "sha256": pin.sha256})
    return out


def statement_subject(statement: Mapping[str, Any]) -> str:
    try:
        return "sha256:" + statement["subject"][0]["digest"]["sha256"]
    except (KeyError, IndexError, TypeError):
        return ""


def lock_digests(statement: Mapping[str, Any]) -> dict[str, str]:
    deps = statement.get("predicate", {}).get("buildDefinition", {}).get("resolvedDependencies", [])
    return {d["name"]: d.get("digest", {}).get("sha256", "") for d in deps if d.get("name") in LOCK_FILES}


def sbom_digests(statement: Mapping[str, Any]) -> dict[str, str]:
    """{media type: digest} of the SBOM documents the provenance records."""
    return {p.get("mediaType", ""): "sha256:" + p.get("digest", {}).get("sha256", "")
            for p in statement.get("predicate", {}).get("runDetails", {}).get("byproducts", [])
            if p.get("mediaType") in (SPDX_MEDIA_TYPE, CYCLONEDX_MEDIA_TYPE)}


# ---------------------------------------------------------------- attachment artifacts

def write_artifact(out: Path, media_type: str, data: bytes, annotations: Mapping[str, str] | None = None,
                   more: Sequence[tuple[str, bytes]] = ()) -> str:
    """An OCI layout at `out` holding one artifact manifest with `data` as its first layer (and
    `more` (media type, bytes) after it); returns the manifest digest. Canonical JSON, so the same
    data gives the same digest."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(content: bytes) -> dict[str, Any]:
        digest = sha256_digest(content)
        (blobs / digest.split(":", 1)[1]).write_bytes(content)
        return {"digest": digest, "size": len(content)}

    layer = {"mediaType": media_type, **put(data)}
    if annotations:
        layer["annotations"] = dict(annotations)
    layers = [layer, *({"mediaType": t, **put(d)} for t, d in more)]
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
                "config": {"mediaType": CONFIG_MEDIA_TYPE, **put(b"{}")}, "layers": layers}
    manifest_bytes = canonical_json(manifest)
    desc = {"mediaType": MANIFEST_MEDIA_TYPE, **put(manifest_bytes)}
    (out / "index.json").write_bytes(canonical_json({"schemaVersion": 2, "manifests": [desc]}))
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    return str(desc["digest"])


def read_artifact(layout: Path) -> list[tuple[dict[str, Any], bytes]]:
    """[(layer descriptor, layer bytes)] of the one manifest of an OCI layout."""
    _, manifest_bytes = read_index_manifest(layout)
    manifest = json.loads(manifest_bytes)
    return [(layer, blob_path(layout, layer["digest"]).read_bytes()) for layer in manifest.get("layers", [])]


# ---------------------------------------------------------------- registry access (skopeo)

class Registry:
    """The skopeo calls of one repository with one set of credentials (tools/image/push.py's).
    push.py imports this module only inside its functions, so the two import each other safely."""

    def __init__(self, repo: registry_client.Repository, creds: registry_client.Credentials, tmpdir: Path) -> None:
        self.repo, self.creds, self.tmpdir = repo, creds, tmpdir
        registries_d = tmpdir / "registries.d"
        registries_d.mkdir(exist_ok=True)
        # Our own registries.d: signatures as cosign-style attachments (sha256-<hex>.sig), for
        # every registry, whatever the machine's /etc/containers/registries.d says.
        (registries_d / "kimi-k3.yaml").write_text("default-docker:\n  use-sigstore-attachments: true\n")
        self.registries_d = registries_d

    def skopeo(self, args: Sequence[str], what: str) -> bytes:
        return registry_client.run_skopeo(["--registries.d", str(self.registries_d), *args], self.repo, self.creds, what)

    def try_skopeo(self, args: Sequence[str]) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([signing.skopeo(), "--registries.d", str(self.registries_d), *args],
                              capture_output=True)

    def manifest(self, suffix: str) -> bytes | None:
        """The raw manifest at REPO<suffix>, None when the registry has none there."""
        proc = self.try_skopeo(["inspect", "--raw", *registry_client.tls_args(self.repo, "tls-verify"),
                                *registry_client.auth_args(self.creds, "authfile"), self.repo.ref(suffix)])
        if proc.returncode == 0:
            return proc.stdout
        err = proc.stderr.decode(errors="replace")
        if "manifest unknown" in err or "not found" in err.lower():
            return None
        last = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise UserError(f"{self.repo}{suffix}: reading the manifest failed: {last}")

    def pull_artifact(self, tag: str) -> list[tuple[dict[str, Any], bytes]] | None:
        """The layers of the artifact at REPO:tag (None when there is none)."""
        if self.manifest(":" + tag) is None:
            return None
        out = Path(tempfile.mkdtemp(prefix="artifact.", dir=self.tmpdir)) / "layout"
        self.skopeo(["copy", "--preserve-digests", "--remove-signatures", *registry_client.tls_args(self.repo, "src-tls-verify"),
                     *registry_client.auth_args(self.creds, "src-authfile"), self.repo.ref(":" + tag), f"oci:{out}"],
                    f"reading {tag}")
        return read_artifact(out)

    def push_artifact(self, layout: Path, tag: str) -> tuple[int, int]:
        """Push an artifact layout to REPO:tag; (blobs uploaded, bytes uploaded)."""
        client = registry_client.RegistryClient(self.repo, self.creds)
        _, manifest_bytes = read_index_manifest(layout)
        manifest = json.loads(manifest_bytes)
        blobs = [manifest["config"], *manifest["layers"]]
        missing = [b for b in blobs if client.blob_exists(b["digest"]) is not True]
        self.skopeo(["copy", "--preserve-digests", *registry_client.tls_args(self.repo, "dest-tls-verify"),
                     *registry_client.auth_args(self.creds, "dest-authfile"), f"oci:{layout}", self.repo.ref(":" + tag)],
                    f"pushing {tag}")
        return len(missing), sum(int(b["size"]) for b in missing)

    def sign(self, digest: str, key: Path, passphrase_file: Path) -> None:
        """skopeo signs the manifest digest (sigstore), storing the signature as REPO:sha256-<hex>.sig.

        A copy of the image onto itself: every blob is already there, so nothing but the
        signature is uploaded, and the manifest stays byte for byte the same."""
        ref = self.repo.ref("@" + digest)
        self.skopeo(["copy", "--preserve-digests", *registry_client.tls_args(self.repo, "src-tls-verify"),
                     *registry_client.tls_args(self.repo, "dest-tls-verify"), *registry_client.auth_args(self.creds, "src-authfile"),
                     *registry_client.auth_args(self.creds, "dest-authfile"), "--sign-by-sigstore-private-key", str(key),
                     "--sign-passphrase-file", str(passphrase_file), ref, ref], "signing the manifest digest")


# ---------------------------------------------------------------- signatures already there

def sigstore_signed_by(layers: Sequence[tuple[dict[str, Any], bytes]], digest: str, public_key: Any) -> bool:
    """Whether one of a .sig artifact's signatures is public_key's over this manifest digest (the
    check push uses to keep a signature; `verify` checks with skopeo's containers policy)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    for desc, payload in layers:
        encoded = desc.get("annotations", {}).get(COSIGN_SIGNATURE_ANNOTATION)
        if not encoded:
            continue
        try:
            public_key.verify(base64.b64decode(encoded), payload, ec.ECDSA(hashes.SHA256()))
            signed = json.loads(payload)["critical"]["image"]["docker-manifest-digest"]
        except (InvalidSignature, ValueError, KeyError, TypeError):
            continue
        if signed == digest:
            return True
    return False


def provenance_envelope(layers: Sequence[tuple[dict[str, Any], bytes]] | None) -> dict[str, Any] | None:
    """The DSSE envelope of an .att artifact's layers; None when there is no artifact; ValueError
    naming the layer when there is one but it holds no envelope (no such layer, not JSON, not the
    envelope's shape): present but malformed, which is not the same as missing."""
    if layers is None:
        return None
    for desc, data in layers:
        if desc.get("mediaType") == DSSE_MEDIA_TYPE:
            try:
                envelope = json.loads(data)
            except ValueError:
                raise ValueError(f"layer {desc.get('digest')} is not JSON") from None
            try:
                signing.dsse_envelope(envelope)
            except ValueError as e:
                raise ValueError(f"layer {desc.get('digest')}: {e}") from None
            return envelope
    raise ValueError(f"no {DSSE_MEDIA_TYPE} layer among its {len(layers)}")


@dataclass(frozen=True)
class Signer:
    key: Path
    passphrase_file: Path
    public_key_path: Path


def signer_keys(signer: Signer) -> tuple[Any, Any]:
    """(private key, public key) of a signer whose files belong together; push calls this before
    it uploads anything, so a wrong passphrase or a mixed-up pair leaves the registry untouched."""
    public_key = signing.load_public_key(signer.public_key_path)
    private_key = signing.load_private_key(signer.key, signer.passphrase_file)
    if private_key.public_key().public_numbers() != public_key.public_numbers():
        raise UserError(f"--sign-key {signer.key}: its public key is not {signer.public_key_path}; "
                        "pass the PREFIX.pub written with it")
    return private_key, public_key


def attach(registry: Registry, digest: str, sbom: bytes, statement: Mapping[str, Any], signer: Signer,
           log: Callable[[str], None], sbom_cyclonedx: bytes | None = None) -> dict[str, tuple[int, int]]:
    """SBOM, provenance and signature beside `digest`; {kind: (blobs uploaded, bytes)}."""
    private_key, public_key = signer_keys(signer)
    uploaded: dict[str, tuple[int, int]] = {}
    work = Path(tempfile.mkdtemp(prefix="attach.", dir=registry.tmpdir))

    sbom_layout = work / "sbom"
    sbom_manifest = write_artifact(sbom_layout, SPDX_MEDIA_TYPE, sbom,
                                   more=[(CYCLONEDX_MEDIA_TYPE, sbom_cyclonedx)] if sbom_cyclonedx else [])
    tag = attachment_tag(digest, SBOM)
    existing = registry.manifest(":" + tag)
    if existing is not None and sha256_digest(existing) == sbom_manifest:
        uploaded[SBOM] = (0, 0)
    else:
        uploaded[SBOM] = registry.push_artifact(sbom_layout, tag)

    payload = canonical_json(statement)
    tag = attachment_tag(digest, PROVENANCE)
    try:
        envelope = provenance_envelope(registry.pull_artifact(tag))
        kept = envelope is not None and signing.dsse_open(envelope, public_key, IN_TOTO_PAYLOAD_TYPE) == payload
    except ValueError:  # malformed, or not this statement by this key: replaced
        kept = False
    if kept:
        uploaded[PROVENANCE] = (0, 0)
    else:
        envelope = signing.dsse_sign(payload, IN_TOTO_PAYLOAD_TYPE, private_key)
        att_layout = work / "att"
        write_artifact(att_layout, DSSE_MEDIA_TYPE, canonical_json(envelope),
                       {"predicateType": SLSA_PROVENANCE, COSIGN_SIGNATURE_ANNOTATION: ""})
        uploaded[PROVENANCE] = registry.push_artifact(att_layout, tag)

    tag = attachment_tag(digest, SIGNATURE)
    layers = registry.pull_artifact(tag)
    if layers is not None and sigstore_signed_by(layers, digest, public_key):
        uploaded[SIGNATURE] = (0, 0)
    else:
        registry.sign(digest, signer.key, signer.passphrase_file)
        uploaded[SIGNATURE] = (1, -1)  # skopeo uploads the signature itself: one blob, size unknown
    for kind, (count, size) in uploaded.items():
        state = "already there, kept" if count == 0 else f"pushed ({count} blob{'s' if count != 1 else ''}" + \
            (f", {size} bytes)" if size >= 0 else ")")
        log(f"[oci_push] {registry.repo}:{attachment_tag(digest, kind)}: {state}")
    return uploaded
