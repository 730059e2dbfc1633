"""The image's root on the host: a layout unpacked with umoci (its ref name, its config's Env), or
an oci_rootfs plan mounted as an overlay of its layers in a private mount namespace; inside()
resolves an image path in that root as the chroot would (symlinks never reaching the host)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Iterator

from tools.common.errors import UserError
from tools.common import cuda_home
from tools.jit_cache import bytecode_tree
from tools.image.layout import blob_path, config_env, read_index_manifest
from tools.image.wheel_install import SITE_PACKAGES


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
        if layer.get("cuda_home"):
            cuda_home.make(parts, SITE_PACKAGES)
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
        # A bytecode tree among the layers (//jit_cache:image_bytecode, not in the image) is read
        # through PYTHONPYCACHEPREFIX.
        yield rootfs, config_env(plan["env"]) + bytecode_tree.chroot_env(lower)
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
