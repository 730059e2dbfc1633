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


def _layer(tmp: Path, name: str, files: dict[str, bytes | str]) -> Path:
    """A built layer as the image's layer action leaves it (gzip here: zstd needs its CLI)."""
    blob = tmp / f"layer_{name}.tar.zst"
    with tarfile.open(blob, "w:gz") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            if isinstance(data, str):  # a symlink to this target
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
                continue
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
                                   f"{site}/nvidia/cu13/lib/libcublas.so.13": b"cublas from the wheel",
                                   "usr/local/cuda/include": "../lib/python3.11/dist-packages/nvidia/cu13/include"}),
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
    (root / "usr/local/cuda/bin").mkdir(parents=True)
    (root / "usr/local/cuda/bin/nvcc").write_bytes(b"host nvcc")
    proc = _install(tmp_path / "b", root)
    assert proc.returncode == 0, proc.stderr
    # The image's CUDA home waits beside the host's toolkit for --no-compilers to swap them.
    assert sorted(p.name for p in (root / "usr/local/cuda").iterdir()) == ["bin"]
    assert (root / "opt/kimi-k3/image-cuda-home/include").is_symlink()
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
    # The image's CUDA home as install keeps it: links, no bin/.
    image_cuda = tmp_path / "image-cuda-home"
    image_cuda.mkdir()
    (image_cuda / "include").symlink_to("../lib/python3.11/dist-packages/nvidia/cu13/include")
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    expected_version = subprocess.run([str(triton_bin / "ptxas"), "--version"], capture_output=True, text=True).stdout

    env = {"PATH": "/usr/bin:/bin", "CUDA_HOME": "/usr/local/cuda", "CUDA_PATH": "/x", "TRITON_PTXAS_PATH": "/y",
           "CXX": "/opt/gcc/bin/g++", "CC": "gcc"}
    done = host.hide_compilers(env, str(site), str(cuda), str(image_cuda))
    try:
        assert env == {"PATH": host.SHIM_DIR}
        version = subprocess.run([str(triton_bin / "ptxas"), "--version"], capture_output=True, text=True)
        assert version.returncode == 0 and version.stdout == expected_version
        compile_ = subprocess.run([str(triton_bin / "ptxas"), "-arch=sm_90a", "k.ptx"], capture_output=True, text=True)
        assert compile_.returncode == 1 and "hidden by server_host --no-compilers" in compile_.stderr
        assert (triton_bin / "cuobjdump").exists()  # not a compiler, and Triton's key does not read it
        # Where unset CUDA_HOME resolves, the image's CUDA home and no nvcc (SGLang keys on the
        # directory, DeepGEMM's import asserts it).
        assert not (wheel_bin / "nvcc").exists() and not (cuda / "bin").exists()
        assert os.readlink(cuda / "include") == "../lib/python3.11/dist-packages/nvidia/cu13/include"
        assert not image_cuda.exists()
    finally:
        host.restore_compilers(done)
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and not list(tmp_path.rglob("*" + host.HIDDEN))
    assert (image_cuda / "include").is_symlink() and (cuda / "bin/nvcc").exists()

    # A recording in the image's environment keeps Triton's ptxas alone.
    done = host.hide_compilers({}, str(site), str(cuda), str(image_cuda), keep_triton_ptxas=True)
    try:
        assert (triton_bin / "ptxas").read_text() == real and not (wheel_bin / "nvcc").exists()
        assert os.readlink(cuda / "include").endswith("nvidia/cu13/include")
    finally:
        host.restore_compilers(done)
    assert (cuda / "bin/nvcc").exists() and (image_cuda / "include").is_symlink()

    # A step that fails (here: a ptxas that cannot answer --version) leaves nothing moved.
    (triton_bin / "ptxas").write_text("#!/bin/sh\nexit 3\n")
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(subprocess.CalledProcessError):
        host.hide_compilers({}, str(site), str(cuda), str(image_cuda))
    after = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before and (cuda / "bin/nvcc").exists()
    assert os.access(triton_bin / "ptxas", os.X_OK)


def _server_host():
    import importlib.util
    spec = importlib.util.spec_from_file_location("server_host", HOST)
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    return host


def test_left_out_libraries_come_from_the_host_torch_or_are_copied_from_its_toolkit(tmp_path):
    """install puts each CUDA library the bundle left out at its image path: a link to the host
    torch's copy, else a copy of the host toolkit's, never a link into the toolkit, which
    --no-compilers moves away (the sixth H100 try: the model's modules stopped importing)."""
    host = _server_host()
    image_site = tmp_path / "image-site"
    host_site = tmp_path / "host-site"
    (host_site / "nvidia/cu13/lib").mkdir(parents=True)
    (host_site / "nvidia/cu13/lib/libcublas.so.13").write_bytes(b"cublas")
    toolkit_real = tmp_path / "cuda-13.0"
    (toolkit_real / "targets/x86_64-linux/lib").mkdir(parents=True)
    (toolkit_real / "targets/x86_64-linux/lib/libnvrtc.so.13").write_bytes(b"nvrtc")
    (toolkit_real / "targets/x86_64-linux/lib/libcufft.so.12").write_bytes(b"cufft")
    (toolkit_real / "lib64").symlink_to("targets/x86_64-linux/lib")
    toolkit = tmp_path / "cuda"
    toolkit.symlink_to(toolkit_real)
    # A host torch library that is itself a link into the toolkit.
    (host_site / "nvidia/cu13/lib/libcufft.so.12").symlink_to(toolkit / "lib64/libcufft.so.12")
    lib = host.SITE_PACKAGES.lstrip("/") + "/nvidia/cu13/lib/"
    from_host = {"cuBLAS": [lib + "libcublas.so.13"], "NVRTC": [lib + "libnvrtc.so.13"],
                 "cuFFT": [lib + "libcufft.so.12"], "cuRAND": [lib + "libcurand.so.10"]}
    linked, copied, missing = host.provide_host_libraries(from_host, str(image_site), str(host_site), str(toolkit))
    assert linked == ["nvidia/cu13/lib/libcublas.so.13"]
    assert sorted(copied) == ["nvidia/cu13/lib/libcufft.so.12", "nvidia/cu13/lib/libnvrtc.so.13"]
    assert missing == ["nvidia/cu13/lib/libcurand.so.10"]
    out = image_site / "nvidia/cu13/lib"
    assert (out / "libcublas.so.13").is_symlink()
    toolkit.unlink()  # what --no-compilers does for the server's run
    assert (out / "libnvrtc.so.13").read_bytes() == b"nvrtc" and not (out / "libnvrtc.so.13").is_symlink()
    assert (out / "libcufft.so.12").read_bytes() == b"cufft" and not (out / "libcufft.so.12").is_symlink()
    assert (out / "libcublas.so.13").read_bytes() == b"cublas"
    assert not list(out.glob("*.tmp"))


def test_the_server_env_as_the_image_keeps_only_what_a_container_runtime_gives(tmp_path, monkeypatch):
    """--no-compilers runs the server as the image would: of the host's environment only what a
    container runtime sets (the GPUs, HOME, the locale), then the image's env and the profile's.
    A host's CXX (the second H100 session's: /opt/gcc/bin/g++) goes into every SGLang JIT key."""
    host = _server_host()
    shim = tmp_path / "opt/kimi-k3/bin"
    shim.mkdir(parents=True)
    (shim.parent / "image-env.json").write_text(json.dumps({"LD_LIBRARY_PATH": "/image/lib"}))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "p.json").write_text(json.dumps({"env": {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}}))
    host.SHIM_DIR, host.PROFILES_DIR = str(shim), str(profiles)
    for name, value in {"CXX": "/opt/gcc/bin/g++", "CPATH": "/opt/include", "PYTHONPATH": "/x", "HOME": "/root",
                        "NVIDIA_VISIBLE_DEVICES": "all", "PATH": "/usr/bin"}.items():
        monkeypatch.setenv(name, value)
    env = host.server_env(["EXTRA=1"], "p", as_image=True)
    assert env == {"HOME": "/root", "NVIDIA_VISIBLE_DEVICES": "all", "LD_LIBRARY_PATH": "/image/lib",
                   "SGLANG_ENABLE_JIT_DEEPGEMM": "0", "EXTRA": "1", "PATH": str(shim)} | {
        k: v for k, v in env.items() if k.startswith("LC_") or k in ("LANG", "TERM", "TZ", "USER", "HOSTNAME")}
    loose = host.server_env([], None)
    assert loose["CXX"] == "/opt/gcc/bin/g++" and loose["PATH"] == f"{shim}:/usr/bin" and "PYTHONPATH" not in loose


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
        worker=str(worker), ldd=["lib/*.so"])
    site = tmp_path / "site"
    (site / "lib").mkdir(parents=True)
    (site / "lib/libops.so").write_bytes(b"")
    host.SITE_PACKAGES = str(site)
    # ldd is the host's; a stand-in on the server's PATH says what it would of a missing library.
    (shim / "ldd").write_text("#!/bin/sh\ncase \"$LD_LIBRARY_PATH\" in */torch/lib*) ;; *) printf '\\tlibtorch.so => not found\\n';; esac\n"
                              "printf '\\tlibcuda.so.1 => /usr/lib/libcuda.so.1\\n"
                              "\\tlibnvrtc.so.13 => not found\\n'\n")
    (shim / "ldd").chmod(0o755)
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
    assert f"preflight: {site}/lib/libops.so: libnvrtc.so.13 => not found" in err and "libcuda" not in err
    assert "libtorch.so" not in err  # torch's own libraries come with torch's import
    assert "import no_such_module_here failed:" in err and "ModuleNotFoundError" in err
    assert ("k.m:two(): RuntimeError: JIT module two has no usable cached build (looked in "
            "/c/sm90a/two/build-eee; shipped: sm90a/two/build-ccc/deps-d)") in err
    assert "1 of 2 shipped SGLang JIT module(s) found; environment fingerprint f0 (shipped f0)" in err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
