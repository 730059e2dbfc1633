"""`//tests/cpu/kernel_cache:verify`: `python3 -m tools.kernel_cache verify` on the Bazel-built
SM120 cache.

Checks the cache against the patch gate's tree: source digest, #4460 source markers, every
declared module present (or the --//kernel_cache:only subset the cache was built with),
per-module sha256, cuobjdump shows sm_120 device code, and FlashInfer resolves and dlopens each
module from the cache with FLASHINFER_DISABLE_JIT=1 in a clean environment (a libcuda.so.1 stub
stands in for the driver: this host has no GPU).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path, pinned_toolchain_paths
from tools.kernel_cache.actions import CACHE_JSON_NAME
from tools.kernel_cache.toolchain import load_toolchain
from tools.kernel_cache.tree import AOT_SUBDIR
from tools.kernel_cache.verify import verify


def test_built_cache_verifies(tmp_path: Path) -> None:
    tempfile.tempdir = str(tmp_path)
    cache = env_path("KIMI_KC_CACHE")
    only = [n for n in env_path("KIMI_KC_ONLY_FILE").read_text().strip().split(",") if n]
    tc = load_toolchain(*pinned_toolchain_paths())
    report = verify(cache, env_path("KIMI_FLASHINFER_TREE"), env_path("KIMI_KC_MODULES"),
                    sys.executable, tc, None, require_load=True, driver_stub=True,
                    arch="12.0f", only=only)
    print(json.dumps(report, indent=1, sort_keys=True))
    built = json.loads((cache / AOT_SUBDIR / CACHE_JSON_NAME).read_text())
    if only:
        assert sorted(built["modules"]) == sorted(only)
    for name, r in report["modules"].items():
        assert r["elf"] == ["sm_120"], name
        assert r["is_aot"] and r["jit_refused"] and r["loaded"], (name, r)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
