"""sha256 of files and bytes, the one implementation every stage uses."""
from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (wheels and layers are GB-sized)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
