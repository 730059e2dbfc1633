"""tools/common/jsondata.py, the one reader of JSON data files: each schema type accepts what it
names and refuses the rest in one line naming the JSON path, the expected and the found type;
the file reader turns an unreadable file, invalid or truncated JSON and a key twice into one line
naming the file (and the line and column, or the JSON path). What each reader of the project
makes of it: test_json_readers.py."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tools.common.errors import UserError
from tools.common.jsondata import (ANY, BOOLEAN, INTEGER, NUMBER, STRING, TEXT, Enum, ListOf, MapOf, Nullable,
                                   Object, Schema, check_json, json_path, load_json_file, parse_json)

WHERE = "--flag data.json"


def refusal(value: Any, schema: Schema) -> str:
    with pytest.raises(UserError) as e:
        check_json(value, schema, WHERE)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{WHERE}: ") and message.endswith("; fix the file"), message
    return message[len(WHERE) + 2:-len("; fix the file")]


@pytest.mark.parametrize("schema, good, bad, expected", [
    (STRING, ["", "x"], 1, "$: expected a string, found the number 1"),
    (TEXT, ["x"], "", '$: expected a non-empty string, found the string ""'),
    (INTEGER, [0, -3], True, "$: expected an integer, found true"),  # a JSON true is not a count
    (INTEGER, [7], 1.5, "$: expected an integer, found the number 1.5"),
    (NUMBER, [0, 1.5], False, "$: expected a number, found false"),
    (BOOLEAN, [True, False], 0, "$: expected true or false, found the number 0"),
    (ANY, [None, [], {}, "x"], None, None),
    (Enum(1), [1], True, "$: expected 1, found true"),  # 1 == True in Python, not in JSON
    (Enum("prebuilt", "gap"), ["gap"], "maybe", '$: expected "prebuilt" or "gap", found the string "maybe"'),
    (Nullable(TEXT), [None, "x"], 3, "$: expected a non-empty string or null, found the number 3"),
    (ListOf(INTEGER), [[], [1, 2]], {}, "$: expected a list, found an object"),
    (ListOf(INTEGER, non_empty=True), [[1]], [], "$: expected a non-empty list, found an empty list"),
    (MapOf(STRING), [{}, {"a": "b"}], [], "$: expected an object, found a list"),
    (Object({"a": INTEGER}), [{"a": 1}], None, "$: expected an object, found null"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_type_accepts_what_it_names_and_refuses_the_rest(schema: Schema, good: list[Any], bad: Any,
                                                               expected: str | None) -> None:
    for value in good:
        assert check_json(value, schema, WHERE) is value
    if expected is not None:
        assert refusal(bad, schema) == expected


NESTED = Object({"settings": MapOf(ListOf(Object({"bar": INTEGER}, optional={"why": TEXT})))},
                optional={"description": TEXT, "arch": MapOf(TEXT)})


@pytest.mark.parametrize("value, expected", [
    ({"settings": {"foo": [{"bar": 1}, {"bar": 2}, {"bar": "3"}]}},
     '$.settings.foo[2].bar: expected an integer, found the string "3"'),
    ({"settings": {"foo": [{"bar": 1, "why": ""}]}}, '$.settings.foo[0].why: expected a non-empty string, found '
                                                     'the string ""'),
    ({"settings": {"foo": [{}]}}, "$.settings.foo[0]: missing key 'bar'"),
    ({"settings": {"foo": [{"bar": 1, "baz": 2}]}}, "$.settings.foo[0]: unknown key 'baz' (known: bar, why)"),
    ({"description": "d"}, "$: missing key 'settings'"),
    # A key that is not a plain word is quoted, so the path reads back as one key.
    ({"settings": {}, "arch": {"12.0f": 1}}, '$.arch["12.0f"]: expected a non-empty string, found the number 1'),
    # A wrong key is named before a missing one: it is often the misspelt missing one.
    ({"setting": {}}, "$: unknown key 'setting' (known: arch, description, settings)"),
], ids=["list item field", "empty text", "missing", "unknown", "missing at the top", "quoted key",
        "unknown before missing"])
def test_a_nested_mismatch_names_its_json_path(value: Any, expected: str) -> None:
    assert refusal(value, NESTED) == expected


def test_other_keys_are_checked_against_other() -> None:
    assert check_json({"a": 1, "b": [1]}, Object({"a": INTEGER}, other=ANY), WHERE)
    assert refusal({"a": 1, "b": "x"}, Object({"a": INTEGER}, other=INTEGER)) == \
        '$.b: expected an integer, found the string "x"'


def test_nullable_names_null_only_for_its_own_value() -> None:
    schema = Nullable(Object({"a": INTEGER}))
    assert refusal([], schema) == "$: expected an object or null, found a list"
    assert refusal({"a": None}, schema) == "$.a: expected an integer, found null"


def test_json_path() -> None:
    assert json_path([]) == "$"
    assert json_path(["settings", "foo", 2, "bar"]) == "$.settings.foo[2].bar"
    assert json_path(["selections", "kimi-k3", "a b", 'q"']) == '$.selections.kimi-k3["a b"]["q\\""]'


# ---------------------------------------------------------------- the file reader

SCHEMA = Object({"schema_version": Enum(1), "stacks": MapOf(ListOf(TEXT))})


def load_error(path: Path, schema: Schema = SCHEMA) -> str:
    with pytest.raises(UserError) as e:
        load_json_file(path, "--calls", schema, "pass jit_cache/triton_calls.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--calls {path}: "), message
    assert message.endswith("; pass jit_cache/triton_calls.json"), message
    return message[len(f"--calls {path}: "):-len("; pass jit_cache/triton_calls.json")]


@pytest.mark.parametrize("text, expected", [
    ('[]', "$: expected an object, found a list"),
    ('{"schema_version": 1, "stacks": {"pypi": {}}}', "$.stacks.pypi: expected a list, found an object"),
    ('{"schema_version": 1, "stacks": {"pypi": ["a", "b",', "invalid JSON at line 1 column 52 (Expecting value)"),
    ('{"schema_version": 1,\n "stacks": {"pypi": ["a"]\n', "invalid JSON at line 3 column 1 (Expecting ',' delimiter)"),
    ("", "invalid JSON at line 1 column 1 (Expecting value)"),
], ids=["top-level type", "nested type", "truncated", "truncated, a later line", "empty"])
def test_a_file_that_is_not_what_the_schema_says_is_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "calls.json"
    path.write_text(text)
    assert load_error(path) == expected


def test_a_key_twice_is_named_with_its_object_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "calls.json"
    path.write_text('{"schema_version": 1,\n "stacks": {"pypi": ["a"],\n   "pypi": []}}\n')
    with pytest.raises(UserError) as e:
        load_json_file(path, "--calls", SCHEMA)
    assert str(e.value) == (f"--calls {path}: $.stacks: key 'pypi' appears twice in one object (the object at "
                            "line 2); remove one")
    # Inside a list, and the innermost object first (the one the parser completes first).
    path.write_text('{"stacks": {"pypi": [{"x": {"k": 1, "k": 2}}], "pypi": []}}')
    with pytest.raises(UserError, match=r": \$\.stacks\.pypi\[0\]\.x: key 'k' appears twice"):
        load_json_file(path, "--calls", ANY)


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    assert load_error(tmp_path / "missing.json") == "unreadable (No such file or directory)"
    assert load_error(tmp_path) == "unreadable (Is a directory)"
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"stacks": "caf\u00e9"}'.encode("latin-1"))
    assert load_error(latin1).startswith("unreadable ('utf-8' codec can't decode byte 0xe9 in position 15")


def test_the_checked_value_is_returned(tmp_path: Path) -> None:
    path = tmp_path / "calls.json"
    path.write_text('{"schema_version": 1, "stacks": {"pypi": ["a"]}}')
    assert load_json_file(path, "--calls", SCHEMA) == {"schema_version": 1, "stacks": {"pypi": ["a"]}}
    assert parse_json("[1]", WHERE) == [1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
