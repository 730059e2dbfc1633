"""The wheel //kernel_cache's flashkda_wheel rule built, sandboxed with the pinned toolchain, from
the stand-ins tests/cpu/kernel_cache/flashkda_fixture.py writes for FlashKDA's pins and torch
(KIMI_FLASHKDA_FIXTURE_WHEEL): named and stamped from the real pin, an sm_90a extension that
names torch's libraries and no path of the build."""
from __future__ import annotations

import csv
import io
import json
import sys
import zipfile
from pathlib import Path

import pytest

from tests.cpu.conftest import env_path
from tools.kernel_cache import flashkda
from tools.pins import lock as lockfile


def wheel() -> Path:
    return Path(env_path("KIMI_FLASHKDA_FIXTURE_WHEEL"))


def test_the_wheel_is_named_and_stamped_from_the_pin() -> None:
    commit = lockfile.load(lockfile.DEFAULT_LOCK).pin("flashkda").commit
    version = f"0.0.1+{commit[:7]}.sm90a"
    assert wheel().name == f"flash_kda-{version}-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel()) as z:
        info = f"flash_kda-{version}.dist-info"
        assert f"Version: {version}" in z.read(f"{info}/METADATA").decode()
        assert "Requires-Dist: torch==2.13.0" in z.read(f"{info}/METADATA").decode()
        build = json.loads(z.read(f"{info}/kimi_k3_build.json"))
        assert build == {"arch": "9.0a", "cuda_arch": "90a", "pin_commit": commit, "torch_version": "2.13.0"}
        rows = list(csv.reader(io.StringIO(z.read(f"{info}/RECORD").decode())))
        assert [r[0] for r in rows] == z.namelist()
        assert "flash_kda/__init__.py" in z.namelist()


def test_the_extension_is_sm90a_names_torchs_libraries_and_no_build_path() -> None:
    with zipfile.ZipFile(wheel()) as z:
        so = z.read(flashkda.extension_filename("flash_kda_C", "cp311"))
    assert so[:4] == b"\x7fELF"
    assert b"sm_90a" in so, "the fatbin holds sm_90a code"
    for lib in ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so", "libc10_cuda.so",
                "libtorch_cuda.so", "libcudart.so.13"):
        assert lib.encode() + b"\0" in so, f"no DT_NEEDED string {lib}"
    for marker in (b"/sandbox/", b"execroot", b"bazel-out", b"/tmp/"):
        assert marker not in so, f"the extension names a build path ({marker.decode()})"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
