"""Push an OCI image layout by digest, verify it, then tag it.

Usage:
    python3 -m tools.image.push --layout DIR [--repository HOST[:PORT]/PATH] [--tag T]... [--authfile F]
    python3 -m tools.image.push --stop-local-registry

Steps, each a guarantee:
1. Blob existence is probed with the registry API (HEAD /v2/<repo>/blobs/<digest>) to report how
   many bytes must be uploaded; skopeo skips those same blobs.
2. `skopeo copy --preserve-digests oci:DIR docker://REPO@sha256:M` pushes blobs and the manifest
   by digest only (no tag yet). --preserve-digests makes skopeo fail rather than re-encode.
3. `skopeo inspect --raw` reads the manifest back; its sha256 must equal M.
4. Only then each tag is written (skopeo copy REPO@M -> REPO:T) and read back the same way.
A push that dies in step 2 leaves blobs but no tag; rerunning uploads only what is missing.

Credentials: --authfile, else $KIMI_K3_REGISTRY_USERNAME/$KIMI_K3_REGISTRY_PASSWORD (written to a
0600 temp auth file, never on a command line), else skopeo's usual lookup ($REGISTRY_AUTH_FILE,
$XDG_RUNTIME_DIR/containers/auth.json, ~/.docker/config.json). Credentials are never printed.
TLS is verified except for loopback registries (127.0.0.1, localhost, ::1). The API probes send
Authorization only within the registry's scheme+host+port (a redirect to blob storage on another
host drops it), and Basic credentials go to a Bearer token realm only over https (or loopback).

The jobs live one per module: registry_client (references, credentials, probes, skopeo),
local_registry (the registry started here), image_contents (what the layout holds), attest
(SBOM, provenance, signature attached beside the digest), and this one (the push and its CLI).

No --repository: a local registry (Debian's docker-registry) on 127.0.0.1 with storage under
${KIMI_K3_CACHE:-${XDG_CACHE_HOME:-~/.cache}/kimi-k3-build}/registry is reused or started, and
left running so the image can be pulled afterwards; `--stop-local-registry` stops it. Starting
and stopping hold a lock beside the storage (registry/registry.lock), so concurrent pushes share
one registry; and pushes of one repository to it take turns, each holding
registry/locks/<repository>.lock from its first probe to its last tag (docker-registry 2.8 rewrites
a repository's link files in place: see local_push_lock). Pushes to another registry take no lock.

Signing keys are checked before anything else: a key or passphrase file others can read, a
malformed key, a wrong passphrase stop the push before a registry starts or a blob is uploaded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tools.common import credentials
from tools.common.cliargs import named_paths
from tools.common.errors import UserError, run_cli
from tools.common.files import scratch_dir
from tools.image import attest, signing
from tools.image.image_contents import default_repository_path, kernel_selection, print_contents
from tools.image.layout import blob_path, read_index_manifest, sha256_digest
from tools.image.local_registry import local_push_lock, local_registry, local_registry_root, stop_local_registry
from tools.image.registry_client import (Credentials, RegistryClient, Repository, auth_args, parse_repository,
                                         remote_manifest_digest, resolve_credentials, run_skopeo, tls_args)
from tools.pins import lock as lockfile

SIGN_KEY_ENV, SIGN_PASSPHRASE_ENV = "KIMI_K3_SIGNING_KEY", "KIMI_K3_SIGNING_PASSPHRASE_FILE"
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

# ---------------------------------------------------------------- push

@dataclass(frozen=True)
class PushResult:
    reference: str
    manifest_digest: str
    config_digest: str
    index_digest: str
    blobs_total: int
    blobs_uploaded: int | None
    bytes_uploaded: int | None
    tags: tuple[str, ...]


def layout_blobs(layout: Path) -> tuple[str, str, str, list[tuple[str, int]]]:
    """(manifest digest, config digest, index digest, [(blob digest, size)]) of a layout."""
    desc, manifest_bytes = read_index_manifest(layout)
    manifest = json.loads(manifest_bytes)
    blobs = [(manifest["config"]["digest"], int(manifest["config"]["size"]))]
    blobs += [(l["digest"], int(l["size"])) for l in manifest["layers"]]
    for digest, size in blobs:
        path = blob_path(layout, digest)
        if not path.is_file() or path.stat().st_size != size:
            raise UserError(f"{layout}: blob {digest} missing or wrong size; rebuild the layout")
    index_digest = sha256_digest((layout / "index.json").read_bytes())
    return desc["digest"], manifest["config"]["digest"], index_digest, blobs


@dataclass(frozen=True)
class Attestations:
    """What push attaches beside the digest before tagging (tools/image/attest.py)."""

    sbom: Path
    statement: Callable[[str], dict]  # manifest digest -> the provenance statement
    signer: attest.Signer
    sbom_cyclonedx: Path | None = None


def check_tags(tag_names: Sequence[str]) -> None:
    """Each --tag is a valid OCI tag: one line naming the first that is not."""
    for t in tag_names:
        if not _TAG_RE.match(t):
            raise UserError(f"--tag {t!r}: not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})")


def push(layout: Path, repo: Repository, tag_names: Sequence[str], authfile: Path | None = None,
         attestations: Attestations | None = None, local_root: Path | None = None) -> PushResult:
    """local_root: the storage root of the local registry `repo` is on (local_registry()), whose
    pushes of one repository take turns (local_push_lock); None for any other registry."""
    check_tags(tag_names)
    manifest_digest, config_digest, index_digest, blobs = layout_blobs(layout)
    if attestations is not None:
        attest.signer_keys(attestations.signer)  # a bad key stops the push before any upload
    turn = local_push_lock(local_root, repo) if local_root is not None else nullcontext()
    # The credentials' auth file: scratch_dir removes what a killed earlier push left.
    with scratch_dir("kimi-k3-push.") as tmp, turn:
        creds = resolve_credentials(repo, authfile, Path(tmp))
        client = RegistryClient(repo, creds)
        try:
            present = [client.blob_exists(d) for d, _ in blobs]
        except (urllib.error.URLError, OSError) as e:
            raise UserError(f"{repo}: registry unreachable ({e}); start it or fix --repository") from e
        known = None not in present
        missing = [(d, s) for (d, s), p in zip(blobs, present) if p is False]
        bytes_up = sum(s for _, s in missing) if known else None
        print(f"[oci_push] {repo}: {len(missing) if known else '?'} of {len(blobs)} blobs to upload"
              f" ({bytes_up if known else '?'} bytes)", file=sys.stderr)
        started = time.monotonic()
        run_skopeo(["copy", "--preserve-digests", *tls_args(repo, "dest-tls-verify"),
                    *auth_args(creds, "dest-authfile"), f"oci:{layout}", repo.ref("@" + manifest_digest)],
                   repo, creds, "pushing the manifest by digest")
        print(f"[oci_push] uploaded in {time.monotonic() - started:.1f} s", file=sys.stderr)
        remote = remote_manifest_digest(repo, "@" + manifest_digest, creds)
        if remote != manifest_digest:
            raise UserError(f"{repo}: registry returned manifest {remote}, expected {manifest_digest}; "
                            "no tag written; the registry rewrote the manifest")
        if attestations is not None:
            # Before any tag: whoever pulls a tag finds the attachments already beside its digest.
            attest.attach(attest.Registry(repo, creds, Path(tmp)), manifest_digest, attestations.sbom.read_bytes(),
                          attestations.statement(manifest_digest), attestations.signer,
                          lambda line: print(line, file=sys.stderr),
                          attestations.sbom_cyclonedx.read_bytes() if attestations.sbom_cyclonedx else None)
        write_tags(repo, creds, manifest_digest, tag_names)
    return PushResult(reference=f"{repo}@{manifest_digest}", manifest_digest=manifest_digest,
                      config_digest=config_digest, index_digest=index_digest, blobs_total=len(blobs),
                      blobs_uploaded=len(missing) if known else None, bytes_uploaded=bytes_up,
                      tags=tuple(tag_names))


def write_tags(repo: Repository, creds: Credentials, manifest_digest: str, tag_names: Sequence[str]) -> None:
    """Each tag onto the pushed digest, read back."""
    for t in tag_names:
        run_skopeo(["copy", "--preserve-digests", *tls_args(repo, "src-tls-verify"),
                    *tls_args(repo, "dest-tls-verify"), *auth_args(creds, "src-authfile"),
                    *auth_args(creds, "dest-authfile"), repo.ref("@" + manifest_digest), repo.ref(":" + t)],
                   repo, creds, f"tagging {t}")
        if remote_manifest_digest(repo, ":" + t, creds) != manifest_digest:
            raise UserError(f"{repo}:{t}: tag does not point at {manifest_digest} after tagging; "
                            "someone else pushed the tag concurrently; rerun")


def print_result(r: PushResult) -> None:
    print(f"manifest digest: {r.manifest_digest}")
    print(f"config digest:   {r.config_digest}")
    print(f"index digest:    {r.index_digest}")
    print(f"pushed:          {r.reference}")
    print(f"uploaded:        {r.blobs_uploaded if r.blobs_uploaded is not None else '?'} of {r.blobs_total} blobs, "
          f"{r.bytes_uploaded if r.bytes_uploaded is not None else '?'} bytes")
    repo = r.reference.split("@")[0]
    for t in r.tags:
        print(f"tagged:          {repo}:{t}")


def attestations_from_args(args: argparse.Namespace) -> Attestations | None:
    if args.sbom is None:
        return None

    for flag, path in (("--sbom", args.sbom), ("--sbom-cyclonedx", args.sbom_cyclonedx)):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file; pass the image SBOM (//image:image_sbom)")
    if not args.stack or args.lock is None:
        raise UserError("--sbom needs --stack and --lock (the provenance records them)")
    signer = signer_from_args(args)
    locks = dict(named_paths(args.provenance_lock, "--provenance-lock", form="WORKSPACE_PATH=FILE"))
    gates = dict(named_paths(args.gate_manifest, "--gate-manifest"))
    lock = lockfile.load(args.lock)
    workspace = args.workspace or Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."))
    source = attest.workspace_source(workspace)
    selection = args.kernel_selection or kernel_selection(args.layout)

    def statement(digest: str) -> dict:
        return attest.provenance_statement(manifest_digest=digest, stack=args.stack,
                                           kernel_selection=selection, locks=locks,
                                           toolchain_pins=attest.toolchain_pins(lock), gate_manifests=gates,
                                           sbom=args.sbom, source=source, sbom_cyclonedx=args.sbom_cyclonedx)
    return Attestations(args.sbom, statement, signer, args.sbom_cyclonedx)


def signer_from_args(args: argparse.Namespace) -> attest.Signer:
    """The key pair and passphrase file of the flags, else of the environment, else the local key;
    checked here, before a registry starts: a secret others can read, a malformed key, a wrong
    passphrase, a mixed-up pair."""

    key = args.sign_key or (Path(os.environ[SIGN_KEY_ENV]) if os.environ.get(SIGN_KEY_ENV) else None)
    passphrase = args.sign_passphrase_file or (
        Path(os.environ[SIGN_PASSPHRASE_ENV]) if os.environ.get(SIGN_PASSPHRASE_ENV) else None)
    if key is None and passphrase is None:
        key, passphrase, public = signing.local_key()
    elif key is None or passphrase is None:
        raise UserError(f"--sign-key and --sign-passphrase-file (${SIGN_KEY_ENV}, ${SIGN_PASSPHRASE_ENV}) go "
                        "together: pass both, or neither for the local key")
    else:
        public = Path(str(key).removesuffix(signing.PRIVATE_SUFFIX) + signing.PUBLIC_SUFFIX)
        if not public.is_file():
            raise UserError(f"--sign-key {key}: no {public.name} beside it; keep the key pair together")
    signer = attest.Signer(key, passphrase, public)
    attest.signer_keys(signer)
    return signer


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", type=Path, help="OCI image layout from tools/image/layout.py")
    p.add_argument("--repository", help="HOST[:PORT]/PATH; default: a local registry on 127.0.0.1")
    p.add_argument("--tag", action="append", default=[], help="tags to apply after the digest is verified")
    p.add_argument("--authfile", type=Path, help="docker/containers auth file")
    p.add_argument("--stop-local-registry", action="store_true", help="stop the registry this tool started")
    a = p.add_argument_group("attachments (tools/image/attest.py): SBOM, signed provenance, signature")
    a.add_argument("--sbom", type=Path, help="the image's SBOM (tools/image/image_sbom.py); attach all three")
    a.add_argument("--sbom-cyclonedx", type=Path, help="the same SBOM as CycloneDX, attached beside it")
    a.add_argument("--stack", help="the image's stack (provenance)")
    a.add_argument("--kernel-selection", default="", help="the kernel cache's selection (provenance; default: "
                   "the one the image's kernel_cache.json names)")
    a.add_argument("--lock", type=Path, help="pins.lock.json (its toolchains go into the provenance)")
    a.add_argument("--provenance-lock", action="append", default=[], metavar="WORKSPACE_PATH=FILE",
                   help="a lock file the provenance records by digest, under its workspace path")
    a.add_argument("--gate-manifest", action="append", default=[], metavar="NAME=FILE")
    a.add_argument("--workspace", type=Path, help="the checkout built from (default: $BUILD_WORKSPACE_DIRECTORY)")
    a.add_argument("--sign-key", type=Path, help=f"PREFIX.private (default: ${SIGN_KEY_ENV}, else a local key "
                   "generated under the cache root)")
    a.add_argument("--sign-passphrase-file", type=Path, help=f"its passphrase (default: ${SIGN_PASSPHRASE_ENV})")
    args = p.parse_args(argv)
    credentials.restore()  # the proxies' credentials, which tools/bazel keeps out of Bazel
    if args.stop_local_registry:
        return stop_local_registry()
    if args.layout is None:
        raise UserError("--layout: required; pass the OCI layout directory to push")
    attestations = attestations_from_args(args)  # its keys are checked before a registry starts
    if args.repository:
        repo = parse_repository(args.repository)
        local_root = local_registry_root(repo)
    else:
        reg = local_registry()
        repo, local_root = Repository(reg.host, default_repository_path(args.layout)), reg.root
    print_result(push(args.layout, repo, args.tag, args.authfile, attestations, local_root))
    print_contents(args.layout)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
