"""`//flashinfer_patches:check`, `//sglang_patches:check`: the patched tree is the one its manifest describes.

Drift against the committed manifest is not checked here: it is the validation action of the
gate's checked tree (tools/patch_gate/defs.bzl checked_tree), which fails this test's build, and every
other build that consumes the tree, naming the file and the fix command. This test checks what
Bazel hands to consumers: each file the manifest lists as changed has its `sha256_after` in the
tree (or is absent when deleted), the dist-info is the wheel's own, and the table says the series
was applied. It prints the gate's table (patch, state, files, offsets) for the record.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path
from tools.common.hashing import sha256_file


def tree_problems(tree: Path, manifest: dict) -> list[str]:
    """Every way the tree disagrees with the manifest's changed files and target (empty: none)."""
    problems = []
    for entry in manifest["changed_files"]:
        path = tree / entry["path"]
        want = entry["sha256_after"]
        got = sha256_file(path) if path.is_file() else None
        if got != want:
            problems.append(f"{entry['path']}: the tree has {got or 'no file'}, the manifest says {want or 'deleted'}")
    dist = [p.name for p in tree.iterdir() if p.name.endswith(".dist-info")]
    version = manifest["target"]["version"]
    if len(dist) != 1 or not dist[0].endswith(f"-{version}.dist-info"):
        problems.append(f"dist-info {dist} is not the one of version {version} the manifest names")
    return problems


def test_tree_is_what_the_manifest_describes() -> None:
    table = env_path("KIMI_GATE_TABLE").read_text()
    print(table)
    assert "\nresult: series applied;" in table, "the gate's table does not say the series was applied"
    manifest = json.loads(env_path("KIMI_BUILT_MANIFEST").read_text())
    problems = tree_problems(env_path("KIMI_GATE_TREE"), manifest)
    assert not problems, "the patched tree differs from its manifest: " + "; ".join(problems)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
