"""The two JSON encodings of this project, each named for what it is for, and the parser of files
people edit (tools/common/jsondata.py reads them through it, and checks their types).

- canonical_json: the bytes that get hashed (OCI blobs, digests of JSON values): sorted keys, no
  spaces, ASCII. One value has exactly one encoding, so equal content gives equal digests.
- review_json: files people read and diff (gate manifests, kernel_cache.json): sorted keys,
  2-space indent, trailing newline; byte-stable too, so a regenerated file diffs only where the
  content changed.
- loads_unique_keys: json.loads for hand-edited inputs (locks, selections, launch profiles), refusing an object
  that has a key twice: json.loads keeps the last one silently, hiding a duplicated entry.
- json_path: where a value sits in a document, as messages name it (`$.settings.foo[2].bar`).
"""
from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from typing import Any, Iterator, Sequence

from tools.common.errors import UserError


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def review_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int = 0) -> None:
        super().__init__(key)
        self.key, self.line = key, line


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _duplicate_key_line(text: str) -> int:
    """The line where the first object holding a key twice starts. Only called once a duplicate
    is known: the pure-Python scanner used here (the C one reports no positions) is slower."""
    def parse_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any, object_hook: Any,
                     pairs_hook: Any, memo: Any = None) -> Any:
        line = text.count("\n", 0, s_and_end[1]) + 1

        def check(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            try:
                return _refuse_duplicate_keys(pairs)
            except _DuplicateKey as e:
                raise _DuplicateKey(e.key, line) from None
        return json.decoder.JSONObject(s_and_end, strict, scan_once, object_hook, check, memo)

    decoder = json.JSONDecoder()
    decoder.parse_object = parse_object  # type: ignore[assignment]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    try:
        decoder.decode(text)
    except _DuplicateKey as e:
        return e.line
    return 0


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def json_path(keys: Sequence[str | int]) -> str:
    """`$.settings.foo[2].bar` for the keys ["settings", "foo", 2, "bar"]; a key that is not a
    plain word is quoted (`$.default_for_arch["12.0f"]`), so the path reads back unambiguously."""
    parts = ["$"]
    for key in keys:
        if isinstance(key, int):
            parts.append(f"[{key}]")
        elif _PLAIN_KEY.fullmatch(key):
            parts.append(f".{key}")
        else:
            parts.append(f"[{json.dumps(key)}]")
    return "".join(parts)


class _Pairs(list):  # type: ignore[type-arg]
    """An object as parsed, every (key, value) pair kept: a key given twice is still there."""


def _objects_in_parse_order(value: Any, keys: list[str | int]) -> Iterator[tuple[list[str | int], _Pairs]]:
    """(path, object) of every object in `value`, each after the objects inside it, in document
    order: the order the parser completes them, so the first with a key twice is the one
    _duplicate_key_line finds."""
    if isinstance(value, _Pairs):
        for key, item in value:
            yield from _objects_in_parse_order(item, keys + [key])
        yield keys, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _objects_in_parse_order(item, keys + [i])


def _duplicate_key_path(text: str) -> str:
    """The JSON path of the first object holding a key twice. Only called once a duplicate is
    known: it parses the text again, keeping every pair."""
    for keys, pairs in _objects_in_parse_order(json.loads(text, object_pairs_hook=_Pairs), []):
        names = [k for k, _ in pairs]
        if len(set(names)) != len(names):
            return json_path(keys)
    return "$"


def loads_unique_keys(text: str, where: str) -> Any:
    """json.loads, except that an object holding a key twice is a UserError naming `where`, the
    object's JSON path and line, and the key. Invalid JSON raises json.JSONDecodeError, as
    json.loads does."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKey as e:
        raise UserError(f"{where}: {_duplicate_key_path(text)}: key '{e.key}' appears twice in one object (the "
                        f"object at line {_duplicate_key_line(text)}); remove one") from None
