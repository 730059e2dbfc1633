"""Every stack's checked-in jit_cache/inventory.<stack>.json is what the tool computes from that
stack's patched SGLang tree (the Bazel actions //jit_cache:built_<stack>, which rerun when a pinned
wheel, a patch, a profile, reach.json or the tool changes): a pinned SGLang that gains, loses or
changes a compile site fails here, one line per site naming its id, its file and the fix."""
from __future__ import annotations

import os
import shlex
import sys

import pytest

from tools.jit_cache import cli


def test_inventories_current(capsys: pytest.CaptureFixture[str]) -> None:
    args = os.environ.get("KIMI_JC_CHECK_ARGS")
    if not args:
        pytest.fail("KIMI_JC_CHECK_ARGS is unset: run this test through Bazel (tools/bazel test //tests/cpu/jit_cache:inventory_current)")
    code = cli.main(["check", *shlex.split(args)])
    err = capsys.readouterr().err
    assert code == 0, "\n" + err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
