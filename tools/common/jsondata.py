"""The one reader of JSON data files: the files people edit or pass by flag, and the checked-in
data the tools read (launch profiles, the needs table, module and call lists, locks, manifests).

    load_json_file(path, what, schema, fix) -> the value
        reads the file, parses it (a key twice in one object refused), checks it against a
        schema; every problem is one UserError line naming `what` (the flag the user passed, or
        what the file is), the file, the JSON path and `fix`:
            --needs image/backend_needs.json: $.architectures: expected an object, found a list; fix the file
    parse_json(text, where, fix) / check_json(value, schema, where, fix, at=())
        the two halves, for a reader that gets its text or its value some other way (`at`: the
        value's keys in its document, so the message's JSON path is the document's).

A schema is a small declarative value, nested to any depth:

    STRING, TEXT (a non-empty string), INTEGER (not a bool), NUMBER, BOOLEAN, ANY
    Enum(1) / Enum("prebuilt", "gap")          one of these values
    Nullable(STRING)                           a string or null
    ListOf(TEXT, non_empty=True)               a list, each item checked
    MapOf(ListOf(STRING))                      an object of any keys, each value checked
    Object({"call": TEXT}, optional={"args": ANY}, other=None)
        an object with these keys (optional ones may be left out); keys it does not name are
        refused (other=None) or checked against `other` (other=ANY: allowed)

Only types and shapes live here: what a reader knows beyond them (a name's pattern, a value that
must be in another file) it checks itself, after, naming the same JSON path (json_path).
Standard library only, like the rest of the ground package.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError
from tools.common.jsonfmt import json_path, loads_unique_keys

__all__ = ["ANY", "BOOLEAN", "INTEGER", "NUMBER", "STRING", "TEXT", "Enum", "ListOf", "MapOf", "Nullable",
           "Object", "Schema", "check_json", "json_path", "load_json_file", "parse_json"]

DEFAULT_FIX = "fix the file"


class _Mismatch(Exception):
    """A value that is not what its schema says: its keys from the top, and what is wrong."""

    def __init__(self, keys: list[str | int], problem: str) -> None:
        super().__init__(problem)
        self.keys, self.problem = keys, problem


def _found(value: Any) -> str:
    """A JSON value as a message names it: its type, and a scalar's value."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"the string {json.dumps(shown)}"
    return f"the number {value!r}"


class Schema:
    """What a JSON value must be: `expected` names it in messages; check() raises _Mismatch at
    the first part that differs. This base accepts anything (ANY)."""

    expected = "anything"

    def accepts(self, value: Any) -> bool:
        return True

    def check(self, value: Any, keys: list[str | int]) -> None:
        if not self.accepts(value):
            raise _Mismatch(keys, f"expected {self.expected}, found {_found(value)}")


class _Scalar(Schema):
    def __init__(self, expected: str, types: tuple[type, ...], non_empty: bool = False) -> None:
        self.expected, self.types, self.non_empty = expected, types, non_empty

    def accepts(self, value: Any) -> bool:
        # bool is an int in Python, never in JSON: true is not a count.
        return (isinstance(value, self.types) and not (isinstance(value, bool) and bool not in self.types)
                and not (self.non_empty and value == ""))


ANY = Schema()
STRING = _Scalar("a string", (str,))
TEXT = _Scalar("a non-empty string", (str,), non_empty=True)
INTEGER = _Scalar("an integer", (int,))
NUMBER = _Scalar("a number", (int, float))
BOOLEAN = _Scalar("true or false", (bool,))


class Enum(Schema):
    """One of a few values (a schema_version, a status)."""

    def __init__(self, *values: Any) -> None:
        self.values = values
        self.expected = " or ".join(json.dumps(v) for v in values)

    def accepts(self, value: Any) -> bool:
        # 1 == True in Python; a JSON true is not the version 1.
        return any(value == v and type(value) is type(v) for v in self.values)


class Nullable(Schema):
    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.expected = f"{schema.expected} or null"

    def check(self, value: Any, keys: list[str | int]) -> None:
        if value is None:
            return
        try:
            self.schema.check(value, keys)
        except _Mismatch as e:
            if e.keys != keys:  # inside the value: that part's own message
                raise
            raise _Mismatch(keys, f"expected {self.expected}, found {_found(value)}") from None


class ListOf(Schema):
    def __init__(self, item: Schema, non_empty: bool = False) -> None:
        self.item, self.non_empty = item, non_empty
        self.expected = "a non-empty list" if non_empty else "a list"

    def check(self, value: Any, keys: list[str | int]) -> None:
        if not isinstance(value, list) or (self.non_empty and not value):
            raise _Mismatch(keys, f"expected {self.expected}, found {'an empty list' if value == [] else _found(value)}")
        for i, item in enumerate(value):
            self.item.check(item, keys + [i])


class MapOf(Schema):
    """An object whose keys are names the file chooses (stacks, modules, settings)."""

    expected = "an object"

    def __init__(self, value: Schema) -> None:
        self.value = value

    def check(self, value: Any, keys: list[str | int]) -> None:
        if not isinstance(value, dict):
            raise _Mismatch(keys, f"expected an object, found {_found(value)}")
        for key, item in value.items():
            self.value.check(item, keys + [key])


class Object(Schema):
    """An object of named fields: `required` must be there, `optional` may be; any other key is
    refused (other=None: a misspelt key would otherwise be ignored) or checked against `other`."""

    expected = "an object"

    def __init__(self, required: Mapping[str, Schema], optional: Mapping[str, Schema] | None = None,
                 other: Schema | None = None) -> None:
        self.required, self.optional, self.other = dict(required), dict(optional or {}), other

    def check(self, value: Any, keys: list[str | int]) -> None:
        if not isinstance(value, dict):
            raise _Mismatch(keys, f"expected an object, found {_found(value)}")
        # The keys there first, in the file's order: a wrong one is named before what is missing.
        for key, item in value.items():
            if key in self.required:
                self.required[key].check(item, keys + [key])
            elif key in self.optional:
                self.optional[key].check(item, keys + [key])
            elif self.other is not None:
                self.other.check(item, keys + [key])
            else:
                known = ", ".join(sorted([*self.required, *self.optional]))
                raise _Mismatch(keys, f"unknown key {key!r} (known: {known})")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise _Mismatch(keys, f"missing key{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(repr(k) for k in missing)}")


def check_json(value: Any, schema: Schema, where: str, fix: str = DEFAULT_FIX,
               at: Sequence[str | int] = ()) -> Any:
    """`value`, after it matched `schema`; else a UserError `<where>: <JSON path>: <problem>; <fix>`.
    `at`: where `value` sits in its document (the keys from the top), for a part checked on its
    own after the document's shape (one entry of a list whose schema depends on its `kind`)."""
    try:
        schema.check(value, list(at))
    except _Mismatch as e:
        raise UserError(f"{where}: {json_path(e.keys)}: {e.problem}; {fix}") from None
    return value


def parse_json(text: str, where: str, fix: str = DEFAULT_FIX) -> Any:
    """The value of `text`; invalid or truncated JSON, or a key twice in one object, is one line
    naming `where` (and the line and column, or the object's JSON path)."""
    try:
        return loads_unique_keys(text, where)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); {fix}") from None


def load_json_file(path: Path, what: str, schema: Schema, fix: str = DEFAULT_FIX) -> Any:
    """The checked value of the JSON file `path`. `what` is how the user gave it: the flag
    (`--needs`), or what the file is when no flag names it (`launch profile`); every error is
    one line starting `<what> <path>: `."""
    where = f"{what} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: unreadable ({e}); {fix}") from None
    except OSError as e:
        raise UserError(f"{where}: unreadable ({e.strerror or e}); {fix}") from None
    return check_json(parse_json(text, where, fix), schema, where, fix)
