"""SGLang's JIT modules built ahead of time (//jit_cache:sglang_jit_12_0f of the pypi stack, the
image's) answer the keys SGLang's own loader computes, as the image runs it: Debian's python3.11
over the image's installed trees, no compiler reachable, CUDA_HOME unset,
SGLANG_CRASH_ON_JIT_COMPILE=1, the cache read-only, torch.cuda answering as a 12.0 device. A hit
is SGLang's find_prebuilt returning the shipped leaf and tvm-ffi loading the .so; a miss fails by
module name. Also: the list file's mistakes are one line each. The H200 proof's 9.0a builds are
checked by test_sglang_jit_gpu_host.py (//tests/cpu/jit_cache:sglang_jit_check_gpu_host_pypi),
which runs this file's checks for that arch."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.jit_cache import sglang_aot
from tests.cpu.jit_cache.sglang_jit_checks import (MODULES, STACK, cache_of, check, check_every_shipped_module_is_found,
                                                  check_the_shipped_tree_is_the_manifest)

def test_sglangs_own_loader_finds_every_shipped_module(capsys: pytest.CaptureFixture[str]) -> None:
    check_every_shipped_module_is_found("12.0f", capsys)


def test_the_shipped_tree_is_the_manifest() -> None:
    check_the_shipped_tree_is_the_manifest("12.0f")


@pytest.mark.parametrize("runtime, message", [
    ({"cuda_home": "rel/cuda", "distributions": {}}, r"cuda_home: 'rel/cuda' is not an absolute path"),
    ({"cuda_home": "/x", "distributions": {"apache-tvm-ffi": "0.1.15"}},
     r"apache-tvm-ffi cannot differ from the image \(the modules compile against it\)"),
    ({"cuda_home": "/x", "distributions": {"torch": ""}},
     r"\$\.sglang_jit_runtime\.distributions\.torch: expected a non-empty string or null, found the string \"\""),
    ({"cuda_home": "/x", "env": {}}, r"\$\.sglang_jit_runtime: unknown key 'env' \(known: cuda_home, distributions, why\)"),
])
def test_runtime_mistakes_are_one_line(tmp_path: Path, runtime: dict, message: str) -> None:
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"sglang_jit_runtime": runtime}))
    with pytest.raises(UserError, match=message):
        sglang_aot.load_runtime(path)
    assert sglang_aot.load_runtime(None) is None


def test_a_leaf_that_does_not_reproduce_its_name_is_a_miss_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A leaf is a hit only if its dependency list, re-hashed against the image's files, gives
    its own name: a list missing one header (what a leaf built from other sources has) makes
    SGLang refuse it, and with SGLANG_CRASH_ON_JIT_COMPILE=1 the call fails naming the module."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_of("12.0f"), cache)
    manifest = json.loads((cache / sglang_aot.MANIFEST).read_text())
    victim = manifest["modules"][0]
    deps_file = cache / victim["leaf"] / "sgl_deps.json"
    deps_file.chmod(0o644)
    deps = json.loads(deps_file.read_text())
    del deps[-1]
    deps_file.write_text(json.dumps(deps, separators=(",", ":")))
    with pytest.raises(UserError, match="1 of .* failed"):
        check("12.0f", cache)
    err = capsys.readouterr().err
    assert victim["call"] in err and "SGLANG_CRASH_ON_JIT_COMPILE" in err, err


def test_a_cache_of_another_arch_is_refused(tmp_path: Path) -> None:
    """The shipped cache relabeled as another arch's (its manifest says 9.0a) is refused before
    SGLang runs; the real 9.0a build is refused the same way in test_sglang_jit_gpu_host.py."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_of("12.0f"), cache)
    manifest_file = cache / sglang_aot.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["arch"], manifest["target"] = "9.0a", sglang_aot.ARCHS["9.0a"][2]
    manifest_file.chmod(0o644)
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="built for stack pypi arch 9.0a, not pypi 12.0f"):
        check("12.0f", cache)


@pytest.mark.parametrize("text, message", [
    ('{"stacks": {"pypi": [{"call": "a.b", "why": "x"}]}}', r'stacks.pypi\[0\]: call .a.b. is not "package.module:function"'),
    ('{"stacks": {"pypi": [{"call": "a.b:f"}]}}', r"\$\.stacks\.pypi\[0\]: missing key 'why'"),
    ('{"stacks": {"pypi": [{"call": "a.b:f", "why": " "}]}}', r"\$\.stacks\.pypi\[0\]: why is empty"),
    ('{"stacks": {"pypi": [{"call": "a.b:f", "why": "x"}, {"call": "a.b:f", "why": "y"}]}}', r"stacks.pypi\[1\]: a.b:f with these args is listed twice"),
    ('{"stacks": {"pypi": [{"call": "a.b:f", "why": "x", "arg": []}]}}',
     r"\$\.stacks\.pypi\[0\]: unknown key 'arg' \(known: args, call, why\)"),
    ('{"stacks": {"default": []}}', r"no entry for stack 'pypi' \(has: default\); add stacks.pypi"),
    ('{"stacks": {"pypi": []}, "stacks": {}}', r"stacks"),
])
def test_module_list_mistakes_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "modules.json"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        sglang_aot.load_modules(path, STACK)


def test_site_packages_name_the_interpreter() -> None:
    assert sglang_aot.image_python("/usr/local/lib/python3.11/dist-packages") == "usr/bin/python3.11"
    with pytest.raises(UserError, match="names no pythonX.Y directory"):
        sglang_aot.image_python("/opt/site")


def test_a_later_tree_wins_as_in_the_overlay(tmp_path: Path) -> None:
    site_rel = "usr/local/lib/python3.11/dist-packages"
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for tree, text in ((lower, "lower"), (upper, "upper")):
        (tree / site_rel / "nvidia" / tree.name).mkdir(parents=True)
        (tree / site_rel / "same.py").write_text(text)
    site = tmp_path / "site"
    sglang_aot.merge_site_trees([lower, upper], site_rel, site)
    assert (site / "same.py").read_text() == "upper"
    assert sorted(os.listdir(site / "nvidia")) == ["lower", "upper"]
    with pytest.raises(UserError, match="no /usr/local/lib/python3.11/dist-packages in it"):
        sglang_aot.merge_site_trees([tmp_path / "missing"], site_rel, tmp_path / "site2")


def test_unknown_arch_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--arch 8.0: not one of 12.0f, 9.0a"):
        sglang_aot.build_sglang(STACK, "8.0", MODULES, tmp_path / "base.tar", [], "/usr/local/lib/python3.11/dist-packages",
                                "", "", tmp_path / "out")
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
