"""The Triton stage's own logic on fixtures (tools/jit_cache/triton_aot.py; the image build and its
check are //tests/cpu/jit_cache:triton_check_pypi): which files of Triton's cache are shipped, how
`bind` makes a TRITON_CACHE_DIR take them, the call list's mistakes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.jit_cache import triton_aot


def _entry(cache: Path, key: str, kernel: str, extra: tuple[str, ...] = ()) -> None:
    d = cache / key
    d.mkdir(parents=True)
    names = [f"{kernel}.cubin", f"{kernel}.json", f"{kernel}.ptx", f"{kernel}.ttir", *extra]
    for n in names:
        (d / n).write_bytes(n.encode())
    (d / f"__grp__{kernel}.json").write_text(json.dumps({"child_paths": {n: str(d / n) for n in names}}))


def test_only_what_a_hit_reads_is_shipped(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    _entry(cache, "AAAA", "k1")
    _entry(cache, "BBBB", "k2")
    (cache / "CCCC").mkdir()
    (cache / "CCCC" / "k1.autotune.json").write_text("{}")  # an autotune result: not shipped
    (cache / "DDDD").mkdir()  # an unfinished entry: no group file
    entries = triton_aot.shipped_entries(cache)
    assert sorted(entries) == ["AAAA", "BBBB"]
    assert entries["AAAA"]["kernel"] == "k1" and sorted(entries["AAAA"]["files"]) == ["k1.cubin", "k1.json"]
    (cache / "BBBB" / "__grp__k2.json").write_text(json.dumps({"child_paths": {"k2.ptx": "x"}}))
    with pytest.raises(UserError, match=r"BBBB: k2 has no .cubin and .json"):
        triton_aot.shipped_entries(cache)


def test_bind_points_group_files_at_the_shipped_files(tmp_path: Path) -> None:
    shipped = tmp_path / "shipped"
    (shipped / "AAAA").mkdir(parents=True)
    for n in ("k1.cubin", "k1.json"):
        (shipped / "AAAA" / n).write_bytes(b"x")
    manifest = {"schema_version": triton_aot.SCHEMA_VERSION,
                "entries": {"AAAA": {"kernel": "k1", "files": {"k1.cubin": "0", "k1.json": "0"}},
                            "BBBB": {"kernel": "k2", "files": {"k2.cubin": "0", "k2.json": "0"}}}}
    (shipped / triton_aot.MANIFEST).write_text(json.dumps(manifest))
    runtime = tmp_path / "runtime"
    (runtime / "BBBB").mkdir(parents=True)
    own = runtime / "BBBB" / "__grp__k2.json"
    own.write_text("the runtime's own")  # an entry the directory has stays as it is
    assert triton_aot.bind(shipped, runtime) == 1
    group = json.loads((runtime / "AAAA" / "__grp__k1.json").read_text())
    assert group == {"child_paths": {n: str(shipped.absolute() / "AAAA" / n) for n in ("k1.cubin", "k1.json")}}
    assert own.read_text() == "the runtime's own"
    assert triton_aot.bind(shipped, runtime) == 0


def test_sources_get_one_mtime_in_the_builds_tree(tmp_path: Path) -> None:
    """The kernels' line info records each source's mtime: the build's copy of the packages has
    one fixed mtime, whatever the installed trees have; other files stay links."""
    installed = tmp_path / "installed" / "pkg"
    (installed / "sub").mkdir(parents=True)
    (installed / "sub" / "k.py").write_text("def k(): pass\n")
    (installed / "lib.so").write_bytes(b"\x7fELF")
    site = tmp_path / "site"
    site.mkdir()
    (site / "pkg").symlink_to(installed)
    assert triton_aot.fix_source_mtimes(site, 1767225600, ("pkg",)) == 1
    copy = site / "pkg" / "sub" / "k.py"
    assert not (site / "pkg").is_symlink() and not copy.is_symlink()
    assert copy.read_text() == "def k(): pass\n" and copy.stat().st_mtime == 1767225600
    assert (site / "pkg" / "lib.so").is_symlink() and (site / "pkg" / "lib.so").resolve() == installed / "lib.so"
    assert (installed / "sub" / "k.py").stat().st_mtime != 1767225600  # the installed tree is untouched
    with pytest.raises(UserError, match="no triton package in the image's trees"):
        triton_aot.fix_source_mtimes(site, 0, ("triton",))


K = ["m.a:k1", "m.b:k2"]


@pytest.mark.parametrize("stacks, message", [
    ({"pypi": [{"call": "nope", "args": {}, "kernels": K, "why": "x"}]}, r"call 'nope' is not one of sglang_kda_prefill"),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": {}, "why": "x"}]}, r"\$\.stacks\.pypi\[0\]: missing key 'kernels'"),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": [], "kernels": K, "why": "x"}]},
     r"\$\.stacks\.pypi\[0\]\.args: expected an object, found a list"),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": {}, "kernels": K, "why": " "}]}, r"why is empty"),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": {}, "kernels": K[::-1], "why": "x"}]}, r"kernels must be the sorted"),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": {}, "kernels": ["k1"], "why": "x"}]}, r"kernels must be the sorted .module:function."),
    ({"pypi": [{"call": "sglang_kda_prefill", "args": {}, "kernels": K, "why": "x"}] * 2}, r"stacks.pypi\[1\]: listed twice"),
    ({"default": []}, r"no stacks.pypi; add it"),
])
def test_call_list_mistakes_are_one_line(tmp_path: Path, stacks: dict, message: str) -> None:
    path = tmp_path / "calls.json"
    path.write_text(json.dumps({"stacks": stacks}))
    with pytest.raises(UserError, match=message):
        triton_aot.load_calls(path, "pypi")


def test_the_checked_in_call_list_loads_for_every_stack() -> None:
    path = Path("jit_cache/triton_calls.json")
    for stack in json.loads(path.read_text())["stacks"]:
        triton_aot.load_calls(path, stack)
    with pytest.raises(UserError, match=r"--arch 9.0: not one of 12.0"):
        triton_aot.build_triton("pypi", "9.0", path, Path("base.tar"), [], "/usr/local/lib/python3.11/dist-packages", Path("out"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


GPU_HOST = Path(__file__).resolve().parents[3] / "tools" / "gpu_suite" / "gpu_host.json"


def test_the_gpu_hosts_triton_runtime_loads_and_names_its_device() -> None:
    runtime = triton_aot.load_runtime(GPU_HOST)
    assert runtime["site_packages"].startswith("/") and runtime["triton_wheel"].startswith("triton-3.8.0-cp312-")
    # The host's Python, from the file's own `python`, and its extension suffix.
    assert (runtime["python"], runtime["ext_suffix"]) == ("3.12", ".cpython-312-x86_64-linux-gnu.so")
    assert triton_aot._device("9.0", runtime) == runtime["device"]
    with pytest.raises(UserError, match=r"^--arch 12\.0: the runtime's device is capability \[9, 0\]; build for its arch$"):
        triton_aot._device("12.0", runtime)
    with pytest.raises(UserError, match=r"^--arch 9\.0: not one of 12\.0 \(another device: --runtime\)$"):
        triton_aot._device("9.0")


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("triton_wheel"), r": \$\.triton_runtime: missing key 'triton_wheel'; fix the file$"),
    (lambda r: r.update(python="3.12"), r": \$\.triton_runtime: unknown key 'python' \(known: device, libcuda_path, "
                                        r"python_include_deb, "),
    (lambda r: r.update(site_packages="opt/site"), r": \$\.triton_runtime\.site_packages: 'opt/site' is not an absolute path$"),
    (lambda r: r["device"].pop("device_properties"), r": \$\.triton_runtime\.device: missing key 'device_properties'"),
    (lambda r: r["device"].update(capability=[9]), r": \$\.triton_runtime\.device\.capability: expected \[major, minor\]"),
])
def test_runtime_file_mistakes_are_one_line(tmp_path: Path, change, message: str) -> None:
    data = json.loads(GPU_HOST.read_text())
    change(data["triton_runtime"])
    bad = tmp_path / "host.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match=rf"^--runtime {bad}{message}"):
        triton_aot.load_runtime(bad)
