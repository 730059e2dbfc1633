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

Secrets stay the owner's: the private key and the passphrase are read only from files no one else
can read or change (tools/common/files.py require_owner_only: group or other bits are refused
with its `chmod 600`, before a push starts a registry or uploads anything), and a generated private
key is 0600 from the moment it exists (skopeo runs under umask 077 in a 0700 directory beside the
prefix; the pair is renamed into place).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.files import MODE, PRIVATE_MODE, require_owner_only, write_bytes_atomic

PRIVATE_SUFFIX, PUBLIC_SUFFIX = ".private", ".pub"
# Under tools/bazel the tools run in a sealed root that sees only some host paths.
BIND_HINT = " (under tools/bazel: a path outside the workspace, the cache root and /tmp needs KIMI_K3_EXTRA_BINDS=DIR)"
_PEM = re.compile(rb"-----BEGIN ENCRYPTED (?:SIGSTORE|COSIGN) PRIVATE KEY-----\s*(?P<body>[A-Za-z0-9+/=\s]+?)"
                  rb"-----END ENCRYPTED (?:SIGSTORE|COSIGN) PRIVATE KEY-----")
REGENERATE = ("regenerate it with `python3 -m tools.image.signing generate --out-prefix PREFIX --passphrase-file FILE` "
              "(tools/bazel run //image:signing_key) or pass the PREFIX.private that skopeo generate-sigstore-key wrote")
SALT_BYTES, NONCE_BYTES, MAC_BYTES = 32, 24, 16  # what skopeo/cosign write; NaCl's secretbox
# skopeo and cosign write N = 2**15..2**17, r = 8, p = 1. A file outside these bounds is named, not
# run: hashlib.scrypt refuses maxmem over 2 GiB with a traceback, and a large p runs for minutes.
SCRYPT_BOUNDS = {"N": (2, 1 << 20), "r": (1, 32), "p": (1, 16)}
SCRYPT_MAX_MEMORY = 1 << 29  # 128 * N * r bytes


def skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        raise UserError("skopeo: not on PATH; install it (apt-get install -y skopeo) or run through tools/bazel")
    return path


def read_passphrase(path: Path, flag: str = "--passphrase-file") -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: unreadable ({e.strerror}); pass the file holding the key's "
                        f"passphrase{BIND_HINT}") from None
    require_owner_only(path, flag)
    # skopeo reads the first line of the file as the passphrase: so do we.
    return data.split(b"\n", 1)[0]


def key_paths(prefix: Path) -> tuple[Path, Path]:
    return Path(str(prefix) + PRIVATE_SUFFIX), Path(str(prefix) + PUBLIC_SUFFIX)


def generate(prefix: Path, passphrase_file: Path) -> tuple[Path, Path]:
    """PREFIX.private + PREFIX.pub from `skopeo generate-sigstore-key`, both or neither."""
    private, public = key_paths(prefix)
    for path in (private, public):
        if path.exists():
            raise UserError(f"{path}: exists; refusing to overwrite a signing key (move it away or pick another --out-prefix)")
    if not read_passphrase(passphrase_file):
        raise UserError(f"--passphrase-file {passphrase_file}: empty first line; write a passphrase into it")
    with _staging_dir(prefix) as tmp:
        staged = Path(tmp) / "key"
        # umask 077: what skopeo writes is its owner's only from the moment it exists, whatever
        # mode skopeo asks for (1.22 asks 0600 for .private, 0644 for .pub).
        proc = subprocess.run([skopeo(), "generate-sigstore-key", "--output-prefix", str(staged),
                               "--passphrase-file", str(passphrase_file)], capture_output=True, text=True, umask=0o077)
        if proc.returncode != 0:
            raise UserError(f"skopeo generate-sigstore-key failed: {proc.stderr.strip().splitlines()[-1:]}")
        _move_pair(key_paths(staged), private, public)
    return private, public


def _staging_dir(prefix: Path) -> tempfile.TemporaryDirectory[str]:
    """A 0700 directory beside the prefix (same file system: the pair is renamed into place)."""
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix=".kimi-k3-key.", dir=prefix.parent)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise UserError(f"--out-prefix {prefix}: cannot write in {prefix.parent} ({why}); pass a prefix in a "
                        f"directory you can write{BIND_HINT}") from None


def _move_pair(staged: tuple[Path, Path], private: Path, public: Path) -> None:
    """Both keys into place or neither; the private key 0600 whatever wrote it, the public 0644."""
    os.chmod(staged[0], PRIVATE_MODE)
    os.chmod(staged[1], MODE)  # the public key is for whoever verifies
    os.replace(staged[1], public)
    try:
        os.replace(staged[0], private)
    except BaseException:
        public.unlink(missing_ok=True)
        raise


LOCAL_KEY_NAME = "kimi-k3"


def local_key() -> tuple[Path, Path, Path]:
    """(private key, passphrase file, public key) of this user's local signing key under the cache
    root (signing/kimi-k3.*), generated on first use: what the main job signs with when no key is
    given. An operator's key is passed instead (--sign-key, --sign-passphrase-file)."""
    import fcntl
    import secrets

    from tools.common.cache import cache_root

    root = cache_root() / "signing"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # one made before (mkdir leaves an existing directory as it is)
    prefix = root / LOCAL_KEY_NAME
    private, public = key_paths(prefix)
    passphrase = root / f"{LOCAL_KEY_NAME}.passphrase"
    with open(root / "signing.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first pushes generate one key, not two
        if not private.exists():
            if not passphrase.exists():
                # This user's only from its creation on (not after a chmod).
                write_bytes_atomic(passphrase, secrets.token_urlsafe(32).encode() + b"\n", mode=PRIVATE_MODE)
            generate(prefix, passphrase)
            print(f"generated a local signing key {private} (passphrase in {passphrase}); verify with "
                  f"--key {public}", file=sys.stderr)
    if not public.is_file() or not passphrase.is_file():
        raise UserError(f"{root}: the local signing key is incomplete ({private.name}, {public.name}, "
                        f"{passphrase.name}); move the directory away to generate a new key")
    return private, passphrase, public


@dataclass(frozen=True)
class SealedKey:
    """A sigstore private key file's fields, each checked: scrypt's parameters, secretbox's input."""

    n: int
    r: int
    p: int
    salt: bytes
    nonce: bytes
    ciphertext: bytes


def load_private_key(path: Path, passphrase_file: Path) -> Any:
    """The ECDSA private key of a sigstore private key file (cryptography's object)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.serialization import load_der_private_key
    from nacl.exceptions import CryptoError
    from nacl.secret import SecretBox

    try:
        sealed = sealed_key(path.read_bytes())
    except OSError as e:
        raise UserError(f"--sign-key {path}: unreadable ({e.strerror}); pass PREFIX.private from "
                        f"`tools/bazel run //image:signing_key`{BIND_HINT}") from None
    except ValueError as e:
        raise UserError(f"--sign-key {path}: not a sigstore private key ({e}); {REGENERATE}") from None
    # After the format, so that a public key passed here is named as such, not sent to chmod.
    require_owner_only(path, "--sign-key")
    passphrase = read_passphrase(passphrase_file, "--sign-passphrase-file")
    secret = hashlib.scrypt(passphrase, salt=sealed.salt, n=sealed.n, r=sealed.r, p=sealed.p, dklen=32,
                            maxmem=256 * sealed.r * sealed.n + (1 << 20))
    try:
        der = SecretBox(secret).decrypt(sealed.ciphertext, sealed.nonce)
    except CryptoError:
        raise UserError(f"--sign-passphrase-file {passphrase_file}: does not decrypt {path}; pass the passphrase "
                        "the key was generated with") from None
    try:
        return load_der_private_key(der, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise UserError(f"--sign-key {path}: not a sigstore private key (it decrypts to no PKCS#8 private key: "
                        f"{type(e).__name__}); {REGENERATE}") from None


def sealed_key(pem: bytes) -> SealedKey:
    """The fields of a sigstore private key file; ValueError naming the first one that is wrong."""
    m = _PEM.search(pem)
    if m is None:
        raise ValueError("no ENCRYPTED SIGSTORE/COSIGN PRIVATE KEY block")
    try:
        doc = json.loads(base64.b64decode(b"".join(m.group("body").split()), validate=True))
    except ValueError:
        raise ValueError("the PEM block is not base64 of JSON") from None
    if type(doc) is not dict:
        raise ValueError("the PEM block holds no JSON object")
    kdf, cipher = _member(doc, "kdf", dict), _member(doc, "cipher", dict)
    if kdf.get("name") != "scrypt" or cipher.get("name") != "nacl/secretbox":
        raise ValueError(f"kdf {kdf.get('name')!r}, cipher {cipher.get('name')!r}; expected scrypt, nacl/secretbox")
    n, r, p = _scrypt_params(_member(kdf, "params", dict, "kdf."))
    ciphertext = _b64_member(doc, "ciphertext", "")
    if len(ciphertext) <= MAC_BYTES:
        raise ValueError(f"ciphertext of {len(ciphertext)} bytes, not even secretbox's {MAC_BYTES}-byte MAC")
    return SealedKey(n, r, p, salt=_b64_member(kdf, "salt", "kdf.", SALT_BYTES),
                     nonce=_b64_member(cipher, "nonce", "cipher.", NONCE_BYTES), ciphertext=ciphertext)


_JSON_KINDS = {dict: "a JSON object", str: "a string", int: "an integer"}


def _member(obj: dict[str, Any], key: str, kind: type, where: str = "") -> Any:
    """obj[key] when it is exactly a `kind` (JSON's true is no integer); ValueError naming it."""
    if key not in obj:
        raise ValueError(f"{where}{key} is missing")
    value = obj[key]
    if type(value) is not kind:
        raise ValueError(f"{where}{key} {json.dumps(value)[:40]} is not {_JSON_KINDS[kind]}")
    return value


def _b64_member(obj: dict[str, Any], key: str, where: str, size: int | None = None) -> bytes:
    text = _member(obj, key, str, where)
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise ValueError(f"{where}{key} is not base64") from None
    if size is not None and len(data) != size:
        raise ValueError(f"{where}{key} is {len(data)} bytes, not {size}")
    return data


def _scrypt_params(params: dict[str, Any]) -> tuple[int, int, int]:
    values = []
    for key, (low, high) in SCRYPT_BOUNDS.items():
        value = _member(params, key, int, "kdf.params.")
        if not low <= value <= high:
            raise ValueError(f"kdf.params.{key} {value} is outside {low}..{high}")
        values.append(value)
    n, r, p = values
    if n & (n - 1):
        raise ValueError(f"kdf.params.N {n} is not a power of 2")
    if 128 * n * r > SCRYPT_MAX_MEMORY:
        raise ValueError(f"scrypt with N {n}, r {r} needs {128 * n * r >> 20} MiB, over {SCRYPT_MAX_MEMORY >> 20}")
    return n, r, p


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


def _dsse_shaped(envelope: Any) -> bool:
    """{payload, payloadType, signatures: [{keyid, sig}]}, each a string."""
    def strings(obj: Any, *keys: str) -> bool:
        return type(obj) is dict and all(type(obj.get(k)) is str for k in keys)
    signatures = envelope.get("signatures") if type(envelope) is dict else None
    return (strings(envelope, "payload", "payloadType") and type(signatures) is list
            and all(strings(s, "keyid", "sig") for s in signatures))


def dsse_envelope(envelope: Any) -> Any:
    """securesystemslib's Envelope of a parsed JSON value; ValueError when it is not one. The
    shape is checked first: from_dict takes any JSON for one (an int payload is an AttributeError)."""
    from securesystemslib.dsse import Envelope

    if not _dsse_shaped(envelope):
        raise ValueError("not a DSSE envelope (an object of payload, payloadType and signatures [{keyid, sig}], "
                         "each a string)")
    try:
        return Envelope.from_dict(copy.deepcopy(envelope))  # from_dict consumes its argument
    except (KeyError, TypeError, ValueError) as e:  # base64 that is not, one keyid twice
        raise ValueError(f"not a DSSE envelope ({type(e).__name__}: {e})") from None


def dsse_open(envelope: dict[str, Any], public_key: Any, payload_type: str) -> bytes:
    """The payload of an envelope that public_key signed; ValueError naming what is wrong."""
    from securesystemslib.exceptions import VerificationError

    env = dsse_envelope(envelope)
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
