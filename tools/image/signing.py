"""One sigstore key pair signs the image: skopeo signs the manifest digest with it, and this module
signs the provenance's DSSE envelope with the same private key, so `verify --key PUB` checks both.

Usage:
    python3 -m tools.image.signing generate --out-prefix PREFIX --passphrase-file FILE
        writes PREFIX.private (encrypted) and PREFIX.pub; refuses to overwrite either

The private key file is the one `skopeo generate-sigstore-key` writes (sigstore's format: PEM
around JSON {kdf: scrypt, cipher: nacl/secretbox, ciphertext}; the plaintext is a PKCS#8 ECDSA
P-256 key). skopeo reads it itself for `--sign-by-sigstore-private-key`; for the DSSE envelope it
is decrypted here in memory (hashlib's scrypt, PyNaCl's secretbox), never written decrypted. The
passphrase always comes from a file, never from a command line.
"""
from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli

PRIVATE_SUFFIX, PUBLIC_SUFFIX = ".private", ".pub"
# Under tools/bazel the tools run in a sealed root that sees only some host paths.
BIND_HINT = " (under tools/bazel: a path outside the workspace, the cache root and /tmp needs KIMI_K3_EXTRA_BINDS=DIR)"
_PEM = re.compile(rb"-----BEGIN ENCRYPTED (?:SIGSTORE|COSIGN) PRIVATE KEY-----\s*(?P<body>[A-Za-z0-9+/=\s]+?)"
                  rb"-----END ENCRYPTED (?:SIGSTORE|COSIGN) PRIVATE KEY-----")


def skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        raise UserError("skopeo: not on PATH; install it (apt-get install -y skopeo) or run through tools/bazel")
    return path


def read_passphrase(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"--passphrase-file {path}: unreadable ({e.strerror}); pass the file holding the key's "
                        f"passphrase{BIND_HINT}") from None
    # skopeo reads the first line of the file as the passphrase: so do we.
    return data.split(b"\n", 1)[0]


def generate(prefix: Path, passphrase_file: Path) -> tuple[Path, Path]:
    """PREFIX.private + PREFIX.pub from `skopeo generate-sigstore-key`, both or neither."""
    private, public = Path(str(prefix) + PRIVATE_SUFFIX), Path(str(prefix) + PUBLIC_SUFFIX)
    for path in (private, public):
        if path.exists():
            raise UserError(f"{path}: exists; refusing to overwrite a signing key (move it away or pick another --out-prefix)")
    if not read_passphrase(passphrase_file):
        raise UserError(f"--passphrase-file {passphrase_file}: empty first line; write a passphrase into it")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".kimi-k3-key.", dir=prefix.parent) as tmp:
        staged = Path(tmp) / "key"
        proc = subprocess.run([skopeo(), "generate-sigstore-key", "--output-prefix", str(staged),
                               "--passphrase-file", str(passphrase_file)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"skopeo generate-sigstore-key failed: {proc.stderr.strip().splitlines()[-1:]}")
        os.chmod(Path(str(staged) + PRIVATE_SUFFIX), 0o600)
        os.replace(Path(str(staged) + PUBLIC_SUFFIX), public)
        os.replace(Path(str(staged) + PRIVATE_SUFFIX), private)
    return private, public


LOCAL_KEY_NAME = "kimi-k3"


def local_key() -> tuple[Path, Path, Path]:
    """(private key, passphrase file, public key) of this user's local signing key under the cache
    root (signing/kimi-k3.*), generated on first use: what the main job signs with when no key is
    given. An operator's key is passed instead (--sign-key, --sign-passphrase-file)."""
    import fcntl
    import secrets

    from tools.common.cache import cache_root
    from tools.common.files import write_bytes_atomic

    root = cache_root() / "signing"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    prefix = root / LOCAL_KEY_NAME
    private, public = Path(str(prefix) + PRIVATE_SUFFIX), Path(str(prefix) + PUBLIC_SUFFIX)
    passphrase = root / f"{LOCAL_KEY_NAME}.passphrase"
    with open(root / "signing.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first pushes generate one key, not two
        if not private.exists():
            if not passphrase.exists():
                # Readable by this user only; the directory (0700) hides it until the chmod.
                write_bytes_atomic(passphrase, secrets.token_urlsafe(32).encode() + b"\n")
                os.chmod(passphrase, 0o600)
            generate(prefix, passphrase)
            print(f"generated a local signing key {private} (passphrase in {passphrase}); verify with "
                  f"--key {public}", file=sys.stderr)
    if not public.is_file() or not passphrase.is_file():
        raise UserError(f"{root}: the local signing key is incomplete ({private.name}, {public.name}, "
                        f"{passphrase.name}); move the directory away to generate a new key")
    return private, passphrase, public


def load_private_key(path: Path, passphrase_file: Path) -> Any:
    """The ECDSA private key of a sigstore private key file (cryptography's object)."""
    from cryptography.hazmat.primitives.serialization import load_der_private_key
    from nacl.exceptions import CryptoError
    from nacl.secret import SecretBox

    try:
        m = _PEM.search(path.read_bytes())
    except OSError as e:
        raise UserError(f"--sign-key {path}: unreadable ({e.strerror}); pass PREFIX.private from "
                        f"`tools/bazel run //image:signing_key`{BIND_HINT}") from None
    try:
        if m is None:
            raise ValueError("no ENCRYPTED SIGSTORE/COSIGN PRIVATE KEY block")
        doc = json.loads(base64.b64decode(b"".join(m.group("body").split())))
        kdf, cipher = doc["kdf"], doc["cipher"]
        if kdf["name"] != "scrypt" or cipher["name"] != "nacl/secretbox":
            raise ValueError(f"kdf {kdf['name']}, cipher {cipher['name']}")
        params = kdf["params"]
        n, r, p = int(params["N"]), int(params["r"]), int(params["p"])
        salt, nonce = base64.b64decode(kdf["salt"]), base64.b64decode(cipher["nonce"])
        ciphertext = base64.b64decode(doc["ciphertext"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--sign-key {path}: not a sigstore private key ({e}); pass the PREFIX.private "
                        "that skopeo generate-sigstore-key wrote") from None
    secret = hashlib.scrypt(read_passphrase(passphrase_file), salt=salt, n=n, r=r, p=p, dklen=32,
                            maxmem=256 * r * n + (1 << 20))
    try:
        der = SecretBox(secret).decrypt(ciphertext, nonce)
    except CryptoError:
        raise UserError(f"--sign-passphrase-file {passphrase_file}: does not decrypt {path}; pass the passphrase "
                        "the key was generated with") from None
    return load_der_private_key(der, password=None)


def load_public_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        return load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UserError(f"--key {path}: not a PEM public key ({type(e).__name__}); pass the PREFIX.pub "
                        f"written beside the signing key{BIND_HINT}") from None


def _sslib_key(public_key: Any) -> Any:
    from securesystemslib.signer import SSlibKey
    return SSlibKey.from_crypto(public_key)


def dsse_sign(payload: bytes, payload_type: str, private_key: Any) -> dict[str, Any]:
    """A DSSE envelope (securesystemslib) over payload, signed by private_key."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import CryptoSigner

    envelope = Envelope(payload=payload, payload_type=payload_type, signatures={})
    envelope.sign(CryptoSigner(private_key, _sslib_key(private_key.public_key())))
    return envelope.to_dict()


def dsse_open(envelope: dict[str, Any], public_key: Any, payload_type: str) -> bytes:
    """The payload of an envelope that public_key signed; ValueError naming what is wrong."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError

    try:
        env = Envelope.from_dict(copy.deepcopy(envelope))  # from_dict consumes its argument
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a DSSE envelope ({type(e).__name__}: {e})") from None
    if env.payload_type != payload_type:
        raise ValueError(f"payloadType {env.payload_type!r}, expected {payload_type!r}")
    key = _sslib_key(public_key)
    # securesystemslib matches signatures to keys by keyid: derive it from the key itself, so a
    # signature by another key is reported as such and not as a keyid mismatch only.
    try:
        env.verify([key], 1)
    except VerificationError:
        ids = sorted(s.keyid for s in env.signatures.values())
        raise ValueError(f"no signature by this key (keyid {key.keyid[:16]}...; the envelope is signed by "
                         f"{', '.join(i[:16] + '...' for i in ids) or 'nobody'})") from None
    return env.payload


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="a new key pair (skopeo generate-sigstore-key)")
    g.add_argument("--out-prefix", required=True, type=Path)
    g.add_argument("--passphrase-file", required=True, type=Path)
    args = p.parse_args(argv)
    private, public = generate(args.out_prefix, args.passphrase_file)
    print(f"signing key: {private} (keep it off the repository and the image)")
    print(f"public key:  {public} (give it to whoever runs `python3 -m tools.image.verify REF --key {public.name}`)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
