"""Command-line values every stage parses the same way.

`named_paths`: repeated `--flag NAME=PATH` values (a pin's file, a stack's built inventory, a
module's object) as one dict; a value without `=`, with an empty side, or a name given twice is
one line naming the flag and the fix (a second copy would silently win otherwise).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError


def named_paths(values: Sequence[str], flag: str, *, form: str = "NAME=PATH", what: str = "name",
                example: str = "") -> dict[str, Path]:
    """`NAME=PATH` values of `flag` as {name: path}; `what` names a name in the duplicate line."""
    out: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"{flag} {value!r}: expected {form}" + (f", e.g. {example}" if example else ""))
        if name in out:
            raise UserError(f"{flag} {name}: given twice; pass each {what} once")
        out[name] = Path(path)
    return out
