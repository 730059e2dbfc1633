"""The GPU host's side of the real-server proof (issue #38): install the image's root from a
server bundle (tools/gpu_suite/server_bundle.py) at the image's own paths, then start the
image's entrypoint with a launch profile, run the workload against it, and stop it.

    python3 server_host.py install --bundle DIR
    python3 server_host.py serve --profile NAME --mode record|verify|plain --out DIR \
        --workload FILE --model DIR [--port 30000] [--timeout 540] [--no-compilers]

Standard library only: it runs under the GPU host's own python3 before the image's Python is
installed, and imports nothing of tools/ (the bundle carries this file alone).

install: checks every part and the whole stream against manifest.json, unpacks the stream at /
(the image's own trees always: /usr/bin/python3.11, its standard library, the site-packages, the
entrypoint, /usr/share/kimi-k3; any other path only where the host has none, so the host's glibc,
shell and python3 stay its own), links each CUDA library the bundle left to the host (manifest
`from_host`) to the host torch's copy of it (or copies the host CUDA toolkit's), links the driver's libcuda.so.1 where the image's
TRITON_LIBCUDA_PATH says, and makes /opt/kimi-k3/bin/python3 the image's python3.11 (the
entrypoint execs `python3`).

preflight (before serve, seconds): under the image's python with the server's environment,
the native libraries' dependencies resolved (`ldd`, --ldd), the model's modules imported
(--import) and every shipped SGLang JIT module looked up by SGLang's own loader: what would fail
the server is named before it starts.

serve: the entrypoint with `--profile NAME`, the image's env (manifest `env`) and the profile's,
MODEL_PATH and PORT set; `--mode record` starts it with `--record-first-use OUT/records`, `--mode verify`
adds `--verify-first-use` (a compile after ready fails the server). Then the workload (tools/jit_cache/workload.py), then SIGTERM to the server's process
group. `--no-compilers` (hide_compilers, undone when the server stops): PATH holds only the
image's python3, CUDA_HOME is unset as in the image, the host's /usr/local/cuda is moved away
for the run and the image's CUDA home (headers and libraries, no nvcc) put in its place, the CUDA wheels' tools are moved out of the installed tree, and Triton's
ptxas answers `--version` only (Triton keys every cache lookup on it): nothing can compile. OUT gets server.log, workload.json
(timings), the records and summary.json (exit codes, seconds to ready, the counts).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time

MANIFEST = "manifest.json"
SHIM_DIR = "/opt/kimi-k3/bin"
IMAGE_PYTHON = "/usr/bin/python3.11"
ENTRYPOINT = "/usr/local/bin/kimi-k3-entrypoint"
SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"
# What the image owns on the host: always written. Any other path of the bundle (Debian's glibc,
# bash, OpenSSL, ...) is written only where the host has nothing: the host's own system stays
# whole (its python3 runs this tool and the workload), and the image's python3.11 runs on the
# host's libraries where both have one (the host's glibc is the newer; glibc keeps old symbols).
IMAGE_OWNED = ("usr/lib/python3.11/", "usr/local/lib/python3.11/", "usr/share/kimi-k3/", "opt/kimi-k3/")
IMAGE_OWNED_FILES = ("usr/bin/python3.11", "usr/local/bin/kimi-k3-entrypoint")
# The image's CUDA home (/usr/local/cuda: links to the CUDA wheels' headers and libraries, no
# nvcc; tools/common/cuda_home.py says why the image has one). A GPU host has its own toolkit
# there, so install keeps the image's here, and --no-compilers puts it in the toolkit's place.
IMAGE_CUDA_HOME = "usr/local/cuda"
IMAGE_CUDA_STASH = "opt/kimi-k3/image-cuda-home"
# Triton compiles its driver module (cuda_utils) at its first launch unless its cache holds it, and
# the image has no Python.h to compile it with: it ships the module in its Triton tree.
TRITON_DIR = "usr/share/kimi-k3/triton"
PYTHON_HEADER = "usr/include/python3.11/Python.h"


def triton_driver_problem(root: str = "/") -> str | None:
    """One line when a server on this root could not start Triton: no driver module shipped in the
    image's Triton tree and no Python.h to build one (a bundle made without the Triton layer)."""
    if glob.glob(os.path.join(root, TRITON_DIR, "*", "cuda_utils*.so")):
        return None
    if os.path.exists(os.path.join(root, PYTHON_HEADER)):
        return None
    return (f"{os.path.join(root, TRITON_DIR)} holds no Triton driver module (cuda_utils) and the image has no "
            "Python.h to build one: the server would fail at its first Triton launch. Make the bundle with "
            f"--tree /{TRITON_DIR}=bazel-bin/jit_cache/triton_driver_12_0 (any arch: the module is the driver's)")


def log(message: str) -> None:
    print(f"[server_host] {message}", flush=True)


class _Parts:
    """The bundle's parts read as one stream (checked by check_parts first)."""

    def __init__(self, bundle: str, parts: list[dict]) -> None:
        self.bundle, self.parts = bundle, list(parts)
        self._file = None

    def read(self, size: int = -1) -> bytes:
        while True:
            if self._file is None:
                if not self.parts:
                    return b""
                self._file = open(os.path.join(self.bundle, self.parts.pop(0)["file"]), "rb")
            data = self._file.read(size if size and size > 0 else 1 << 20)
            if data:
                return data
            self._file.close()
            self._file = None


def check_parts(bundle: str, manifest: dict) -> None:
    """Every part's sha256 and the whole stream's, before anything is unpacked: a part carried
    wrong leaves no half tree."""
    whole = hashlib.sha256()
    for part in manifest["parts"]:
        path = os.path.join(bundle, part["file"])
        if not os.path.isfile(path):
            raise SystemExit(f"error: {path}: missing; carry every part of the bundle first")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                whole.update(block)
        if digest.hexdigest() != part["sha256"]:
            raise SystemExit(f"error: {part['file']}: sha256 differs from manifest.json; carry it again")
    if whole.hexdigest() != manifest["sha256"]:
        raise SystemExit("error: the bundle's stream sha256 differs from manifest.json; write the bundle again")


def host_site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def install(bundle: str, root: str = "/") -> int:
    with open(os.path.join(bundle, MANIFEST)) as f:
        manifest = json.load(f)
    started = time.time()
    check_parts(bundle, manifest)
    stream = _Parts(bundle, manifest["parts"])
    count = kept = 0
    with tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            if member.name.startswith(("/", "..")) or "/../" in member.name:
                raise SystemExit(f"error: bundle member {member.name!r} is outside the image's root")
            name = member.name.lstrip("./")
            if name == IMAGE_CUDA_HOME or name.startswith(IMAGE_CUDA_HOME + "/"):
                # Relative link targets hold once the directory is moved to /usr/local/cuda.
                name = member.name = IMAGE_CUDA_STASH + name[len(IMAGE_CUDA_HOME):]
            owned = name.startswith(IMAGE_OWNED) or name in IMAGE_OWNED_FILES
            if not owned and os.path.lexists(os.path.join(root, name)):
                kept += 1  # the host's own file (or directory) stays
                continue
            tar.extract(member, root, set_attrs=member.isreg() or member.isdir(), filter="fully_trusted")
            count += 1
    log(f"kept {kept} of the host's own paths the bundle also has (outside the image's own trees)")
    log(f"unpacked {count} members of image {(manifest['image'] or 'not assembled')[:19]} in {time.time() - started:.0f}s")
    if root != "/" or manifest.get("overlay"):
        # A trial unpack elsewhere (tests), or an overlay of trees over an installed bundle
        # (server_bundle --trees-only): the links and the env below are the full bundle's.
        return 0
    linked, copied, missing = provide_host_libraries(manifest["from_host"], SITE_PACKAGES, host_site_packages())
    log(f"CUDA libraries the bundle left to the host: {len(linked)} linked to the host torch's, {len(copied)} copied "
        f"from its CUDA toolkit (which --no-compilers moves away); missing on the host: {missing or 'none'}")
    env = dict(e.split("=", 1) for e in manifest["env"])
    libcuda_dir = env.get("TRITON_LIBCUDA_PATH", "/usr/lib/x86_64-linux-gnu")
    if not os.path.exists(os.path.join(libcuda_dir, "libcuda.so.1")):
        found = sorted(glob.glob("/usr/local/nvidia/lib64/libcuda.so.1") + glob.glob("/usr/lib*/**/libcuda.so.1", recursive=True))
        if found:
            os.makedirs(libcuda_dir, exist_ok=True)
            os.symlink(found[0], os.path.join(libcuda_dir, "libcuda.so.1"))
            log(f"linked {libcuda_dir}/libcuda.so.1 -> {found[0]}")
    write_shims(SHIM_DIR)
    with open(os.path.join(SHIM_DIR, "..", "image-env.json"), "w") as f:
        json.dump(env, f)
    return 0


def provide_host_libraries(from_host: dict[str, list[str]], image_site: str, host_site: str,
                           toolkit: str = "/usr/local/cuda") -> tuple[list[str], list[str], list[str]]:
    """Put each CUDA library the bundle left out (manifest `from_host`, image paths) at its image
    path: a link to the host torch's copy where its site-packages has one, else a copy of the host
    CUDA toolkit's (lib64, targets/*/lib). A toolkit library is copied, not linked, and a host
    library that resolves into the toolkit too: `--no-compilers` moves the toolkit away for the
    server's run, and a link into it would dangle then (the H100 replay's sixth try: the model's
    modules stopped importing once /usr/local/cuda was gone). Returns (linked, copied, missing),
    image-site-relative paths."""
    toolkit_real = os.path.realpath(toolkit) if os.path.exists(toolkit) else None
    toolkit_dirs = []
    if toolkit_real:
        toolkit_dirs = [os.path.join(toolkit_real, "lib64")] + sorted(glob.glob(os.path.join(toolkit_real, "targets", "*", "lib")))
    linked: list[str] = []
    copied: list[str] = []
    missing: list[str] = []
    for paths in from_host.values():
        for path in paths:
            rel = os.path.relpath("/" + path.lstrip("/"), SITE_PACKAGES)
            dest = os.path.join(image_site, rel)
            name = os.path.basename(rel)
            stem = name.split(".so")[0]
            candidates = [os.path.join(host_site, rel)]
            candidates += sorted(glob.glob(os.path.join(host_site, "nvidia", "**", stem + ".so*"), recursive=True))
            source = next((c for c in candidates if os.path.exists(c)), None)
            in_toolkit = False
            if source is None:
                source = next((os.path.join(d, name) for d in toolkit_dirs if os.path.exists(os.path.join(d, name))), None)
                in_toolkit = source is not None
            elif toolkit_real and os.path.realpath(source).startswith(toolkit_real + os.sep):
                in_toolkit = True
            if source is None:
                missing.append(rel)
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.path.lexists(dest):
                os.unlink(dest)
            if in_toolkit:
                shutil.copy2(os.path.realpath(source), dest + ".tmp")
                os.replace(dest + ".tmp", dest)
                copied.append(rel)
            else:
                os.symlink(source, dest)
                linked.append(rel)
    return linked, copied, missing


def write_shims(shim_dir: str) -> None:
    """The directory put first on the server's PATH: the image's python under its usual names, and
    a `file` that fails as the image's missing file(1) does. Triton keys its driver module on
    platform.architecture(), which asks file(1) about the interpreter: a host's file(1) adds "ELF"
    to the key, the prebuilt module misses, and Triton compiles it with a C compiler the image lacks
    (seen on the first H100 record run that shipped the module)."""
    os.makedirs(shim_dir, exist_ok=True)
    for name in ("python3", "python3.11", "python"):
        link = os.path.join(shim_dir, name)
        if not os.path.lexists(link):
            os.symlink(IMAGE_PYTHON, link)
    no_file = os.path.join(shim_dir, "file")
    with open(no_file + ".tmp", "w") as f:
        f.write("#!/bin/sh\n# the image has no file(1): see tools/gpu_suite/server_host.py write_shims\nexit 1\n")
    os.chmod(no_file + ".tmp", 0o755)
    os.replace(no_file + ".tmp", no_file)


HIDDEN = ".hidden-by-server-host"
PROFILES_DIR = "/usr/share/kimi-k3/profiles"
SGLANG_JIT_DIR = "/usr/share/kimi-k3/sglang-jit"
SGLANG_JIT_MANIFEST = "kimi-k3-sglang-jit.json"
# Where SGLang's JIT (and DeepGEMM, FlashInfer) look for the CUDA toolkit when CUDA_HOME is unset,
# as it is in the image: the GPU host's own toolkit lives there.
HOST_CUDA = "/usr/local/cuda"


def hide_compilers(env: dict[str, str], site_packages: str = SITE_PACKAGES,
                   cuda_root: str = HOST_CUDA,
                   image_cuda: str = "/" + IMAGE_CUDA_STASH,
                   keep_triton_ptxas: bool = False) -> list[tuple[str, str | None]]:
    """Make nvcc, ptxas and cc unusable for the server, and return what restore_compilers undoes
    ((path, where it was moved) or (path, None) for what this wrote), in order:

    - PATH is the image python's shim directory alone; CUDA_HOME and CUDA_PATH are unset, as in
      the image. SGLang's JIT build file names the toolkit's path (`-L<cuda>/lib64`), so any
      CUDA_HOME other than where the image resolves it (/usr/local/cuda) keys every module anew.
      CC, CXX and CUDAHOSTCXX are unset too: SGLang fingerprints `$CXX --version`.
    - The host's toolkit at /usr/local/cuda (where unset CUDA_HOME resolves) is moved aside, and
      the image's CUDA home (install keeps it at IMAGE_CUDA_STASH) takes its place: SGLang keys
      its JIT modules on that directory (its `toolkit` anchor: an empty directory there gave
      every module another key than the image build's), and DeepGEMM's import asserts one (with
      nothing there, SGLang's Kimi-K3 model module did not import on an H100).
    - Triton's own ptxas cannot simply go: Triton 3.8 runs `ptxas --version` for every cache key,
      a hit included (backend.hash), so without it every lookup fails ("Cannot find ptxas"). It
      becomes a shim that prints the real one's --version text, byte for byte (the keys stay the
      image's), and fails anything else: nothing can be assembled.
    - The CUDA wheels' tools (nvidia/cu13/bin) are moved out of the installed tree.
    `keep_triton_ptxas` (serve --keep-triton-ptxas, for a recording run): Triton's own ptxas
    stays, so a kernel the shipped cache lacks compiles and is recorded in the image's
    environment; everything else is hidden as above.
    On any error, what was done so far is undone before the error propagates."""
    done: list[tuple[str, str | None]] = []
    try:
        ptxas_found = [] if keep_triton_ptxas else glob.glob(os.path.join(site_packages, "triton/backends/nvidia/bin/ptxas*"))
        for ptxas in sorted(ptxas_found):
            if ptxas.endswith(HIDDEN):
                continue
            version = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
            os.replace(ptxas, ptxas + HIDDEN)
            done.append((ptxas, ptxas + HIDDEN))
            with open(ptxas, "w") as f:
                f.write("#!/bin/sh\n# server_host --no-compilers: Triton keys its cache on `ptxas --version`; "
                        "nothing may be assembled\n"
                        'if [ "$#" -eq 1 ] && [ "$1" = --version ]; then\n'
                        f"  printf '%s' '{version.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}'\n"
                        "  exit 0\nfi\n"
                        'echo "ptxas: hidden by server_host --no-compilers (a compile after ready)" >&2\nexit 1\n')
            os.chmod(ptxas, 0o755)
            done.append((ptxas, None))
        for tool in sorted(glob.glob(os.path.join(site_packages, "nvidia/cu13/bin/*"))):
            if not tool.endswith(HIDDEN):
                os.replace(tool, tool + HIDDEN)
                done.append((tool, tool + HIDDEN))
        if os.path.lexists(cuda_root):
            os.replace(cuda_root, cuda_root + HIDDEN)
            done.append((cuda_root, cuda_root + HIDDEN))
        if not os.path.isdir(image_cuda):
            raise SystemExit(f"error: {image_cuda}: the image's CUDA home is not installed; install a bundle "
                             "made from an image whose torch layer holds /usr/local/cuda")
        os.replace(image_cuda, cuda_root)
        done.append((image_cuda, cuda_root))
        env["PATH"] = SHIM_DIR
        for name in ("CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH", "CC", "CXX", "CUDAHOSTCXX"):
            env.pop(name, None)
        for tool in ("nvcc", "ptxas", "cc", "gcc", "c++", "g++"):
            if shutil.which(tool, path=env["PATH"]):
                raise SystemExit(f"error: {tool} is still reachable on PATH={env['PATH']}")
    except BaseException:
        restore_compilers(done)
        raise
    return done


def restore_compilers(done: list[tuple[str, str | None]]) -> None:
    """Undo hide_compilers, last step first: remove what it wrote, move back what it moved."""
    for path, hidden in reversed(done):
        if hidden is None:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.remove(path)
        else:
            os.replace(hidden, path)


# What a container of the image gets from its runtime rather than from the image: kept from the
# host's environment where the server runs as the image would (--no-compilers).
HOST_ENV_KEPT = ("HOME", "HOSTNAME", "LANG", "TERM", "TZ", "USER", "CUDA_VISIBLE_DEVICES")
HOST_ENV_KEPT_PREFIXES = ("LC_", "NVIDIA_")


def server_env(extra: list[str], profile: str | None = None, as_image: bool = False) -> dict[str, str]:
    """The server's environment: this host's, less its Python settings, with the image's env
    (manifest `env`), the profile's `env` when one is named (what the entrypoint adds), then
    --env NAME=VALUE; the image python's shim directory first on PATH. `as_image`
    (--no-compilers): of the host's, only what a container runtime gives (HOST_ENV_KEPT). A
    host's CXX, say, goes into every SGLang JIT key (its host compiler's `--version`); the
    second H100 session's preflight found the host's CXX=/opt/gcc/bin/g++ there."""
    with open(os.path.join(SHIM_DIR, "..", "image-env.json")) as f:
        image_env = json.load(f)
    env = dict(os.environ)
    if as_image:
        env = {k: v for k, v in env.items() if k in HOST_ENV_KEPT or k.startswith(HOST_ENV_KEPT_PREFIXES)}
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(image_env)
    if profile:
        with open(os.path.join(PROFILES_DIR, profile + ".json")) as f:
            env.update(json.load(f).get("env", {}))
    env["PATH"] = ":".join([SHIM_DIR] + ([env["PATH"]] if env.get("PATH") else []))
    for item in extra:
        name, _, value = item.partition("=")
        env[name] = value
    return env


# The native libraries whose load failures the replay met or would meet first: sgl_kernel's ops
# (NEEDED: cuBLAS, NVRTC, the runtime and libcuda, found through LD_LIBRARY_PATH alone: no
# RUNPATH) and torch's CUDA library.
LDD_DEFAULT = ("sgl_kernel/sm90/common_ops*.so", "sgl_kernel/sm100/common_ops*.so", "torch/lib/libtorch_cuda.so")


def unresolved_libraries(patterns: list[str], env: dict[str, str], site_packages: str | None = None) -> list[str]:
    """`ldd` of each library matching the patterns (site-packages-relative) under the server's
    environment: one line per dependency the dynamic loader would not find, naming both."""
    site_packages = site_packages or SITE_PACKAGES
    # The host's ldd: --no-compilers leaves only the image python's shims on the server's PATH.
    ldd = shutil.which("ldd", path=env.get("PATH")) or shutil.which("ldd") or "ldd"
    # torch is imported before any of these loads, and its libraries (libtorch.so, libc10.so)
    # come from that load, not from the search path: ldd is told where they are (the first
    # replay's preflight flagged them as missing).
    torch_lib = os.path.join(site_packages, "torch", "lib")
    env = {**env, "LD_LIBRARY_PATH": ":".join(p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)}
    problems = []
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(site_packages, pattern)))
        if not found:
            problems.append(f"{pattern}: no such library under {site_packages}")
        for path in found:
            done = subprocess.run([ldd, path], env=env, capture_output=True, text=True)
            for line in done.stdout.splitlines():
                if "not found" in line:
                    problems.append(f"{path}: {line.strip()}")
            if done.returncode != 0 and not done.stdout:
                problems.append(f"{path}: ldd failed: {done.stderr.strip()}")
    return problems


def capability_of(target: str) -> tuple[int, int]:
    """SGLang's target tag (sm90a, sm120f) as a compute capability: (9, 0), (12, 0)."""
    digits = target[2:].rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def preflight(args: argparse.Namespace) -> int:
    """Seconds, not a server start (each try of the H100 replay cost a minute): under the image's
    python with the server's environment (and --no-compilers' hiding), (1) import each --import
    module, printing the whole error (SGLang's model loader logs only its first line), and (2)
    look up every shipped SGLang JIT module with SGLang's own loader and
    SGLANG_CRASH_ON_JIT_COMPILE=1 (tools/jit_cache/sglang_worker.py's check): a module whose key
    this host computes differently is named with the scope it looked in and the leaf shipped."""
    env = server_env(args.env, args.profile, as_image=args.no_compilers)
    hidden = hide_compilers(env) if args.no_compilers else []
    failed = 0
    try:
        for problem in unresolved_libraries(args.ldd or list(LDD_DEFAULT), env):
            failed += 1
            print(f"server_host: preflight: {problem}", file=sys.stderr)
        for module in args.imports:
            done = subprocess.run([IMAGE_PYTHON, "-c", f"import {module}"], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                failed += 1
                print(f"server_host: preflight: import {module} failed:\n{done.stderr.strip()}", file=sys.stderr)
            else:
                log(f"preflight: import {module}: ok")
        with open(os.path.join(SGLANG_JIT_DIR, SGLANG_JIT_MANIFEST)) as f:
            shipped = json.load(f)
        major, minor = capability_of(shipped["target"])
        with tempfile.TemporaryDirectory(prefix="server-host-preflight-") as tmp:
            request = {"mode": "check", "capability": [major, minor], "device_name": "preflight",
                       "modules": [{"call": m["call"], "args": m["args"]} for m in shipped["modules"]],
                       "result": os.path.join(tmp, "result.json")}
            with open(os.path.join(tmp, "request.json"), "w") as f:
                json.dump(request, f)
            done = subprocess.run([IMAGE_PYTHON, args.worker, os.path.join(tmp, "request.json")],
                                  env={**env, "SGLANG_JIT_CACHE_DIR": SGLANG_JIT_DIR, "SGLANG_CRASH_ON_JIT_COMPILE": "1"},
                                  capture_output=True, text=True)
            if done.returncode != 0 or not os.path.exists(request["result"]):
                print(f"server_host: preflight: the SGLang JIT check did not run:\n{done.stderr.strip()[-4000:]}",
                      file=sys.stderr)
                return 1
            with open(request["result"]) as f:
                result = json.load(f)
        leaves = {m["call"] + json.dumps(m["args"]): m["leaf"] for m in shipped["modules"]}
        for error in result.get("errors", []):
            failed += 1
            print(f"server_host: preflight: {error['call']}{tuple(error['args'])}: {error['error']} (looked in "
                  f"{error.get('scope')}; shipped: {leaves.get(error['call'] + json.dumps(error['args']))})",
                  file=sys.stderr)
        log(f"preflight: {len(result.get('modules', []))} of {len(shipped['modules'])} shipped SGLang JIT module(s) "
            f"found; environment fingerprint {result.get('fingerprint')} (shipped "
            f"{shipped.get('environment_fingerprint')}), target {result.get('target')}")
        if result.get("fatal"):
            failed += 1
            print(f"server_host: preflight: {result['fatal']}", file=sys.stderr)
    finally:
        restore_compilers(hidden)
    return 1 if failed else 0


def wait_for_workload(server: subprocess.Popen, workload: subprocess.Popen, limit: float) -> str | None:
    """Wait for the workload; None when it finished. A server that exits first (before ready, or
    during the workload) ends the workload at once, as does `limit` seconds: the workload would
    otherwise poll a closed port until its --wait-ready ran out, GPU time for nothing."""
    deadline = time.time() + limit
    while workload.poll() is None:
        if server.poll() is not None or time.time() > deadline:
            workload.terminate()
            try:
                workload.wait(timeout=10)
            except subprocess.TimeoutExpired:
                workload.kill()
                workload.wait()
            return (f"the server exited ({server.returncode}) before the workload finished" if server.poll() is not None
                    else f"the workload ran past {limit:.0f} s")
        time.sleep(0.5)
    return None


def serve(args: argparse.Namespace) -> int:
    problem = triton_driver_problem()
    if problem:
        print(f"server_host: error: {problem}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    env = server_env(args.env, as_image=args.no_compilers)
    env.update(MODEL_PATH=os.path.abspath(args.model), PORT=str(args.port), PYTHONUNBUFFERED="1")
    records = os.path.join(out, "records")
    flags: list[str] = []
    if args.mode in ("record", "verify"):
        flags += ["--record-first-use", records]
    if args.mode == "verify":
        flags += ["--verify-first-use"]
    if args.hooks and flags:
        # A recorder from this checkout instead of the image's layer first_use (an image built
        # before it): the same environment the entrypoint's flags set.
        env["PYTHONPATH"] = os.path.abspath(args.hooks)
        os.makedirs(records, exist_ok=True)
        env["KIMI_K3_FIRST_USE_RECORD"] = records
        if args.mode == "verify":
            env["KIMI_K3_FIRST_USE_VERIFY"] = "1"
        flags = []
    if args.keep_triton_ptxas and not (args.no_compilers and args.mode == "record"):
        print("server_host: error: --keep-triton-ptxas: only with --mode record --no-compilers (a recording in the "
              "image's environment); the replay hides every compiler", file=sys.stderr)
        return 2
    hidden = hide_compilers(env, keep_triton_ptxas=args.keep_triton_ptxas) if args.no_compilers else []
    if hidden:
        log(f"compilers hidden: PATH={env['PATH']}, CUDA_HOME unset, the host's {HOST_CUDA} moved away and the "
            f"image's in its place, Triton's ptxas answers "
            f"--version only ({len(hidden)} steps to undo)")
    try:
        return run_server(args, env, flags, out, hidden)
    finally:
        restore_compilers(hidden)


def run_server(args: argparse.Namespace, env: dict[str, str], flags: list[str], out: str,
               hidden: list[tuple[str, str | None]]) -> int:
    command = [IMAGE_PYTHON, ENTRYPOINT, *flags, "--profile", args.profile]
    log("+ " + " ".join(command))
    started = time.time()
    with open(os.path.join(out, "server.log"), "w") as server_log:
        server = subprocess.Popen(command, env=env, stdout=server_log, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=out)
        workload = subprocess.Popen(
            [sys.executable, args.workload_runner, "--workload", args.workload, "--url", f"http://127.0.0.1:{args.port}",
             "--wait-ready", str(args.timeout), "--out", os.path.join(out, "workload.json")])
        ended = wait_for_workload(server, workload, args.timeout + 120)
        if ended:
            log(ended)
        server_code = server.poll()
        if server_code is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server_code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server_code = server.wait()
            stopped_by_us = True
        else:
            stopped_by_us = False
    summary = {"mode": args.mode, "profile": args.profile, "workload_exit": workload.returncode,
               "server_exit": server_code, "server_stopped_by_us": stopped_by_us,
               "seconds": round(time.time() - started, 1), "compilers_hidden": bool(hidden)}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(json.dumps(summary))
    return 0 if workload.returncode == 0 and stopped_by_us else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="server_host.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install")
    p.add_argument("--bundle", required=True)
    p.add_argument("--root", default="/", help="where to unpack (a trial elsewhere links nothing)")
    p = sub.add_parser("serve")
    p.add_argument("--profile", required=True)
    p.add_argument("--mode", choices=("record", "verify", "plain"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--workload-runner",
                   default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jit_cache", "workload.py"))
    p.add_argument("--hooks", help="a recorder's site directory (tools/jit_cache/first_use_site) to use instead of "
                   "the image's; default: the entrypoint's --record-first-use / --verify-first-use")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--timeout", type=int, default=540)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--no-compilers", action="store_true")
    p.add_argument("--keep-triton-ptxas", action="store_true",
                   help="with --mode record --no-compilers: record in the image's environment, Triton's ptxas left "
                   "usable so a kernel the shipped cache lacks compiles and is recorded")
    p = sub.add_parser("preflight", help="before serve: the model's imports and the shipped SGLang JIT keys, in seconds")
    p.add_argument("--profile", required=True)
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    p.add_argument("--ldd", action="append", default=[], metavar="GLOB",
                   help="site-packages-relative libraries whose dependencies must resolve (default: sgl_kernel's "
                   "common_ops, torch's libtorch_cuda)")
    p.add_argument("--worker", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jit_cache",
                                                   "sglang_worker.py"))
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--no-compilers", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "install":
        return install(args.bundle, args.root)
    return serve(args) if args.command == "serve" else preflight(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
