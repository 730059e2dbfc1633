"""Triton's first kernel launch in the image's root, without a GPU:
tools/image/triton_driver_probe.py in a chroot must load the driver module the image's Triton
cache ships, building nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

from tools.image import profile_probe
from tools.image.driver_stub import driver_symbols, with_library_path, write_driver_stub
from tools.image.image_caches import TRITON_IMAGE_PATH
from tools.image.image_chroot import run_in_chroot
from tools.image.image_rootfs import inside
from tools.image.launch_profile_check import PROFILE_CHECK_ENV
from tools.image.launch_profiles import ENTRYPOINT_IMAGE_PATH
from tools.image.wheel_install import SITE_PACKAGES

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
                                      ENTRYPOINT_IMAGE_PATH, f"{TRITON_CHECK_DIR}/cache"],
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
