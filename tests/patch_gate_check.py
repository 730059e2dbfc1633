"""`//flashinfer_patches:check`, `//sglang_patches:check`: the built series result is what we expect.

The patch gate action already refuses drift against the committed manifest; this test prints the
gate's table (patch, state, files, offsets) for the record and re-compares the manifests, so a
drift shows up as a named file in the test log too.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest


def _env_path(var: str) -> Path:
    value = os.environ.get(var)
    assert value, f"{var} is not set: run this through Bazel (bazel test //flashinfer_patches:check)"
    return Path(value)


def test_series_result_matches_committed_manifest() -> None:
    print(_env_path("KIMI_GATE_TABLE").read_text())
    built = json.loads(_env_path("KIMI_BUILT_MANIFEST").read_text())
    expected = json.loads(_env_path("KIMI_EXPECTED_MANIFEST").read_text())
    changed = {f["path"]: f for f in built.get("changed_files", built.get("files", []))}
    want = {f["path"]: f for f in expected.get("changed_files", expected.get("files", []))}
    drift = sorted(p for p in changed.keys() | want.keys() if changed.get(p) != want.get(p))
    assert not drift, f"manifest drift in: {', '.join(drift)}"
    assert built == expected, "manifest drift outside the file list (target pin, series, layout)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
