"""The H200 proof's SGLang JIT builds (//jit_cache:sglang_jit_9_0a, keyed as the image keys it, and
:sglang_jit_9_0a_gpu_host, keyed for the GPU host of tools/gpu_suite/gpu_host.json), which only
//tools/gpu_suite:bundle carries: SGLang's own loader, as the image runs it with torch.cuda
answering as a 9.0 device, finds and loads every module of both; each is refused under the other's
keys; keys differ per arch. test_sglang_jit.py's checks of the image's 12.0f build, for 9.0a. Run
before making the bundle (docs/GPU_RUN.md section 1); on the H200 itself,
tests/gpu/test_sglang_jit_gpu.py checks the same cache with no compiler reachable."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.cpu.jit_cache.sglang_jit_checks import (MODULES, STACK, cache_of, check, check_every_shipped_module_is_found,
                                                  check_the_shipped_tree_is_the_manifest, image_inputs, paths)
from tools.common.errors import UserError
from tools.jit_cache import sglang_aot


def _gpu_host_spec() -> Path:
    [spec] = paths("KIMI_GPU_HOST_SPEC")
    return spec


def test_sglangs_own_loader_finds_every_shipped_module(capsys: pytest.CaptureFixture[str]) -> None:
    check_every_shipped_module_is_found("9.0a", capsys)


def test_the_shipped_tree_is_the_manifest() -> None:
    check_the_shipped_tree_is_the_manifest("9.0a")


def test_the_gpu_hosts_cache_answers_the_keys_of_that_hosts_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    """//jit_cache:sglang_jit_9_0a_gpu_host, what the bundle carries to the H200: SGLang's loader
    with that host's answers (gpu_host.json sglang_jit_runtime: its torch's version, CUDA_HOME at
    a missing directory) finds every module; the .so bytes are the image build's, only the build
    key (its directory) differs; the image-keyed cache misses there, and this one in the image."""
    base, trees = image_inputs()
    site = os.environ["KIMI_IMAGE_SITE_PACKAGES"]
    cache, spec = cache_of("9.0a-gpu-host"), _gpu_host_spec()
    assert sglang_aot.check_sglang(STACK, "9.0a", MODULES, base, trees, site, cache, spec) == 0
    assert capsys.readouterr().err.count("jit_cache: hit sm90a/") == len(json.loads(MODULES.read_text())["stacks"][STACK])
    host = json.loads((cache / sglang_aot.MANIFEST).read_text())
    image = json.loads((cache_of("9.0a") / sglang_aot.MANIFEST).read_text())
    runtime = json.loads(spec.read_text())["sglang_jit_runtime"]
    assert host["runtime"]["cuda_home"] == runtime["cuda_home"] and "runtime" not in image
    for name, version in runtime["distributions"].items():
        assert host["runtime"]["distributions"][name] == (version or "absent")
    by_module = {m["module"]: m for m in image["modules"]}
    for m in host["modules"]:
        # Reused, not compiled again: allowed only because the build file each module compiles
        # from, taken in this build, equals the image build's (the build fails otherwise).
        assert m["reused"] and m["compile_sha256"] == by_module[m["module"]]["compile_sha256"]
        assert m["so_sha256"] == by_module[m["module"]]["so_sha256"]
        assert m["toolchain_dependencies"] == by_module[m["module"]]["toolchain_dependencies"]
        assert m["build_key"] != by_module[m["module"]]["build_key"]
    assert not any(m.get("reused") for m in image["modules"])
    n = len(host["modules"])
    for other, other_spec in ((cache_of("9.0a"), spec), (cache, None)):
        with pytest.raises(UserError, match=f"check-sglang: {n} of {n} module"):
            sglang_aot.check_sglang(STACK, "9.0a", MODULES, base, trees, site, other, other_spec)
        assert capsys.readouterr().err.count("has no usable cached build") == n


def test_keys_differ_per_arch() -> None:
    keys = {arch: {m["module"]: m["build_key"] for m in json.loads((cache_of(arch) / sglang_aot.MANIFEST).read_text())["modules"]}
            for arch in ("12.0f", "9.0a")}
    for module, key in keys["12.0f"].items():
        assert keys["9.0a"].get(module) != key


def test_a_cache_of_another_arch_is_refused() -> None:
    with pytest.raises(UserError, match="built for stack pypi arch 9.0a, not pypi 12.0f"):
        check("12.0f", cache_of("9.0a"))
    with pytest.raises(UserError, match="built for stack pypi arch 12.0f, not pypi 9.0a"):
        check("9.0a", cache_of("12.0f"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
