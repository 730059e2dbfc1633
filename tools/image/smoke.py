"""Smoke-test an OCI image layout without a container runtime.

Usage:
    python3 -m tools.image.smoke --layout DIR [--profile kimi-k3] [--import MOD]... \
        [--manifest GATE_MANIFEST.json]... [--require IMAGE_PATH]... [--forbid IMAGE_PATH]... \
        [--env K=V]... [--workdir DIR] [--keep-rootfs] [--driver-stub] [--launch-profile NAME]... \
        [--launch-profiles-dir DIR] [--kernel-cache-plan PLAN.bzl]

1. `umoci unpack` applies the layers (whiteouts, links, owners) into a rootfs, as a runtime would.
2. Every file a patch gate manifest lists (changed_files[].path relative to site-packages,
   sha256_after; `files` also accepted)
   must have that hash in the rootfs: the image ships the patched bytes, not upstream's.
3. --require / --forbid paths must exist / be absent (e.g. the SM120 kernel cache must exist;
   an official flashinfer_jit_cache must not, since FlashInfer would load its unpatched kernels).
4. In a chroot of the rootfs (own mount namespace, /proc mounted), `/usr/bin/python3` imports
   each module with only the image's environment plus --env.

5. Launch profiles (--launch-profile NAME, or every profile the image ships with --profile
   kimi-k3): tools/image/profiles.py runs tools/image/profile_probe.py in the chroot, without
   network: the image's entrypoint resolves the profile and its guard must accept it, the
   image's SGLang parses and resolves it (no GPU, no checkpoint: the steps it skips are listed),
   and every FlashInfer module and feature its backends need must be in the image. One line per
   profile; a failure names the profile and the argument. --launch-profiles-dir checks other
   profile files against the image (default: the ones it ships); --kernel-cache-plan takes the
   module list from a plan for an image assembled without its kernel-cache layer.

--profile kimi-k3 = imports flashinfer, sglang, mooncake.engine; FLASHINFER_DISABLE_JIT=1; requires
flashinfer/data/aot in site-packages; forbids flashinfer_jit_cache; checks every shipped launch
profile and Triton's first launch (check_triton_driver: its driver module from the image's
Triton cache, no build). Needs root (chroot).

--driver-stub: on hosts without the NVIDIA driver (build machines), mooncake.engine cannot load
libcuda.so.1, which the container runtime injects on GPU hosts. This builds a stand-in
libcuda.so.1 defining the driver symbols (cu*) that the image's libraries needing it import
(they fail with CUDA_ERROR_NO_DEVICE) and puts it on LD_LIBRARY_PATH in the unpacked copy only,
never in the image, so the imports are checked anyway; the report says so.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.hashing import sha256_file
from tools.image import profile_probe, profiles
from tools.image.layout import blob_path, config_env, read_index_manifest
from tools.image.wheel_install import SITE_PACKAGES
from tools.jit_cache.inventory import read_inventory

# launch_profiles: "*" = every launch profile the image ships.
PROFILES: dict[str, dict[str, list[str]]] = {
    "kimi-k3": {
        "imports": ["flashinfer", "sglang", "mooncake.engine"],
        "env": ["FLASHINFER_DISABLE_JIT=1"],
        "require": [f"/{SITE_PACKAGES}/flashinfer/data/aot",
                    f"{profiles.SGLANG_JIT_IMAGE_PATH}/{profiles.SGLANG_JIT_MANIFEST}"],
        "forbid": [f"/{SITE_PACKAGES}/flashinfer_jit_cache"],
        "launch_profiles": ["*"],
        "triton_driver": True,
    },
}

# Runs inside the chroot with the image's python3; builtins and sys only, so a tiny test image
# needs no more stdlib than what it tests. One line per module: MARK, name, ok, detail.
_MARK = "kimi-k3-smoke"
_IMPORT_SCRIPT = r"""
import sys
for name in sys.argv[1:]:
    try:
        __import__(name)
        ok, detail = "1", str(getattr(sys.modules[name], "__file__", None))
    except BaseException as e:
        ok, detail = "0", type(e).__name__ + ": " + str(e).replace("\n", " ")
    print("kimi-k3-smoke", name, ok, detail, sep="\t", flush=True)
"""


@dataclass
class SmokeReport:
    failures: list[str] = field(default_factory=list)
    passes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        (self.passes if ok else self.failures).append(what)


def ref_name(layout: Path) -> str:
    index = json.loads((layout / "index.json").read_text())
    name = index["manifests"][0].get("annotations", {}).get("org.opencontainers.image.ref.name")
    if not name:
        raise UserError(f"{layout}/index.json: no org.opencontainers.image.ref.name; build it with tools/image/layout.py")
    return str(name)


def image_env(layout: Path) -> list[str]:
    _, manifest_bytes = read_index_manifest(layout)
    config = json.loads(blob_path(layout, json.loads(manifest_bytes)["config"]["digest"]).read_bytes())
    return list(config.get("config", {}).get("Env") or [])


def unpack(layout: Path, bundle: Path) -> Path:
    """Apply the layers with umoci (well-kept, handles whiteouts and symlink-safe extraction)."""
    if shutil.which("umoci") is None:
        raise UserError("umoci: not on PATH; install it (apt-get install -y umoci)")
    proc = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{ref_name(layout)}", str(bundle)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise UserError(f"--layout {layout}: umoci unpack failed: {proc.stdout.strip().splitlines()[-1:]}; "
                        "rebuild the layout")
    return bundle / "rootfs"


_CLONE_NEWNS = 0x00020000


def _enter_private_mount_namespace(path: Path) -> None:
    """Move this process into a mount namespace of its own (mounts made here vanish with it,
    never reaching the Bazel server's), with the mount holding `path` private in it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise UserError(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}; the rootfs plan is "
                        "mounted in a private mount namespace: run as root")
    findmnt = shutil.which("findmnt") or "/usr/bin/findmnt"
    target = subprocess.run([findmnt, "-n", "-o", "TARGET", "-T", str(path)], capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run([shutil.which("mount") or "/usr/bin/mount", "--make-rprivate", target], check=True)


def _place_file(root: Path, spec: str, src: Path) -> None:
    """A plan's `IMAGE_PATH[:OCTAL_MODE]` file (oci_layer's `files`) under root."""
    image_path, sep, mode_text = spec.rpartition(":")
    if not (sep and mode_text and all(c in "01234567" for c in mode_text)):
        image_path, mode_text = spec, ""
    dest = root / image_path.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    dest.chmod(int(mode_text, 8) if mode_text else (0o755 if src.stat().st_mode & 0o111 else 0o644))


@contextlib.contextmanager
def mounted_rootfs_plan(plan_path: Path, work: Path, runfiles: Path | None = None) -> Iterator[tuple[Path, list[str]]]:
    """(rootfs, image env) of an oci_rootfs plan, for as long as the context lasts.

    The layers' own trees (each wheel layer's installed tree, read-only Bazel outputs) are the
    lower directories of an overlay, bottom layer last; each layer's small parts (imported tars,
    files, trees) are placed in a directory of its own below its installed tree. Writes go to an
    upper directory under `work`. The overlay lives in this process's own mount namespace, so it
    is gone with the process whatever happens; `work` holds only the small parts and the writes.
    Paths in the plan are runfiles paths (RUNFILES_DIR by default).
    """
    if os.geteuid() != 0:
        raise UserError("mounting a rootfs plan needs root (overlay mount, chroot); run as root")
    try:
        plan = json.loads(plan_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{plan_path}: not a rootfs plan ({e}); build it with oci_rootfs") from None
    if not isinstance(plan, dict) or plan.get("schema") != "kimi-k3-rootfs-plan/1":
        raise UserError(f"{plan_path}: not a kimi-k3-rootfs-plan/1 file; build it with oci_rootfs")
    base = runfiles or Path(os.environ.get("RUNFILES_DIR") or os.environ.get("TEST_SRCDIR") or ".")
    work.mkdir(parents=True, exist_ok=True)
    tar = shutil.which("tar") or "/usr/bin/tar"
    lower: list[Path] = []  # bottom first
    for i, layer in enumerate(plan["layers"]):
        parts = work / "parts" / f"{i:02d}-{layer['name']}"
        parts.mkdir(parents=True)
        for t in layer["tars"]:
            subprocess.run([tar, "-x", "-p", "--numeric-owner", "-f", str(base / t), "-C", str(parts)], check=True)
        for spec, f in layer["files"]:
            _place_file(parts, spec, base / f)
        for image_dir, d in layer["trees"]:
            shutil.copytree(base / d, parts / image_dir.lstrip("/"), symlinks=True, dirs_exist_ok=True)
        for d in layer["site_trees"]:
            shutil.copytree(base / d, parts / SITE_PACKAGES, symlinks=True, dirs_exist_ok=True)
        lower.append(parts)
        if layer["installed"]:
            lower.append((base / layer["installed"]).resolve())
    # Short relative names in the mount options: util-linux 2.42's mount (the sealed root's)
    # refused the same overlay with long absolute lower paths that 2.38's mounted.
    links = work / "l"
    links.mkdir()
    for i, d in enumerate(lower):
        (links / str(i)).symlink_to(d)
    rootfs, upper, scratch = work / "rootfs", work / "upper", work / "overlay-work"
    for d in (rootfs, upper, scratch):
        d.mkdir()
    _enter_private_mount_namespace(work)
    lowerdir = ":".join(str(i) for i in reversed(range(len(lower))))
    mounted = subprocess.run([shutil.which("mount") or "/usr/bin/mount", "-t", "overlay", "overlay", "-o",
                              f"lowerdir={lowerdir},upperdir=../upper,workdir=../overlay-work", str(rootfs)],
                             cwd=links, capture_output=True, text=True)
    if mounted.returncode != 0:
        raise UserError(f"{plan_path}: cannot mount its layers as an overlay at {rootfs} "
                        f"({mounted.stderr.strip().splitlines()[:1]}); the kernel needs overlayfs")
    try:
        yield rootfs, config_env(plan["env"])
    finally:
        subprocess.run([shutil.which("umount") or "/usr/bin/umount", "--lazy", str(rootfs)], check=False)


def inside(rootfs: Path, image_path: str, _hops: int = 0) -> Path:
    """Host path of an image path, following symlinks as the chroot would (never onto the host).

    Absolute link targets are re-rooted at `rootfs` and '..' stops at the rootfs root, so an
    image symlink like /usr/bin/python3 -> /opt/py/bin/python3 is judged by the image's content.
    """
    resolved: list[str] = []
    pending = [p for p in PurePosixPath(image_path).parts if p != "/"]
    hops = _hops
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = rootfs.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise UserError(f"{image_path!r}: too many symlinks in the image; fix the link loop")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            pending = [p for p in PurePosixPath(target).parts if p != "/"] + pending
            continue
        resolved.append(part)
    return rootfs.joinpath(*resolved)


def check_manifest(rootfs: Path, manifest_path: Path, report: SmokeReport) -> None:
    """Patched files must carry the gate's sha256_after (null = the patch deleted the file)."""
    try:
        data = json.loads(manifest_path.read_text())
        # tools/patch_gate writes `changed_files`; `files` is accepted for hand-made manifests.
        files = data["changed_files"] if "changed_files" in data else data["files"]
        entries = [(str(f["path"]), f.get("sha256_after")) for f in files]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--manifest {manifest_path}: not a patch gate manifest with changed_files[].path/sha256_after "
                        f"({e}); pass the gate's manifest.json") from e
    for rel, expected in entries:
        host = inside(rootfs, f"/{SITE_PACKAGES}/{rel}")
        if expected is None:
            report.check(not host.exists() and not host.is_symlink(), f"{rel} deleted by the patch")
            continue
        actual = sha256_file(host) if host.is_file() and not host.is_symlink() else "missing"
        report.check(actual == expected, f"{rel} sha256 {actual[:12]} == gate {str(expected)[:12]}")


DRIVER_STUB_DIR = "/tmp/kimi-k3-driver-stub"
# Driver API names (cuInit, cuMemCreate, ...); the runtime's cuda* names come from libcudart.
_DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


def driver_symbols(rootfs: Path, dirs: Sequence[str] = ("/" + SITE_PACKAGES,)) -> list[str]:
    """Driver API symbols that the image's ELF files needing libcuda.so.1 under `dirs` (image
    paths; site-packages by default) import (Python loads extensions with RTLD_NOW, so an empty
    library is not enough)."""
    readelf, nm = shutil.which("readelf"), shutil.which("nm")
    if not (readelf and nm):
        raise UserError("--driver-stub: needs readelf and nm on PATH; install binutils")
    symbols: set[str] = set()
    for so in sorted(so for d in dirs for so in inside(rootfs, d).rglob("*.so*")):
        if so.is_symlink() or not so.is_file():
            continue
        dynamic = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True).stdout
        if "[libcuda.so.1]" not in dynamic:
            continue
        listing = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True,
                                 text=True).stdout
        for line in listing.splitlines():
            name = line.split()[-1].split("@")[0] if line.split() else ""
            if _DRIVER_SYMBOL.match(name):
                symbols.add(name)
    return sorted(symbols)


def write_driver_stub(rootfs: Path, symbols: Sequence[str]) -> str:
    """A stand-in libcuda.so.1 in the unpacked rootfs (not in the image) defining `symbols` as
    functions that return 100 (CUDA_ERROR_NO_DEVICE); returns its directory inside the image."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise UserError("--driver-stub: no C compiler (cc) on PATH to build a stand-in "
                        "libcuda.so.1; install gcc, or run where the NVIDIA driver is")
    d = inside(rootfs, DRIVER_STUB_DIR)
    d.mkdir(parents=True, exist_ok=True)
    src = d / "stub.c"
    src.write_text("/* stand-in for the driver's libcuda.so.1: smoke test only */\n" +
                   "".join(f"int {name}(void) {{ return 100; }}\n" for name in symbols))
    proc = subprocess.run([cc, "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libcuda.so.1", "-o",
                           str(d / "libcuda.so.1"), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"--driver-stub: {cc} could not build the stub: {proc.stderr.strip()[-300:]}")
    return DRIVER_STUB_DIR


def with_library_path(env: Sequence[str], directory: str) -> list[str]:
    """env with directory first on LD_LIBRARY_PATH (keeping the image's own entries)."""
    out, found = [], False
    for e in env:
        if e.startswith("LD_LIBRARY_PATH="):
            out.append(f"LD_LIBRARY_PATH={directory}:{e.split('=', 1)[1]}".rstrip(":"))
            found = True
        else:
            out.append(e)
    return out if found else [*out, f"LD_LIBRARY_PATH={directory}"]


def run_in_chroot(rootfs: Path, argv: Sequence[str], env: Sequence[str], network: bool = True,
                  timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """argv (image paths) in a chroot of rootfs with only `env`: a private mount namespace with
    /proc, and without network (its own network namespace, loopback down) unless `network`."""
    if os.geteuid() != 0:
        raise UserError("image_smoke: chroot needs root; run as root (CI runs tests as root)")
    (rootfs / "proc").mkdir(exist_ok=True)
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    inner = [chroot, str(rootfs), *argv]
    unshare = shutil.which("unshare")
    if unshare:
        # A private mount namespace: /proc is mounted for torch & co and vanishes with the process.
        # `--propagation private` would remount / private, which fails when / is not a mount
        # point (inside tools/bazel's sealed root, a chroot); making the mount that holds the
        # rootfs private in the new namespace gives the same isolation in both cases.
        mount = shutil.which("mount") or "/usr/bin/mount"
        findmnt = shutil.which("findmnt") or "/usr/bin/findmnt"
        cmd = [unshare, "--mount", *([] if network else ["--net"]), "--propagation", "unchanged", "--",
               "/bin/sh", "-c",
               f'{mount} --make-rprivate "$({findmnt} -n -o TARGET -T "$0")" && '
               f'{mount} -t proc proc "$0/proc" && exec "$@"', str(rootfs), *inner]
    elif not network:
        raise UserError("unshare: not on PATH; the profile check runs without network in its own namespace: "
                        "install util-linux")
    else:
        cmd = inner
    environment = dict(e.split("=", 1) for e in env)
    environment.setdefault("HOME", "/root")
    return subprocess.run(cmd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def run_imports(rootfs: Path, modules: Sequence[str], env: Sequence[str]) -> list[dict[str, object]]:
    """Import modules with the image's python3 in a chroot (private mount ns with /proc)."""
    script = rootfs / "tmp" / "kimi-k3-smoke.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(_IMPORT_SCRIPT)
    proc = run_in_chroot(rootfs, ["/usr/bin/python3", "/tmp/kimi-k3-smoke.py", *modules], env)
    results = []
    for line in proc.stdout.splitlines():
        parts = line.split("\t", 3)
        if len(parts) == 4 and parts[0] == _MARK:
            results.append({"module": parts[1], "ok": parts[2] == "1", "detail": parts[3]})
    if len(results) != len(modules):
        tail = proc.stderr.strip().splitlines()[-3:]
        raise UserError(f"chroot python3 in {rootfs} did not run (exit {proc.returncode}): {tail}; "
                        "does the image have /usr/bin/python3?")
    return results


# Where the profile check works inside the unpacked image (removed afterwards).
PROFILE_CHECK_DIR = "/tmp/kimi-k3-profile-check"
# Serving runs on GPUs without network access to model hubs; the check has no network at all, and
# these make Hugging Face code fail at once instead of retrying.
PROFILE_CHECK_ENV = ("CUDA_VISIBLE_DEVICES=", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1")


def check_launch_profiles(rootfs: Path, env: Sequence[str], names: Sequence[str] = (),
                          profiles_dir: Path | None = None, kernel_cache_plan: Path | None = None,
                          needs: Path = profiles.DEFAULT_NEEDS, inventory: Path | None = None,
                          triton_calls: Path | None = None) -> list[profiles.Verdict]:
    """Check launch profiles (all, or `names`) against the unpacked image at rootfs: the ones it
    ships, or those of profiles_dir (host) run through the image's entrypoint and SGLang; with an
    inventory (jit_cache/inventory.<stack>.json), the prebuilt sites each reaches are in the image
    (its Triton sites in the calls of triton_calls, jit_cache/triton_calls.json, which the image's
    Triton layer is built from, as the kernel cache's modules come from its plan)."""
    shipped = inside(rootfs, profiles.PROFILES_IMAGE_PATH)
    if profiles_dir is None and not shipped.is_dir():
        raise UserError(f"the image ships no launch profiles ({profiles.PROFILES_IMAGE_PATH}); rebuild it, or pass "
                        "--launch-profiles-dir image/profiles")
    chosen = profiles.select_profiles(profiles.load_profiles(profiles_dir or shipped), [n for n in names if n != "*"])
    table = profiles.load_needs(needs)
    cache = (profiles.kernel_cache_of_plan(kernel_cache_plan) if kernel_cache_plan
             else profiles.kernel_cache_of_image(inside(rootfs, "/" + SITE_PACKAGES)))
    listed = read_inventory(inventory, "--inventory") if inventory else None
    caches = profiles.first_use_caches_of_image(inside(rootfs, profiles.SGLANG_JIT_IMAGE_PATH))
    if triton_calls is not None and listed is not None:
        caches = dataclasses.replace(caches, triton=profiles.triton_plan(triton_calls, str(listed.get("stack"))))
    work = inside(rootfs, PROFILE_CHECK_DIR)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        shutil.copyfile(profile_probe.__file__, work / "profile_probe.py")
        image_profiles = profiles.PROFILES_IMAGE_PATH
        if profiles_dir is not None:
            (work / "profiles").mkdir()
            for p in chosen:
                shutil.copyfile(p.path, work / "profiles" / p.path.name)
            image_profiles = f"{PROFILE_CHECK_DIR}/profiles"
        request = profiles.probe_request(chosen, table, cache, profiles.ENTRYPOINT_IMAGE_PATH, image_profiles,
                                         f"{PROFILE_CHECK_DIR}/checkpoints")
        (work / "request.json").write_text(json.dumps(request))
        proc = run_in_chroot(rootfs, ["/usr/bin/python3", f"{PROFILE_CHECK_DIR}/profile_probe.py",
                                      f"{PROFILE_CHECK_DIR}/request.json"],
                             [*env, *PROFILE_CHECK_ENV], network=False, timeout=1800)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results, features, sglang = profiles.parse_probe_output(proc.stdout)
    if not results:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise UserError(f"the profile probe did not run in {rootfs} (exit {proc.returncode}): {tail}; "
                        "does the image have /usr/bin/python3 and SGLang?")
    return profiles.judge(chosen, results, features, cache, table, sglang, listed, caches)


TRITON_IMAGE_PATH = profiles.TRITON_IMAGE_PATH
TRITON_CHECK_DIR = "/tmp/kimi-k3-triton-check"


def check_triton_driver(rootfs: Path, env: Sequence[str]) -> tuple[bool, str]:
    """Triton's first kernel launch in the image, without a GPU: in a chroot, the image's
    entrypoint binds the shipped Triton cache and Triton's own CudaUtils() must load its driver
    module from it, building nothing (tools/image/triton_driver_probe.py; a stand-in
    libcuda.so.1 answers the driver symbols). Returns (ok, one line)."""
    manifest = inside(rootfs, f"{TRITON_IMAGE_PATH}/kimi-k3-triton.json")
    if not manifest.is_file():
        return False, (f"Triton's driver module: the image has no {TRITON_IMAGE_PATH}/kimi-k3-triton.json; "
                       "build it with its Triton layer (//image:layer_triton)")
    modules = json.loads(manifest.read_text()).get("modules") or []
    if [m.get("module") for m in modules] != ["cuda_utils"]:
        return False, (f"Triton's driver module: {TRITON_IMAGE_PATH}/kimi-k3-triton.json lists no cuda_utils "
                       "module; rebuild the Triton layer (//jit_cache:triton_12_0)")
    [module] = modules
    symbols = driver_symbols(rootfs, ("/" + SITE_PACKAGES, TRITON_IMAGE_PATH))
    run_env = with_library_path([*env, *PROFILE_CHECK_ENV, f"HOME={TRITON_CHECK_DIR}/home"],
                                write_driver_stub(rootfs, symbols))
    work = inside(rootfs, TRITON_CHECK_DIR)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        from tools.image import triton_driver_probe

        shutil.copyfile(triton_driver_probe.__file__, work / "probe.py")
        shutil.copyfile(profile_probe.__file__, work / "profile_probe.py")
        proc = run_in_chroot(rootfs, ["/usr/bin/python3", f"{TRITON_CHECK_DIR}/probe.py",
                                      profiles.ENTRYPOINT_IMAGE_PATH, f"{TRITON_CHECK_DIR}/cache"],
                             run_env, network=False, timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [line.split("\t", 1)[1] for line in proc.stdout.splitlines() if line.startswith("kimi-k3-triton-driver\t")]
    if not lines:
        tail = proc.stderr.strip().splitlines()[-3:]
        return False, f"Triton's driver module: the probe did not run (exit {proc.returncode}): {tail}"
    out = json.loads(lines[-1])
    shipped = f"{TRITON_IMAGE_PATH}/{module['key']}/{module['file']}"
    if out.get("ok") and out.get("module_real") == shipped:
        return True, (f"Triton's driver module: CudaUtils() loaded the shipped {module['file']} "
                      f"(TRITON_LIBCUDA_PATH={out.get('TRITON_LIBCUDA_PATH')}), 0 compiles")
    what = (f"Triton built {', '.join(out['compiles'])}" if out.get("compiles")
            else out.get("error") or f"loaded {out.get('module_real')}, not {shipped}")
    return False, (f"Triton's driver module: {what}; the image's TRITON_LIBCUDA_PATH or Triton differs from "
                   "what //jit_cache:triton_12_0 was built with: rebuild the image")


def smoke(layout: Path, workdir: Path, imports: Sequence[str], manifests: Sequence[Path], require: Sequence[str],
          forbid: Sequence[str], extra_env: Sequence[str], keep: bool = False,
          driver_stub: bool = False, launch_profiles: Sequence[str] = (),
          launch_profiles_dir: Path | None = None, kernel_cache_plan: Path | None = None,
          inventory: Path | None = None, triton_calls: Path | None = None,
          triton_driver: bool = False) -> SmokeReport:
    report = SmokeReport()
    bundle = Path(tempfile.mkdtemp(prefix="smoke.", dir=workdir)) / "bundle"
    try:
        rootfs = unpack(layout, bundle)
        for m in manifests:
            check_manifest(rootfs, m, report)
        for path in require:
            p = inside(rootfs, path)
            report.check(p.exists() and (not p.is_dir() or any(p.iterdir())), f"{path} present")
        for path in forbid:
            p = inside(rootfs, path)
            report.check(not p.exists() and not p.is_symlink(), f"{path} absent")
        if imports:
            env = [*image_env(layout), *extra_env]
            note = ""
            if driver_stub:
                symbols = driver_symbols(rootfs)
                env = with_library_path(env, write_driver_stub(rootfs, symbols))
                note = f" (with a stand-in libcuda.so.1 of {len(symbols)} driver symbols)"
            for r in run_imports(rootfs, imports, env):
                detail = str(r["detail"])
                if not r["ok"] and "libcuda.so.1" in detail and not driver_stub:
                    detail += (" (no NVIDIA driver here; GPU hosts get it from the container runtime;"
                               " --driver-stub checks the import with a stand-in)")
                report.check(bool(r["ok"]), f"import {r['module']}: {detail}{note if r['ok'] else ''}")
        if launch_profiles or launch_profiles_dir:
            for verdict in check_launch_profiles(rootfs, [*image_env(layout), *extra_env], launch_profiles,
                                                 launch_profiles_dir, kernel_cache_plan, inventory=inventory,
                                                 triton_calls=triton_calls):
                report.check(verdict.ok, verdict.line)
                report.notes += [f"{verdict.profile}: {d}" for d in verdict.details]
        if triton_driver:
            report.check(*check_triton_driver(rootfs, [*image_env(layout), *extra_env]))
    finally:
        if keep:
            print(f"rootfs kept at {bundle / 'rootfs'}", file=sys.stderr)
        else:
            shutil.rmtree(bundle.parent, ignore_errors=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", required=True, type=Path)
    p.add_argument("--profile", choices=sorted(PROFILES))
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--manifest", action="append", default=[], type=Path, help="patch gate manifest.json")
    p.add_argument("--require", action="append", default=[], help="image path that must exist")
    p.add_argument("--forbid", action="append", default=[], help="image path that must not exist")
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--keep-rootfs", action="store_true")
    p.add_argument("--driver-stub", action="store_true",
                   help="hosts without the NVIDIA driver: a stand-in libcuda.so.1 for the imports")
    p.add_argument("--launch-profile", action="append", default=[], metavar="NAME",
                   help="check this launch profile against the image (--profile kimi-k3: all it ships)")
    p.add_argument("--launch-profiles-dir", type=Path,
                   help="check these profile files (e.g. image/profiles) instead of the image's own")
    p.add_argument("--kernel-cache-plan", type=Path,
                   help="the image has no kernel-cache layer: take its modules from this plan")
    p.add_argument("--inventory", type=Path,
                   help="the image's stack's jit_cache/inventory.<stack>.json: its prebuilt sites must be in the image")
    p.add_argument("--triton-calls", type=Path,
                   help="jit_cache/triton_calls.json, which the image's Triton layer is built from (its prebuilt Triton sites)")
    args = p.parse_args(argv)
    prof = PROFILES.get(args.profile or "", {})
    for e in args.env:
        if "=" not in e:
            raise UserError(f"--env {e!r}: expected K=V")
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = smoke(args.layout, args.workdir, [*prof.get("imports", []), *args.imports], args.manifest,
                   [*prof.get("require", []), *args.require], [*prof.get("forbid", []), *args.forbid],
                   [*prof.get("env", []), *args.env], args.keep_rootfs, args.driver_stub,
                   [*prof.get("launch_profiles", []), *args.launch_profile], args.launch_profiles_dir,
                   args.kernel_cache_plan, args.inventory, args.triton_calls, prof.get("triton_driver", False))
    for line in report.passes:
        print(f"ok   {line}")
    for line in report.notes:
        print(f"     {line}")
    for line in report.failures:
        print(f"FAIL {line}")
    print(f"{len(report.passes)} passed, {len(report.failures)} failed")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
