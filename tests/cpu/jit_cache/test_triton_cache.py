"""Triton kernels built ahead of time (//jit_cache:triton_12_0 of the pypi stack) answer the keys
Triton's own launch path computes: the calls of jit_cache/triton_calls.json run again, each in a
fresh process under the image's python3.11 over the image's trees, against the stand-in SM120
device, over a TRITON_CACHE_DIR bound to a read-only copy of the cache: no compile, every entry a
hit. A cache that lacks an entry makes Triton compile it, and the check names the kernel."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.jit_cache import triton_aot

STACK, ARCH = "pypi", "12.0"
CALLS = Path("jit_cache/triton_calls.json")


def _paths(var: str) -> list[Path]:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run through Bazel (tools/bazel test --config=pypi //tests/cpu/jit_cache:triton_check_pypi)")
    return [Path(p) for p in value.split()]


def _check(cache: Path) -> int:
    paths = _paths("KIMI_TRITON_IMAGE_INPUTS")
    [base] = [p for p in paths if p.name.endswith(".tar")]
    trees = [p for p in paths if not p.name.endswith(".tar")]
    return triton_aot.check_triton(STACK, ARCH, CALLS, base, trees, os.environ["KIMI_IMAGE_SITE_PACKAGES"], cache)


def test_the_calls_compile_nothing_over_the_bound_cache(capsys: pytest.CaptureFixture[str]) -> None:
    [cache] = _paths("KIMI_TRITON_120")
    assert _check(cache) == 0
    err = capsys.readouterr().err
    calls = json.loads(CALLS.read_text())["stacks"][STACK]
    assert err.count("every one a hit") == len(calls), err
    assert ", 0 compiles (12.0)" in err


def test_the_shipped_tree_is_the_manifest() -> None:
    [cache] = _paths("KIMI_TRITON_120")
    manifest = triton_aot.read_manifest(cache)
    files = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    expected = sorted([triton_aot.MANIFEST] + [f"{k}/{n}" for k, e in manifest["entries"].items() for n in e["files"]]
                      + [f"{m['key']}/{m['file']}" for m in manifest["modules"]])
    assert files == expected
    # Triton's driver module, for the image's python3.11, keyed on the image's paths.
    [module] = manifest["modules"]
    assert module["module"] == "cuda_utils" and module["file"] == "cuda_utils.cpython-311-x86_64-linux-gnu.so"
    site = os.environ["KIMI_IMAGE_SITE_PACKAGES"]
    assert module["library_dirs"] == [f"{site}/triton/backends/nvidia/lib", "/usr/lib/x86_64-linux-gnu"]
    assert module["include_dirs"] == [f"{site}/triton/backends/nvidia/include"]
    kernels = {e["kernel"] for e in manifest["entries"].values()}
    assert {"chunk_gla_fwd_kernel_o", "_causal_conv1d_fwd_kernel", "l2norm_fwd_kernel"} <= kernels, kernels
    assert not any(n.endswith(".autotune.json") for e in manifest["entries"].values() for n in e["files"])


def test_a_missing_entry_is_a_compile_by_kernel_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [cache] = _paths("KIMI_TRITON_120")
    broken = tmp_path / "cache"
    shutil.copytree(cache, broken)
    manifest = json.loads((broken / triton_aot.MANIFEST).read_text())
    # One of the two conv kernels (it specializes on the channel count, so each call has its own).
    key, entry = next((k, e) for k, e in sorted(manifest["entries"].items()) if e["kernel"] == "_causal_conv1d_fwd_kernel")
    del manifest["entries"][key]
    (broken / triton_aot.MANIFEST).chmod(0o644)
    (broken / triton_aot.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"check-triton: 1 of 2 call\(s\) compiled"):
        _check(broken)
    assert ("Triton compiled sglang.kernels.ops.mamba.causal_conv1d_triton:_causal_conv1d_fwd_kernel, which the "
            "cache lacks") in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
