"""What the SGLang JIT checks share (test_sglang_jit.py for the image's 12.0f build,
test_sglang_jit_gpu_host.py for the H200 proof's 9.0a builds): the inputs Bazel passes, and the
loader and manifest checks of one arch's cache."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tools.common.hashing import sha256_file
from tools.jit_cache import sglang_aot

STACK = "pypi"
MODULES = Path("jit_cache/sglang_modules.json")


def paths(var: str) -> list[Path]:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run through Bazel (tools/bazel test "
                    "//tests/cpu/jit_cache:sglang_jit_check_pypi, or :sglang_jit_check_gpu_host_pypi)")
    return [Path(p) for p in value.split()]


def cache_of(arch: str) -> Path:
    [cache] = paths({"12.0f": "KIMI_SGLANG_JIT_120F", "9.0a": "KIMI_SGLANG_JIT_90A",
                     "9.0a-gpu-host": "KIMI_SGLANG_JIT_90A_GPU_HOST"}[arch])
    return cache


def image_inputs() -> tuple[Path, list[Path]]:
    files = paths("KIMI_SGLANG_JIT_IMAGE_INPUTS")
    tars = [p for p in files if p.name.endswith(".tar")]
    trees = [p for p in files if not p.name.endswith(".tar")]
    assert len(tars) == 1 and trees, files
    return tars[0], trees


def check(arch: str, cache: Path) -> int:
    base, trees = image_inputs()
    return sglang_aot.check_sglang(STACK, arch, MODULES, base, trees, os.environ["KIMI_IMAGE_SITE_PACKAGES"], cache)


def check_every_shipped_module_is_found(arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(arch, cache_of(arch)) == 0
    err = capsys.readouterr().err
    entries = json.loads(MODULES.read_text())["stacks"][STACK]
    target = sglang_aot.ARCHS[arch][2]
    assert err.count(f"jit_cache: hit {target}/") == len(entries), err


def check_the_shipped_tree_is_the_manifest(arch: str) -> None:
    cache = cache_of(arch)
    manifest = json.loads((cache / sglang_aot.MANIFEST).read_text())
    assert (manifest["stack"], manifest["arch"], manifest["target"]) == (STACK, arch, sglang_aot.ARCHS[arch][2])
    entries = json.loads(MODULES.read_text())["stacks"][STACK]
    assert sorted(m["call"] for m in manifest["modules"]) == sorted(e["call"] for e in entries)
    files = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    expected = sorted([sglang_aot.MANIFEST] + [f"{m['leaf']}/{name}" for m in manifest["modules"]
                                               for name in ("sgl_deps.json", m["module"] + ".so")])
    assert files == expected
    for m in manifest["modules"]:
        so = cache / m["leaf"] / (m["module"] + ".so")
        assert sha256_file(so) == m["so_sha256"]
        deps = json.loads((cache / m["leaf"] / "sgl_deps.json").read_text())
        # Only files the image ships are listed (SGLang re-hashes each at every lookup).
        assert {d[0] for d in deps} <= set(("kernels", "tvm_ffi", "pkg:flashinfer", "pkg:nvidia", "sitepkgs")), deps
        assert m["toolchain_dependencies"] and all(p.startswith(("/kimi-k3/", "/usr/")) for p in m["toolchain_dependencies"])
