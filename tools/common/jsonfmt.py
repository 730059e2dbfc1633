"""The two JSON encodings of this project, each named for what it is for.

- canonical_json: the bytes that get hashed (OCI blobs, digests of JSON values): sorted keys, no
  spaces, ASCII. One value has exactly one encoding, so equal content gives equal digests.
- review_json: files people read and diff (gate manifests, kernel_cache.json): sorted keys,
  2-space indent, trailing newline; byte-stable too, so a regenerated file diffs only where the
  content changed.
"""
from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def review_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")
