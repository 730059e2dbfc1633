"""SGLang's JIT modules built ahead of time (//jit_cache:sglang_jit_12_0f and :sglang_jit_9_0a of the
pypi stack) answer the keys SGLang's own loader computes, as the image runs it: Debian's
python3.11 over the image's installed trees, no compiler reachable, CUDA_HOME unset,
SGLANG_CRASH_ON_JIT_COMPILE=1, the cache read-only, torch.cuda answering as a 12.0 or a 9.0
device. A hit is SGLang's find_prebuilt returning the shipped leaf and tvm-ffi loading the .so; a
miss fails by module name. Also: the list file's mistakes are one line each."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.common.hashing import sha256_file
from tools.jit_cache import sglang_aot

STACK = "pypi"
MODULES = Path("jit_cache/sglang_modules.json")


def _paths(var: str) -> list[Path]:
    value = os.environ.get(var)
    if not value:
        pytest.fail(f"{var} is unset: run through Bazel (tools/bazel test //tests/cpu/jit_cache:sglang_jit_check_pypi)")
    return [Path(p) for p in value.split()]


def _cache(arch: str) -> Path:
    [cache] = _paths({"12.0f": "KIMI_SGLANG_JIT_120F", "9.0a": "KIMI_SGLANG_JIT_90A",
                      "9.0a-gpu-host": "KIMI_SGLANG_JIT_90A_GPU_HOST"}[arch])
    return cache


def _gpu_host_spec() -> Path:
    [spec] = _paths("KIMI_GPU_HOST_SPEC")
    return spec


def _image_inputs() -> tuple[Path, list[Path]]:
    paths = _paths("KIMI_SGLANG_JIT_IMAGE_INPUTS")
    tars = [p for p in paths if p.name.endswith(".tar")]
    trees = [p for p in paths if not p.name.endswith(".tar")]
    assert len(tars) == 1 and trees, paths
    return tars[0], trees


def _check(arch: str, cache: Path) -> int:
    base, trees = _image_inputs()
    return sglang_aot.check_sglang(STACK, arch, MODULES, base, trees, os.environ["KIMI_IMAGE_SITE_PACKAGES"], cache)


@pytest.mark.parametrize("arch", ["12.0f", "9.0a"])
def test_sglangs_own_loader_finds_every_shipped_module(arch: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(arch, _cache(arch)) == 0
    err = capsys.readouterr().err
    entries = json.loads(MODULES.read_text())["stacks"][STACK]
    target = sglang_aot.ARCHS[arch][2]
    assert err.count(f"jit_cache: hit {target}/") == len(entries), err


@pytest.mark.parametrize("arch", ["12.0f", "9.0a"])
def test_the_shipped_tree_is_the_manifest(arch: str) -> None:
    cache = _cache(arch)
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


def test_the_gpu_hosts_cache_answers_the_keys_of_that_hosts_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    """//jit_cache:sglang_jit_9_0a_gpu_host, what the bundle carries to the H200: SGLang's loader
    with that host's answers (gpu_host.json sglang_jit_runtime: its torch's version, CUDA_HOME at
    a missing directory) finds every module; the .so bytes are the image build's, only the build
    key (its directory) differs; the image-keyed cache misses there, and this one in the image."""
    base, trees = _image_inputs()
    site = os.environ["KIMI_IMAGE_SITE_PACKAGES"]
    cache, spec = _cache("9.0a-gpu-host"), _gpu_host_spec()
    assert sglang_aot.check_sglang(STACK, "9.0a", MODULES, base, trees, site, cache, spec) == 0
    assert capsys.readouterr().err.count("jit_cache: hit sm90a/") == len(json.loads(MODULES.read_text())["stacks"][STACK])
    host = json.loads((cache / sglang_aot.MANIFEST).read_text())
    image = json.loads((_cache("9.0a") / sglang_aot.MANIFEST).read_text())
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
    for other, other_spec in ((_cache("9.0a"), spec), (cache, None)):
        with pytest.raises(UserError, match=f"check-sglang: {n} of {n} module"):
            sglang_aot.check_sglang(STACK, "9.0a", MODULES, base, trees, site, other, other_spec)
        assert capsys.readouterr().err.count("has no usable cached build") == n


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


def test_keys_differ_per_arch() -> None:
    keys = {arch: {m["module"]: m["build_key"] for m in json.loads((_cache(arch) / sglang_aot.MANIFEST).read_text())["modules"]}
            for arch in ("12.0f", "9.0a")}
    for module, key in keys["12.0f"].items():
        assert keys["9.0a"].get(module) != key


def test_a_leaf_that_does_not_reproduce_its_name_is_a_miss_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A leaf is a hit only if its dependency list, re-hashed against the image's files, gives
    its own name: a list missing one header (what a leaf built from other sources has) makes
    SGLang refuse it, and with SGLANG_CRASH_ON_JIT_COMPILE=1 the call fails naming the module."""
    cache = tmp_path / "cache"
    shutil.copytree(_cache("12.0f"), cache)
    manifest = json.loads((cache / sglang_aot.MANIFEST).read_text())
    victim = manifest["modules"][0]
    deps_file = cache / victim["leaf"] / "sgl_deps.json"
    deps_file.chmod(0o644)
    deps = json.loads(deps_file.read_text())
    del deps[-1]
    deps_file.write_text(json.dumps(deps, separators=(",", ":")))
    with pytest.raises(UserError, match="1 of .* failed"):
        _check("12.0f", cache)
    err = capsys.readouterr().err
    assert victim["call"] in err and "SGLANG_CRASH_ON_JIT_COMPILE" in err, err


def test_a_cache_of_another_arch_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match="built for stack pypi arch 9.0a, not pypi 12.0f"):
        _check("12.0f", _cache("9.0a"))


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
