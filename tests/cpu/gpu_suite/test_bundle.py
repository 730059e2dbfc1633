"""CPU tests of the GPU host recipe: the bundle (tools/gpu_suite/bundle.py) and the GPU host's
run.sh side (tools/gpu_suite/host.py), with stand-in wheels and a stand-in nvcc: no GPU, no
compiling, no network.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.cpu.conftest import PINS_LOCK, stack_pin
from tools.common.errors import UserError
from tools.gpu_suite import bundle, host
from tools.pins import lock as pins_lock
from tools.pins.lock import FilePin

ROOT = Path(__file__).absolute().parents[3]
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _lock() -> pins_lock.Lock:
    return pins_lock.load(PINS_LOCK)


def _wheel(path: Path, members: dict[str, str], version: str = "0") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
        z.writestr(f"{path.name.split('-')[0]}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: x\nVersion: {version}\n")
    return path


def _stand_in_fetch(tmp: Path):
    """fetch(pin) -> a small wheel under the pin's filename (tvm-ffi's with a header)."""
    def fetch(pin: FilePin) -> Path:
        members = {"tvm_ffi/include/tvm/ffi/c_api.h": "/* stand-in */\n"} \
            if pin.filename.startswith("apache_tvm_ffi-") else {"x/__init__.py": ""}
        version = pin.package.version if pin.package else "0"
        return _wheel(tmp / pin.filename, members, version)
    (tmp).mkdir(parents=True, exist_ok=True)
    return fetch


def _sglang_jit(tmp: Path) -> tuple[Path, Path]:
    """A stand-in SGLang wheel and JIT cache (the manifest and one leaf)."""
    tmp.mkdir(parents=True, exist_ok=True)
    sg = _wheel(tmp / "sglang-0.5.23+kimik3.stand.in-cp311-cp311-manylinux_2_34_x86_64.whl",
                {"sglang/__init__.py": ""}, "0.5.23+kimik3.stand.in")
    cache = tmp / "sglang-jit"
    leaf = cache / "sm90a" / "m" / "build-0" / "deps-0"
    leaf.mkdir(parents=True)
    (leaf / "m.so").write_bytes(b"\x7fELF stand-in")
    (cache / host.SGLANG_JIT_MANIFEST).write_text(json.dumps({"arch": "9.0a", "modules": []}))
    return sg, cache


def _bundle(tmp: Path, python: str = PYTHON, with_sglang_jit: bool = False) -> tuple[Path, dict]:
    fi = _wheel(tmp / "flashinfer_python-0+stand.in-py3-none-any.whl", {"flashinfer/__init__.py": ""})
    spec = bundle.load_host_spec(bundle.HOST_SPEC)
    out = tmp / "bundle"
    sg, cache = _sglang_jit(tmp) if with_sglang_jit else (None, None)
    manifest = bundle.write_bundle(out, lock=_lock(), stack_name="pypi", flashinfer_wheel=fi,
                                   spec=spec, python=python, fetch=_stand_in_fetch(tmp / "pins"),
                                   sglang_wheel=sg, sglang_jit=cache)
    return out, manifest


def test_gpu_host_wheels_are_the_stacks_pins_or_their_builds_for_the_hosts_python() -> None:
    lock, spec = _lock(), bundle.load_host_spec(bundle.HOST_SPEC)
    for stack in lock.stacks:
        tvm, mooncake = stack_pin(stack, "tvm_ffi"), stack_pin(stack, "mooncake")
        on_312 = {p.name for p in bundle.host_wheel_pins(lock, stack, spec, spec.python)}
        # The image's 3.11 builds of tvm-ffi and Mooncake do not run on the H200 host's 3.12.
        assert tvm not in on_312 and mooncake not in on_312, on_312
        assert set(spec.host_builds[tvm]) & on_312 and set(spec.host_builds[mooncake]) & on_312
        assert all(bundle.runs_on(lock.pins[p].filename, spec.python) for p in on_312)
        on_311 = {p.name for p in bundle.host_wheel_pins(lock, stack, spec, "3.11")}
        assert {tvm, mooncake} <= on_311, on_311
        assert len(on_312) == len(on_311) == len(spec.wheels)


def test_a_stack_pin_built_only_for_another_python_is_refused_naming_the_fix() -> None:
    lock = _lock()
    numpy = next(p for p in lock.stack("pypi").pin_names()
                 if isinstance(lock.pins[p], FilePin) and lock.pins[p].package
                 and lock.pins[p].package.name == "numpy")
    version = lock.pins[numpy].package.version
    spec = bundle.HostSpec(python="3.12", wheels=("numpy",), host_builds={}, from_host=())
    with pytest.raises(UserError, match=(
            rf"^stack pypi: pin {re.escape(numpy)} \(numpy-{re.escape(version)}-cp311-.*\) does not "
            rf"run on the GPU host's CPython 3\.12 .* add-pypi numpy=={re.escape(version)} --python "
            rf"3\.12 .* host_builds\.{re.escape(numpy)} in ")):
        bundle.host_wheel_pins(lock, "pypi", spec, "3.12")


def test_the_bundle_holds_wheels_headers_tools_and_a_manifest_the_host_checks(tmp_path: Path) -> None:
    out, manifest = _bundle(tmp_path)
    assert manifest["stack"] == "pypi" and manifest["python"] == PYTHON
    assert manifest["nvcc_release"] == _lock().toolchain("cuda-13.0").release
    for rel in ("run.sh", "tvm_ffi/include/tvm/ffi/c_api.h", "tvm_ffi/kimi-k3-tvm-ffi.json",
                "repo/tools/gpu_suite/host.py", "repo/tools/kernel_cache/cli.py",
                "repo/tests/gpu/conftest.py", "repo/kernel_cache/selections.json",
                manifest["flashinfer_wheel"], *manifest["wheels"]):
        assert rel in manifest["files"], rel
    assert os.access(out / "run.sh", os.X_OK)
    assert host.verify_bundle(out)["files"] == manifest["files"]

    victim = out / manifest["wheels"][0]
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(UserError, match=rf"^{re.escape(str(victim))}: differs from its manifest.json entry"):
        host.verify_bundle(out)
    victim.unlink()
    with pytest.raises(UserError, match=rf"^{re.escape(str(victim))}: missing from the bundle"):
        host.verify_bundle(out)


def test_a_failed_bundle_leaves_the_previous_one_and_nothing_half_written(tmp_path: Path) -> None:
    out, manifest = _bundle(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())

    def failing_fetch(pin: FilePin) -> Path:
        raise UserError(f"fetch {pin.name}: no source")

    fi = next(tmp_path.glob("flashinfer_python-*.whl"))
    with pytest.raises(UserError, match="no source"):
        bundle.write_bundle(out, lock=_lock(), stack_name="pypi", flashinfer_wheel=fi,
                            spec=bundle.load_host_spec(bundle.HOST_SPEC), python=PYTHON,
                            fetch=failing_fetch)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert host.verify_bundle(out)["files"] == manifest["files"]


@pytest.mark.parametrize("capability,want", [((9, 0), ("9.0a", "gpu-test-sm90")),
                                             ((12, 0), ("12.0f", "kimi-k3")),
                                             ((12, 1), ("12.0f", "kimi-k3"))])
def test_the_gpu_picks_the_arch_and_selection_from_selections_json(capability, want) -> None:
    sels = json.loads(host.SELECTIONS.read_text())
    assert host.arch_for(capability, sels) == want


def test_a_gpu_no_selection_covers_is_one_line() -> None:
    sels = json.loads(host.SELECTIONS.read_text())
    with pytest.raises(UserError, match=r"^this GPU is sm80: .* covers 12\.0f, 9\.0a; pass --arch"):
        host.arch_for((8, 0), sels)
    with pytest.raises(UserError, match=r"^this GPU is sm91"):
        host.arch_for((9, 1), sels)


def test_the_host_python_must_be_the_bundles() -> None:
    with pytest.raises(UserError, match=r"runs CPython 3\.11, the bundle's wheels are for 3\.12; .* --python 3\.11"):
        host.check_python({"python": "3.12", "from_host": []}, (3, 11))
    with pytest.raises(UserError, match=r"cannot import no_such_module_here, which the GPU host must provide"):
        host.check_python({"python": "3.12", "from_host": ["json", "no_such_module_here"]}, (3, 12))


def _nvcc(tmp: Path, release: str) -> Path:
    cuda = tmp / f"cuda-{release}"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(0o755)
    return cuda


def _run_sh(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": sys.executable}
    return subprocess.run(["sh", str(out / "run.sh"), *args], capture_output=True, text=True, env=env)


def test_run_sh_names_every_input_of_the_build_and_the_suite(tmp_path: Path) -> None:
    """The newcomer's gaps in the old recipe: the build's --cuda-home, --tvm-ffi and tvm-ffi on
    PYTHONPATH, and the tree, all given by run.sh itself (here printed with --dry-run)."""
    out, manifest = _bundle(tmp_path)
    release = manifest["nvcc_release"]
    proc = _run_sh(out, "--dry-run", "--arch", "9.0a", "--cuda-home", str(_nvcc(tmp_path, release)),
                   "--mem-budget-mb", "1000", "-j", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    build, suite = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    work = out / "work"
    assert build.startswith(f"+ PYTHONPATH={work / 'site'}:{out / 'repo'} "), build
    for arg in (f"--flashinfer-tree {work / 'tree'}", "--arch 9.0a", "--selection gpu-test-sm90",
                f"--cuda-home {tmp_path / ('cuda-' + release)}", f"--tvm-ffi {out / 'tvm_ffi'}",
                f"--out {work / 'kc'}", f"--cache-dir {work / 'objcache'}", "-j 3",
                "--mem-budget-mb 1000", f"--modules {out / 'repo/kernel_cache/modules.json'}"):
        assert arg in build, (arg, build)
    assert " -m tools.kernel_cache build " in build
    assert " -m tools.gpu_suite " in suite and f"--kernel-cache {work / 'kc'}" in suite
    for rel in [manifest["flashinfer_wheel"], *manifest["wheels"]]:
        assert f"--wheel {out / rel}" in suite, rel
    # Every GPU test file but the SGLang JIT proof, which runs apart with no compiler reachable.
    tests = sorted(p for p in (out / "repo/tests/gpu").glob("test_*.py") if p.name not in ("test_sglang_jit_gpu.py", "test_triton_gpu.py"))
    assert len(tests) == 3 and suite.endswith("--tests " + " ".join(map(str, tests))), suite


def test_the_sglang_jit_proof_runs_with_no_compiler_reachable(tmp_path: Path) -> None:
    """`run.sh --sglang-jit`: only the proof (no kernel-cache build); its pytest process has an
    empty directory for PATH, CUDA_HOME at gpu_host.json's missing directory, the bundle's cache
    (copied to WORK) as SGLANG_JIT_CACHE_DIR, compiling forbidden; then the first-call table."""
    from tools.jit_cache.sglang_aot import MANIFEST
    assert host.SGLANG_JIT_MANIFEST == MANIFEST  # host.py runs where tools/jit_cache is not copied
    out, manifest = _bundle(tmp_path, with_sglang_jit=True)
    assert manifest["sglang_wheel"].startswith("wheels/sglang-0.5.23+kimik3.stand.in-")
    assert manifest["sglang_jit_cache"] == "sglang_jit"
    assert f"sglang_jit/{host.SGLANG_JIT_MANIFEST}" in manifest["files"]
    assert "sglang_jit/sm90a/m/build-0/deps-0/m.so" in manifest["files"]
    runtime = json.loads(bundle.HOST_SPEC.read_text())["sglang_jit_runtime"]
    cuda = _nvcc(tmp_path, manifest["nvcc_release"])
    proc = _run_sh(out, "--sglang-jit", "--dry-run", "--cuda-home", str(cuda))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proof, bench = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    work = out / "work"
    assert proof.startswith(f"+ PATH={work / 'no-compilers'} CUDA_HOME={runtime['cuda_home']} "
                            f"SGLANG_JIT_CACHE_DIR={work / 'sglang-jit'} "), proof
    assert proof.endswith(str(out / "repo/tests/gpu/test_sglang_jit_gpu.py")), proof
    assert " -m tools.kernel_cache " not in proc.stdout
    for arg in (f"--cache {work / 'sglang-jit'}", f"--cuda-home {cuda}",
                f"--ninja-wheel {out / 'wheels'}/ninja-", " -m tools.gpu_suite.first_call "):
        assert arg in bench, (arg, bench)
    # The full run prints it after the build and the suite.
    proc = _run_sh(out, "--dry-run", "--arch", "9.0a", "--cuda-home", str(cuda))
    assert proc.returncode == 0 and proc.stdout.count("+ ") == 4, proc.stdout + proc.stderr


def test_the_triton_proof_installs_triton_without_ptxas_and_runs_with_no_compiler_reachable(tmp_path: Path) -> None:
    """`run.sh --triton`: the bundle's triton/ holds the cache keyed for the host and the keyed
    Triton's files without its compilers' binaries and CUPTI; the proof's pytest process has an
    empty directory for PATH, CUDA_HOME and TRITON_PTXAS_PATH at the missing directory, the
    bound cache as TRITON_CACHE_DIR and the keyed Triton first on PYTHONPATH; a stand-in ptxas
    prints the keyed version and compiles nothing."""
    from tools.jit_cache.triton_aot import MANIFEST
    assert host.TRITON_MANIFEST == bundle.TRITON_MANIFEST == MANIFEST
    runtime = json.loads(bundle.HOST_SPEC.read_text())["triton_runtime"]
    cache = tmp_path / "triton-cache"
    (cache / "KEY").mkdir(parents=True)
    (cache / "KEY" / "k.cubin").write_bytes(b"cubin")
    (cache / MANIFEST).write_text(json.dumps({"runtime": runtime, "ptxas_version": "ptxas release 12.9\n",
                                              "calls": [], "modules": [],
                                              "entries": {"KEY": {"kernel": "k", "files": {"k.cubin": "0"}}}}))
    fetch = _stand_in_fetch(tmp_path / "pins")
    wheel = lambda pin: _wheel(tmp_path / "pins" / pin.filename, {  # noqa: E731
        "triton/__init__.py": "", "triton/_C/libtriton.so": "so", "triton/backends/nvidia/bin/ptxas": "real",
        "triton/backends/nvidia/lib/cupti/libcupti.so": "cupti", "triton/backends/nvidia/lib/libdevice.10.bc": "bc"},
        "3.8.0") if pin.filename == runtime["triton_wheel"] else fetch(pin)
    sg, sj = _sglang_jit(tmp_path)
    fi = _wheel(tmp_path / "flashinfer_python-0+stand.in-py3-none-any.whl", {"flashinfer/__init__.py": ""})
    out = tmp_path / "bundle"
    manifest = bundle.write_bundle(out, lock=_lock(), stack_name="pypi", flashinfer_wheel=fi,
                                   spec=bundle.load_host_spec(bundle.HOST_SPEC), python=PYTHON, fetch=wheel,
                                   sglang_wheel=sg, sglang_jit=sj, triton_cache=cache)
    assert manifest["triton"] == {"cache": "triton/cache", "site": "triton/site"}
    site = {f for f in manifest["files"] if f.startswith("triton/site/")}
    assert site == {"triton/site/triton/__init__.py", "triton/site/triton/_C/libtriton.so",
                    "triton/site/triton/backends/nvidia/lib/libdevice.10.bc",
                    "triton/site/triton-3.8.0.dist-info/METADATA"}, site
    assert f"triton/cache/{MANIFEST}" in manifest["files"] and "triton/cache/KEY/k.cubin" in manifest["files"]
    assert "repo/tools/jit_cache/triton_aot.py" in manifest["files"]
    proc = _run_sh(out, "--triton", "--dry-run", "--cuda-home", str(_nvcc(tmp_path, manifest["nvcc_release"])))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    install, proof, bench = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    work = out / "work"
    assert install == f"+ install {out / 'triton/site'} at {runtime['site_packages']} (ptxas: a stand-in)"
    missing = json.loads(bundle.HOST_SPEC.read_text())["sglang_jit_runtime"]["cuda_home"]
    assert proof.startswith(f"+ PATH={work / 'no-compilers'} CUDA_HOME={missing} TRITON_CACHE_DIR="
                            f"{work / 'triton-cache'} PYTHONPATH={runtime['site_packages']}:"), proof
    assert proof.endswith(str(out / "repo/tests/gpu/test_triton_gpu.py")), proof
    assert f" -m tools.gpu_suite.triton_first_call --cache {work / 'triton-shipped'}" in bench, bench
    # The stand-in ptxas: the keyed version for --version, a refusal for anything else.
    installed = tmp_path / "site"
    host.install_triton(out / "triton/site", installed, "ptxas release 12.9\n")
    ptxas = installed / "triton/backends/nvidia/bin/ptxas"
    assert subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout == "ptxas release 12.9\n"
    refused = subprocess.run([str(ptxas), "-arch=sm_90", "k.ptx"], capture_output=True, text=True)
    assert refused.returncode == 1 and "compiles nothing" in refused.stderr


def test_the_sglang_jit_proof_needs_a_bundle_that_has_one(tmp_path: Path) -> None:
    out, _ = _bundle(tmp_path)
    proc = _run_sh(out, "--sglang-jit", "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {out / 'manifest.json'}: no SGLang JIT cache in this bundle"), proc.stderr
    sg, cache = _sglang_jit(tmp_path / "in")
    fi = _wheel(tmp_path / "flashinfer_python-0+stand.in-py3-none-any.whl", {"flashinfer/__init__.py": ""})
    spec = bundle.load_host_spec(bundle.HOST_SPEC)
    kwargs = dict(lock=_lock(), stack_name="pypi", flashinfer_wheel=fi, spec=spec, python=PYTHON,
                  fetch=_stand_in_fetch(tmp_path / "pins"))
    with pytest.raises(UserError, match=r"--sglang-wheel / --sglang-jit: give both"):
        bundle.write_bundle(tmp_path / "b2", sglang_wheel=sg, **kwargs)
    (cache / host.SGLANG_JIT_MANIFEST).unlink()
    with pytest.raises(UserError, match=rf"--sglang-jit {re.escape(str(cache))}: no kimi-k3-sglang-jit.json"):
        bundle.write_bundle(tmp_path / "b3", sglang_wheel=sg, sglang_jit=cache, **kwargs)
    assert not (tmp_path / "b2").exists() and not (tmp_path / "b3").exists()


def test_run_sh_refuses_an_nvcc_the_plans_are_not_made_for(tmp_path: Path) -> None:
    out, manifest = _bundle(tmp_path)
    proc = _run_sh(out, "--dry-run", "--arch", "9.0a", "--cuda-home", str(_nvcc(tmp_path, "12.9")))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: --cuda-home {tmp_path / 'cuda-12.9'}: nvcc 12.9, but the kernel plans are made "
        f"for nvcc {manifest['nvcc_release']}"), proc.stderr
    assert "Traceback" not in proc.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


def _users_checkout(path: Path) -> dict[str, bytes]:
    (path / ".git").mkdir(parents=True)
    (path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (path / "uncommitted.py").write_bytes(b"work in progress\n")
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_out_holding_the_users_files_is_refused_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tools/bazel run //tools/gpu_suite:bundle -- --out .` named the checkout, which was replaced
    whole (.git and uncommitted files gone). Now refused in one line, before any fetch."""
    checkout = tmp_path / "checkout"
    before = _users_checkout(checkout)
    fi = _wheel(tmp_path / "flashinfer_python-0+stand.in-py3-none-any.whl", {"flashinfer/__init__.py": ""})
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(checkout))
    with pytest.raises(UserError) as e:
        bundle.main(["--out", ".", "--stack", "pypi", "--flashinfer-wheel", str(fi)])
    assert str(e.value).startswith(f"--out {checkout}: exists, is not empty and holds files that "
                                   f"{bundle.BUNDLE_TOOL} did not write")
    with pytest.raises(UserError, match="is not empty"):  # the library call, with its fetcher
        bundle.write_bundle(checkout, lock=_lock(), stack_name="pypi", flashinfer_wheel=fi,
                            spec=bundle.load_host_spec(bundle.HOST_SPEC), python=PYTHON,
                            fetch=_stand_in_fetch(tmp_path / "pins"))
    after = {str(p.relative_to(checkout)): p.read_bytes() for p in sorted(checkout.rglob("*")) if p.is_file()}
    assert after == before
    # Its own previous bundle is replaced, and an --out under a file is one line.
    out, _ = _bundle(tmp_path)
    out2, _ = _bundle(tmp_path)
    assert out2 == out and host.verify_bundle(out)
    with pytest.raises(UserError, match=r"is not a directory; pass a path under a directory$"):
        bundle.main(["--out", str(checkout / "uncommitted.py" / "b"), "--stack", "pypi",
                     "--flashinfer-wheel", str(fi)])


def test_the_host_runner_replaces_only_its_own_folders(tmp_path: Path) -> None:
    users = tmp_path / "site"
    before = _users_checkout(users)
    with pytest.raises(UserError, match="is not empty"):
        host.unpack_into(users, [])
    assert {str(p.relative_to(users)): p.read_bytes() for p in sorted(users.rglob("*")) if p.is_file()} == before
    fresh = tmp_path / "fresh"
    host.unpack_into(fresh, [])
    host.unpack_into(fresh, [])  # a rerun replaces its own
