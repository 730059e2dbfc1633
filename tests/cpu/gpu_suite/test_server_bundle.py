"""The real-server proof's transport (issue #38): server_bundle.py writes an image's layers as
parts with sha256s, leaving out the host's CUDA libraries and the SM120 layers; server_host.py
installs them (a trial root here), refuses a corrupted part, and a --trees-only overlay lands over
an earlier install without touching it otherwise."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tools.common.errors import UserError
from tools.gpu_suite import server_bundle

HOST = Path(server_bundle.__file__).with_name("server_host.py")


def _layer(tmp: Path, name: str, files: dict[str, bytes]) -> Path:
    """A built layer as the image's layer action leaves it (gzip here: zstd needs its CLI)."""
    blob = tmp / f"layer_{name}.tar.zst"
    with tarfile.open(blob, "w:gz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    meta = tmp / f"layer_{name}.layer.json"
    meta.write_text(json.dumps({"name": name, "digest": "sha256:" + "0" * 64,
                                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"}))
    return meta


@pytest.fixture()
def layers(tmp_path: Path) -> list[Path]:
    site = "usr/local/lib/python3.11/dist-packages"
    return [
        _layer(tmp_path, "base", {"usr/bin/python3.11": b"python", "usr/lib/x86_64-linux-gnu/libc.so.6": b"debian libc",
                                  "usr/lib/x86_64-linux-gnu/libffi.so.8": b"debian libffi"}),
        _layer(tmp_path, "torch", {f"{site}/torch/__init__.py": b"torch",
                                   f"{site}/nvidia/cu13/lib/libcublas.so.13": b"cublas from the wheel"}),
        _layer(tmp_path, "kernel_cache", {f"{site}/flashinfer/data/aot/sm120.so": b"sm120"}),
        _layer(tmp_path, "entrypoint", {"usr/local/bin/kimi-k3-entrypoint": b"entry"}),
    ]


def _bundle(tmp: Path, out: Path, *args: str, part_mib: int = 1) -> dict:
    assert server_bundle.main([*args, "--out", str(out), "--part-mib", str(part_mib)]) == 0
    return json.loads((out / "manifest.json").read_text())


def _install(bundle: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HOST), "install", "--bundle", str(bundle), "--root", str(root)],
                          capture_output=True, text=True)


def test_bundle_installs_the_image_files_and_leaves_out_what_the_host_gives(tmp_path, layers):
    args = [a for layer in layers for a in ("--layer", str(layer))] + ["--env", "A=1"]
    manifest = _bundle(tmp_path, tmp_path / "b", *args)
    assert [l["layer"] for l in manifest["layers"]] == ["layer_base", "layer_torch", "layer_entrypoint"]
    assert [l["layer"] for l in manifest["layers_left_out"]] == ["layer_kernel_cache"]
    assert manifest["from_host"] == {"cuBLAS": ["usr/local/lib/python3.11/dist-packages/nvidia/cu13/lib/libcublas.so.13"]}
    assert manifest["env"] == ["A=1"] and manifest["overlay"] is False
    root = tmp_path / "root"
    proc = _install(tmp_path / "b", root)
    assert proc.returncode == 0, proc.stderr
    assert (root / "usr/bin/python3.11").read_bytes() == b"python"
    assert (root / "usr/local/bin/kimi-k3-entrypoint").read_bytes() == b"entry"
    assert not (root / "usr/local/lib/python3.11/dist-packages/nvidia").exists()
    assert not (root / "usr/local/lib/python3.11/dist-packages/flashinfer").exists()


def test_the_hosts_own_files_stay_and_the_images_own_trees_win(tmp_path, layers):
    args = [a for layer in layers for a in ("--layer", str(layer))]
    _bundle(tmp_path, tmp_path / "b", *args)
    root = tmp_path / "root"
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu/libc.so.6").write_bytes(b"host libc")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/python3.11").write_bytes(b"host python3.11")
    proc = _install(tmp_path / "b", root)
    assert proc.returncode == 0, proc.stderr
    assert (root / "usr/lib/x86_64-linux-gnu/libc.so.6").read_bytes() == b"host libc"
    assert (root / "usr/lib/x86_64-linux-gnu/libffi.so.8").read_bytes() == b"debian libffi"
    assert (root / "usr/bin/python3.11").read_bytes() == b"python"


def test_a_corrupted_part_is_refused(tmp_path, layers):
    args = [a for layer in layers for a in ("--layer", str(layer))]
    manifest = _bundle(tmp_path, tmp_path / "b", *args)
    part = tmp_path / "b" / manifest["parts"][0]["file"]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    proc = _install(tmp_path / "b", tmp_path / "root")
    assert proc.returncode != 0
    assert "root.tar.gz.000: sha256 differs from manifest.json" in proc.stderr
    assert not (tmp_path / "root").exists()


def test_trees_only_overlay_adds_the_caches_over_an_install(tmp_path, layers):
    args = [a for layer in layers for a in ("--layer", str(layer))]
    _bundle(tmp_path, tmp_path / "b", *args)
    root = tmp_path / "root"
    assert _install(tmp_path / "b", root).returncode == 0
    cache = tmp_path / "triton"
    (cache / "KEY").mkdir(parents=True)
    (cache / "KEY" / "kernel.cubin").write_bytes(b"cubin")
    overlay = _bundle(tmp_path, tmp_path / "o", "--trees-only", "--tree", f"/usr/share/kimi-k3/triton={cache}")
    assert overlay["overlay"] is True and overlay["layers"] == [] and len(overlay["parts"]) == 1
    proc = _install(tmp_path / "o", root)
    assert proc.returncode == 0, proc.stderr
    assert (root / "usr/share/kimi-k3/triton/KEY/kernel.cubin").read_bytes() == b"cubin"
    assert (root / "usr/bin/python3.11").read_bytes() == b"python"


def test_trees_only_without_a_tree_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--trees-only: give at least one --tree"):
        server_bundle.main(["--trees-only", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_serve_refuses_a_root_without_the_triton_driver_module(tmp_path):
    """The first record run on a GPU host (an H100) failed this way after 6 minutes: the bundle
    left out the Triton layer, so Triton compiled cuda_utils at its first launch and found no
    Python.h. serve now says so before starting anything."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    problem = host.triton_driver_problem(str(tmp_path))
    assert problem and "holds no Triton driver module (cuda_utils)" in problem and "triton_driver_12_0" in problem
    module = tmp_path / "usr/share/kimi-k3/triton/0123abcd/cuda_utils.cpython-311-x86_64-linux-gnu.so"
    module.parent.mkdir(parents=True)
    module.write_bytes(b"\x7fELF")
    assert host.triton_driver_problem(str(tmp_path)) is None
    module.unlink()
    header = tmp_path / "usr/include/python3.11/Python.h"
    header.parent.mkdir(parents=True)
    header.write_text("")
    assert host.triton_driver_problem(str(tmp_path)) is None


def test_a_server_that_dies_ends_the_workload_at_once():
    """The same run then waited 398 s for a server that had died 40 s after its start."""
    import importlib.util
    import time
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    server = subprocess.Popen(["sleep", "0.5"])
    workload = subprocess.Popen(["sleep", "60"])
    started = time.time()
    assert "the server exited (0) before the workload finished" == host.wait_for_workload(server, workload, 60)
    assert time.time() - started < 15 and workload.returncode is not None
    server = subprocess.Popen(["sleep", "60"])
    try:
        assert host.wait_for_workload(server, subprocess.Popen(["true"]), 60) is None
        assert host.wait_for_workload(server, subprocess.Popen(["sleep", "60"]), 1) == "the workload ran past 1 s"
    finally:
        server.kill()


def test_the_servers_path_has_no_file_command_as_the_image_has_none(tmp_path):
    """Triton keys its driver module on platform.architecture(), which asks file(1); with the GPU
    host's file(1) on PATH the prebuilt module missed and Triton compiled it (no Python.h)."""
    import importlib.util
    import os
    import shutil
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    shims = tmp_path / "bin"
    host.write_shims(str(shims))
    host.write_shims(str(shims))  # a second install keeps what the first wrote
    assert shutil.which("file", path=str(shims)) == str(shims / "file")
    assert os.readlink(shims / "python3") == host.IMAGE_PYTHON
    probe = "import platform, sys; print(platform.architecture(sys.executable)[1] or 'none')"
    env = {**os.environ, "PATH": f"{shims}:{os.environ.get('PATH', '')}"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "none"


def test_no_compilers_leaves_nothing_that_compiles_and_undoes_itself(tmp_path):
    """The replay's --no-compilers, as the second H100 session found it must be: Triton's ptxas
    answers --version with the real one's text (Triton keys every lookup on it), anything else
    fails; CUDA_HOME unset and nothing where unset resolves, as in the image; everything put
    back afterwards, byte for byte, also when a step fails."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    site = tmp_path / "site"
    triton_bin = site / "triton/backends/nvidia/bin"
    triton_bin.mkdir(parents=True)
    real = "#!/bin/sh\necho \"ptxas: NVIDIA (R) it's 'quoted'\"\necho 'Cuda compilation tools, release 13.0'\n"
    (triton_bin / "ptxas").write_text(real)
    (triton_bin / "ptxas").chmod(0o755)
    (triton_bin / "cuobjdump").write_text("#!/bin/sh\n")
    wheel_bin = site / "nvidia/cu13/bin"
    wheel_bin.mkdir(parents=True)
    (wheel_bin / "nvcc").write_text("#!/bin/sh\n")
    cuda = tmp_path / "usr-local-cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin/nvcc").write_text("#!/bin/sh\n")
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    expected_version = subprocess.run([str(triton_bin / "ptxas"), "--version"], capture_output=True, text=True).stdout

    env = {"PATH": "/usr/bin:/bin", "CUDA_HOME": "/usr/local/cuda", "CUDA_PATH": "/x", "TRITON_PTXAS_PATH": "/y"}
    done = host.hide_compilers(env, str(site), str(cuda))
    try:
        assert env["PATH"] == host.SHIM_DIR and not {"CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH"} & set(env)
        version = subprocess.run([str(triton_bin / "ptxas"), "--version"], capture_output=True, text=True)
        assert version.returncode == 0 and version.stdout == expected_version
        compile_ = subprocess.run([str(triton_bin / "ptxas"), "-arch=sm_90a", "k.ptx"], capture_output=True, text=True)
        assert compile_.returncode == 1 and "hidden by server_host --no-compilers" in compile_.stderr
        assert (triton_bin / "cuobjdump").exists()  # not a compiler, and Triton's key does not read it
        # Nothing where unset CUDA_HOME resolves, as in the image (SGLang keys on its existence).
        assert not (wheel_bin / "nvcc").exists() and not os.path.lexists(cuda)
    finally:
        host.restore_compilers(done)
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and not list(tmp_path.rglob("*" + host.HIDDEN))

    # A step that fails (here: a ptxas that cannot answer --version) leaves nothing moved.
    (triton_bin / "ptxas").write_text("#!/bin/sh\nexit 3\n")
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(subprocess.CalledProcessError):
        host.hide_compilers({}, str(site), str(cuda))
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and (cuda / "bin/nvcc").exists()
    assert os.access(triton_bin / "ptxas", os.X_OK)


def test_preflight_names_an_import_failure_and_a_jit_key_the_host_computes_otherwise(tmp_path, capsys):
    """Each replay try on the H100 cost a server start (about a minute) to learn one thing: an
    import that failed (SGLang logs its first line only) or a shipped SGLang JIT module whose key
    the host computed otherwise. preflight says both in seconds, under the image's python (here a
    stand-in: this interpreter, and a stand-in for the check worker)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    assert host.capability_of("sm90a") == (9, 0) and host.capability_of("sm120f") == (12, 0)
    shim = tmp_path / "opt/kimi-k3/bin"
    shim.mkdir(parents=True)
    (shim.parent / "image-env.json").write_text(json.dumps({"FROM_IMAGE": "1"}))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "p.json").write_text(json.dumps({"env": {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}}))
    jit = tmp_path / "sglang-jit"
    jit.mkdir()
    shipped = [{"call": "k.m:one", "args": [1], "leaf": "sm90a/one/build-aaa/deps-b"},
               {"call": "k.m:two", "args": [], "leaf": "sm90a/two/build-ccc/deps-d"}]
    (jit / "kimi-k3-sglang-jit.json").write_text(json.dumps(
        {"target": "sm90a", "environment_fingerprint": "f0", "modules": shipped}))
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys\n"
        "r = json.load(open(sys.argv[1]))\n"
        "assert r['mode'] == 'check' and r['capability'] == [9, 0], r\n"
        "assert os.environ['SGLANG_CRASH_ON_JIT_COMPILE'] == '1' and os.environ['SGLANG_ENABLE_JIT_DEEPGEMM'] == '0'\n"
        "assert os.environ['FROM_IMAGE'] == '1' and os.environ['SGLANG_JIT_CACHE_DIR'] == sys.argv[2]\n"
        "json.dump({'modules': [{'call': 'k.m:one'}], 'fingerprint': 'f0', 'target': 'sm90a', 'errors': [\n"
        "  {'call': 'k.m:two', 'args': [], 'error': 'RuntimeError: JIT module two has no usable cached build',\n"
        "   'scope': '/c/sm90a/two/build-eee'}]}, open(r['result'], 'w'))\n")
    host.IMAGE_PYTHON, host.SHIM_DIR, host.PROFILES_DIR, host.SGLANG_JIT_DIR = (
        sys.executable, str(shim), str(profiles), str(jit))
    args = host.main.__globals__["argparse"].Namespace(
        profile="p", imports=["json", "no_such_module_here"], env=[], no_compilers=False,
        worker=str(worker))
    # The stand-in worker is given the cache directory as its second argument to check it.
    real_run = host.subprocess.run

    def run(argv, **kw):
        if argv[:2] == [sys.executable, str(worker)]:
            argv = argv + [kw["env"]["SGLANG_JIT_CACHE_DIR"]]
        return real_run(argv, **kw)

    host.subprocess.run = run
    try:
        assert host.preflight(args) == 1
    finally:
        host.subprocess.run = real_run
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "import json: ok" in err
    assert "import no_such_module_here failed:" in err and "ModuleNotFoundError" in err
    assert ("k.m:two(): RuntimeError: JIT module two has no usable cached build (looked in "
            "/c/sm90a/two/build-eee; shipped: sm90a/two/build-ccc/deps-d)") in err
    assert "1 of 2 shipped SGLang JIT module(s) found; environment fingerprint f0 (shipped f0)" in err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
