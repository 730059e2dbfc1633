"""The two JSON encodings of this project, each named for what it is for, and the reader of
hand-edited JSON.

- canonical_json: the bytes that get hashed (OCI blobs, digests of JSON values): sorted keys, no
  spaces, ASCII. One value has exactly one encoding, so equal content gives equal digests.
- review_json: files people read and diff (gate manifests, kernel_cache.json): sorted keys,
  2-space indent, trailing newline; byte-stable too, so a regenerated file diffs only where the
  content changed.
- loads_unique_keys: json.loads for files people edit (launch profiles), refusing an object that
  holds a key twice, which json.loads would resolve silently to the last value.
"""
from __future__ import annotations

import json
from typing import Any

from tools.common.errors import UserError


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def review_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def loads_unique_keys(text: str, where: str) -> Any:
    """json.loads, except that an object holding a key twice is a UserError naming `where` and the
    key. Invalid JSON raises json.JSONDecodeError, as json.loads does."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise UserError(f"{where}: key {str(e)!r} appears twice in one object; keep one") from None
