"""FlashKDA's wheel: reading the pinned setup.py, planning and stamping one arch, the tree and the
wheel, on fixtures this file writes (FlashKDA is a GitHub-only input: the CPU suite never has it,
and no nvcc runs here; //kernel_cache:flashkda_wheel_* is the real build, tag manual)."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tools.common.errors import UserError
from tools.kernel_cache import flashkda
from tools.pins import lock as lockfile

COMMIT = "abcdef1234567890abcdef1234567890abcdef12"

# Written here in the shape of FlashKDA's setup.py (not a copy of it): what read_setup relies on.
SETUP_PY = '''
import os
from setuptools import setup
from torch.utils.cpp_extension import CUDAExtension, BuildExtension

this_dir = os.path.dirname(os.path.abspath(__file__))
SUPPORTED_CUDA_ARCHS = ["90a", "100a", "120a"]

def threads():
    return ["--threads", "8"]

def arch_flags():
    return ["-gencode", "arch=compute_90a,code=sm_90a"]

ext_modules = [
    CUDAExtension(
        name="widget_C",
        sources=["csrc/widget.cpp", "csrc/k/launch.cu"],
        include_dirs=[
            os.path.join(this_dir, "cutlass", "include"),
            os.path.join(this_dir, "csrc"),
        ],
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-lineinfo", *threads(), *arch_flags()],
        },
    )
]
rev = os.getenv("SUFFIX", "")
setup(name="widget", version="0.0.1" + rev, ext_modules=ext_modules, packages=["widget"],
      cmdclass={"build_ext": BuildExtension})
'''

CONFIG: dict[str, Any] = {
    "pin": "flashkda", "cutlass_pin": "flashkda-cutlass",
    "cutlass_submodule": {"path": "cutlass", "commit": "1" * 40},
    "cutlass_dirs": ["include"], "sources": ["csrc/widget.cpp", "csrc/k/launch.cu"],
    "base_version": "0.0.1", "distribution": "widget", "archs": {"9.0a": "90a", "12.0a": "120a"},
    "python_tag": "cp311", "torch_libraries": ["c10", "torch", "torch_cpu", "torch_python", "c10_cuda", "torch_cuda"],
}


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def facts(text: str = SETUP_PY) -> flashkda.SetupFacts:
    return flashkda.read_setup(text, "fixture setup.py")


def test_read_setup_takes_what_the_extension_declares() -> None:
    f = facts()
    assert f.extension == "widget_C" and f.sources == ("csrc/widget.cpp", "csrc/k/launch.cu")
    assert f.include_dirs == ("cutlass/include", "csrc")
    assert f.nvcc_flags == ("-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-lineinfo")  # starred calls dropped
    assert f.archs == ("90a", "100a", "120a") and f.base_version == "0.0.1" and f.packages == ("widget",)


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.replace("CUDAExtension(", "CppExtension("), "no CUDAExtension(...) and setup(...) calls"),
    (lambda t: t.replace('SUPPORTED_CUDA_ARCHS = ["90a", "100a", "120a"]', "ARCHS = []"), "no SUPPORTED_CUDA_ARCHS"),
    (lambda t: t.replace('"cxx": ["-O3"]', '"cxx": [flag]'), "extra_compile_args['cxx'] holds a non-string item"),
    (lambda t: t.replace('version="0.0.1" + rev', "version=rev"), "does not start with a string literal"),
    (lambda t: t + "\ndef broken(:\n", "does not parse"),
])
def test_a_changed_setup_is_one_line_naming_it_and_the_fix(edit: Any, expected: str) -> None:
    with pytest.raises(UserError) as e:
        facts(edit(SETUP_PY))
    message = one_line(e.value)
    assert message.startswith("fixture setup.py: ") and expected in message
    assert "update tools/kernel_cache/flashkda.py" in message


def test_version_is_stamped_from_the_pin_and_the_arch() -> None:
    assert flashkda.stamp_version("0.0.1", COMMIT, "90a") == "0.0.1+abcdef1.sm90a"
    with pytest.raises(UserError, match="is not a full 40-char git id"):
        flashkda.stamp_version("0.0.1", "abcdef1", "90a")


def test_plan_of_9_0a() -> None:
    p = flashkda.plan(facts(), CONFIG, "9.0a", COMMIT, "2.13.0")
    assert p["version"] == "0.0.1+abcdef1.sm90a" and p["commit"] == COMMIT
    assert p["wheel"] == "widget-0.0.1+abcdef1.sm90a-cp311-cp311-linux_x86_64.whl"
    assert p["extension_file"] == "widget_C.cpython-311-x86_64-linux-gnu.so"
    cxx, cuda = p["objects"]
    assert (cxx["kind"], cxx["out"], cxx["src"]) == ("cxx", "widget.o", "@TREE@/src/csrc/widget.cpp")
    assert (cuda["kind"], cuda["out"], cuda["src"]) == ("cuda", "launch.cuda.o", "@TREE@/src/csrc/k/launch.cu")
    args = cuda["args"]
    assert args[0] == "@CUDA_HOME@/bin/nvcc" and args[-4:] == ["-c", "@INPUT@", "-o", "@OUTPUT@"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in args and "--threads" not in args
    assert "-lineinfo" not in args  # device line tables would name the tree's absolute path
    # torch's COMMON_NVCC_FLAGS come first, so the package's -U flags win (as under BuildExtension).
    assert args.index("-D__CUDA_NO_HALF_OPERATORS__") < args.index("-U__CUDA_NO_HALF_OPERATORS__")
    for flag in ("-DTORCH_EXTENSION_NAME=widget_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-std=c++20",
                 "-I@TREE@/src/cutlass/include", "@TREE@/torch/include"):
        assert flag in args and flag in cxx["args"], flag
    assert cxx["args"][0] == "c++" and "-O3" in cxx["args"]
    link = p["link"]["args"]
    assert "-ltorch_cuda" in link and "-lcudart" in link and "-L@STUBS@" in link
    assert link.index("-Wl,--no-as-needed") < link.index("-lc10")  # stubs define nothing: keep DT_NEEDED


def test_plan_of_12_0a_differs_only_in_arch() -> None:
    a, b = (flashkda.plan(facts(), CONFIG, arch, COMMIT, "2.13.0") for arch in ("9.0a", "12.0a"))
    assert b["version"] == "0.0.1+abcdef1.sm120a" and "-gencode=arch=compute_120a,code=sm_120a" in b["objects"][1]["args"]
    assert a["objects"][0] == b["objects"][0]  # the host object does not depend on the arch


@pytest.mark.parametrize("arch, config, torch, expected", [
    ("10.0a", CONFIG, "2.13.0", "arch '10.0a' is not built here; kernel_cache/flashkda.bzl builds 12.0a, 9.0a"),
    ("9.0a", {**CONFIG, "archs": {"9.0a": "89"}}, "2.13.0", "supports 90a, 100a, 120a, not 89"),
    ("9.0a", {**CONFIG, "base_version": "0.0.2"}, "2.13.0", "set base_version to 0.0.1"),
    ("9.0a", {**CONFIG, "sources": ["csrc/widget.cpp"]}, "2.13.0", "set its sources to the setup.py's"),
    ("9.0a", {**CONFIG, "cutlass_dirs": []}, "2.13.0", "includes cutlass/include, which kernel_cache/flashkda.bzl"),
    ("9.0a", CONFIG, "2.9.0", "torch 2.9.0: the plan adds torch 2.13/2.14's extension flags"),
])
def test_plan_refusals_are_one_line_with_the_fix(arch: str, config: dict[str, Any], torch: str, expected: str) -> None:
    with pytest.raises(UserError) as e:
        flashkda.plan(facts(), config, arch, COMMIT, torch)
    assert expected in one_line(e.value)


# ---------------------------------------------------------------------------------------------
# The tree and the wheel


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def _torch_wheel(path: Path, version: str = "2.13.0") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"torch-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr("torch/include/torch/extension.h", "// stand-in\n")
        z.writestr("torch/lib/libtorch.so", b"\0" * 64)
    return path


def _inputs(tmp_path: Path, **kda_extra: bytes) -> tuple[Path, Path, Path]:
    kda = _tar(tmp_path / "kda.tar", {"setup.py": SETUP_PY.encode(), "csrc/widget.cpp": b"int f();\n",
                                      "widget/__init__.py": b"from widget_C import fwd\n", **kda_extra})
    cutlass = _tar(tmp_path / "cutlass.tar", {"include/cute/tensor.hpp": b"#pragma once\n",
                                              "docs/big.md": b"not unpacked\n"})
    return kda, cutlass, _torch_wheel(tmp_path / "torch.whl")


def test_tree_puts_cutlass_at_the_submodule_and_takes_torch_headers(tmp_path: Path) -> None:
    out = flashkda.make_tree(*_inputs(tmp_path), CONFIG, tmp_path / "tree")
    assert (out / "src" / "setup.py").read_text() == SETUP_PY
    assert (out / "src" / "cutlass" / "include" / "cute" / "tensor.hpp").is_file()
    assert not (out / "src" / "cutlass" / "docs").exists()
    assert (out / "torch" / "include" / "torch" / "extension.h").is_file() and not (out / "torch" / "lib").exists()
    record = json.loads((out / flashkda.TREE_JSON).read_text())
    assert record["torch_version"] == "2.13.0" and record["files"] == 4
    p = flashkda.plan(flashkda.read_setup((out / "src" / "setup.py").read_text()), CONFIG, "9.0a", COMMIT,
                      record["torch_version"])
    assert p["torch_version"] == "2.13.0"


def test_tree_refuses_files_at_the_submodule_path_and_leaves_nothing(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path, **{"cutlass/include/x.h": b"vendored\n"})
    with pytest.raises(UserError) as e:
        flashkda.make_tree(*inputs, CONFIG, tmp_path / "tree")
    assert "pin 'flashkda': its tar has files under cutlass/" in one_line(e.value)
    assert not (tmp_path / "tree").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "cutlass.tar", "kda.tar", "torch.whl"]


def test_tree_refuses_a_cutlass_dir_the_cutlass_tar_lacks(tmp_path: Path) -> None:
    # The CUTLASS pin archives only its `paths`: a dir cutlass_dirs names but the tar lacks is
    # one line naming both fixes, not a compile error about a missing header later.
    with pytest.raises(UserError) as e:
        flashkda.make_tree(*_inputs(tmp_path), {**CONFIG, "cutlass_dirs": ["include", "examples/common"]},
                           tmp_path / "tree")
    message = one_line(e.value)
    assert "pin 'flashkda-cutlass': its tar has no examples/common/" in message
    assert "--path examples/common" in message and "drop it from cutlass_dirs" in message
    assert not (tmp_path / "tree").exists()


def test_tree_refuses_a_wheel_that_is_not_torch(tmp_path: Path) -> None:
    kda, cutlass, _ = _inputs(tmp_path)
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("numpy-2.0.dist-info/METADATA", "Version: 2.0\n")
    with pytest.raises(UserError, match="no torch-\\*.dist-info/METADATA with a Version; pass the stack's torch wheel"):
        flashkda.make_tree(kda, cutlass, other, CONFIG, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_wheel_is_byte_identical_from_two_places_and_records_every_file(tmp_path: Path) -> None:
    p = flashkda.plan(facts(), CONFIG, "9.0a", COMMIT, "2.13.0")
    files = flashkda.wheel_files(p, {"widget/__init__.py": b"from widget_C import fwd\n"}, b"\x7fELF stand-in")
    wheels = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        out = tmp_path / where / p["wheel"]
        flashkda.write_wheel(files, out, executable=[p["extension_file"]])
        wheels.append(out.read_bytes())
    assert wheels[0] == wheels[1]
    with zipfile.ZipFile(io.BytesIO(wheels[0])) as z:
        names = z.namelist()
        info = "widget-0.0.1+abcdef1.sm90a.dist-info"
        assert names[:2] == ["widget/__init__.py", p["extension_file"]] and names[-1] == f"{info}/RECORD"
        assert all(i.date_time == flashkda.ZIP_DATE for i in z.infolist())
        assert (z.getinfo(p["extension_file"]).external_attr >> 16) & 0o777 == 0o755
        metadata = z.read(f"{info}/METADATA").decode()
        assert "Version: 0.0.1+abcdef1.sm90a" in metadata and "Requires-Dist: torch==2.13.0" in metadata
        assert "Tag: cp311-cp311-linux_x86_64" in z.read(f"{info}/WHEEL").decode()
        assert json.loads(z.read(f"{info}/kimi_k3_build.json"))["pin_commit"] == COMMIT
        rows = list(csv.reader(io.StringIO(z.read(f"{info}/RECORD").decode())))
        assert [r[0] for r in rows] == names
        for path, digest, size in rows[:-1]:
            data = z.read(path)
            assert digest == _record_hash(data) and int(size) == len(data), path


def test_wheel_installs_with_the_installer_the_image_uses(tmp_path: Path) -> None:
    installer = pytest.importorskip("installer")
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    p = flashkda.plan(facts(), CONFIG, "9.0a", COMMIT, "2.13.0")
    wheel = tmp_path / p["wheel"]
    flashkda.write_wheel(flashkda.wheel_files(p, {"widget/__init__.py": b"x = 1\n"}, b"so"), wheel,
                         executable=[p["extension_file"]])
    scheme = {k: str(tmp_path / "site") for k in ("purelib", "platlib", "headers", "scripts", "data")}
    with WheelFile.open(wheel) as source:
        installer.install(source, SchemeDictionaryDestination(scheme, interpreter="/usr/bin/python3",
                                                              script_kind="posix"), {})
    assert (tmp_path / "site" / p["extension_file"]).read_bytes() == b"so"
    assert (tmp_path / "site" / "widget" / "__init__.py").read_text() == "x = 1\n"


# ---------------------------------------------------------------------------------------------
# The checked-in config against the lock


def test_checked_in_config_names_the_locks_git_tree_pins() -> None:
    config = flashkda.read_config(lockfile.REPO_ROOT / "kernel_cache" / "flashkda.bzl")
    lock = lockfile.load(lockfile.DEFAULT_LOCK)
    kda, cutlass = lock.pin(config["pin"]), lock.pin(config["cutlass_pin"])
    assert kda.kind == cutlass.kind == "git_tree"
    assert kda.sha256, "the FlashKDA pin pins its tar too (add-git-tree)"
    assert isinstance(cutlass, lockfile.GitTreePin) and cutlass.sha256, "the CUTLASS pin pins its tar too"
    # Its archive holds only its paths: each directory the build unpacks must be one of them or
    # lie inside one.
    assert all(any(d == p or d.startswith(p + "/") for p in cutlass.paths) for d in config["cutlass_dirs"]), (
        f"cutlass_dirs {config['cutlass_dirs']} outside the pin's paths {list(cutlass.paths)}")
    assert config["cutlass_submodule"]["commit"] == cutlass.commit, (
        "flashkda-cutlass must be the commit FlashKDA's cutlass submodule names")
    assert set(config["archs"]) == {"9.0a", "12.0a"}
    assert not any(config["pin"] in s.pin_names() or config["cutlass_pin"] in s.pin_names()
                   for s in lock.stacks.values()), "the default image must not need FlashKDA's pins"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
