"""tools/common/cliargs.named_paths: repeated NAME=PATH values, refused on one line when malformed
or when a name comes twice (the stages' --pin-file, --built and --module-so use it)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools.common.cliargs import named_paths
from tools.common.errors import UserError


def test_values_become_one_dict_of_paths() -> None:
    assert named_paths(["a=/x/a.diff", "b=rel/b=c"], "--pin-file") == {"a": Path("/x/a.diff"), "b": Path("rel/b=c")}
    assert named_paths([], "--pin-file") == {}


@pytest.mark.parametrize("value", ["a", "=x", "a=", ""])
def test_a_malformed_value_names_the_flag_and_the_form(value: str) -> None:
    with pytest.raises(UserError, match=rf"^--built {value!r}: expected STACK=FILE, e\.g\. pypi=out\.json$"):
        named_paths([value], "--built", form="STACK=FILE", example="pypi=out.json")


def test_a_name_given_twice_is_refused_not_last_wins() -> None:
    with pytest.raises(UserError, match=r"^--module-so norm: given twice; pass each module once$"):
        named_paths(["norm=a.so", "silu=b.so", "norm=c.so"], "--module-so", what="module")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
