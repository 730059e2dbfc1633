"""The launch-profile check in the image's root: tools/image/profile_probe.py copied into it and
run in a chroot without network, on the profiles it ships (or others), then judged against the
needs table, the image's kernel cache and first-use caches, and the inventory's prebuilt sites."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Sequence

from tools.common.errors import UserError
from tools.image import profile_probe
from tools.image.backend_needs import load_needs
from tools.image.image_caches import (SGLANG_JIT_IMAGE_PATH, first_use_caches_of_image, kernel_cache_of_image,
                                      kernel_cache_of_plan, triton_plan)
from tools.image.image_chroot import run_in_chroot
from tools.image.image_rootfs import inside
from tools.image.launch_profiles import (DEFAULT_NEEDS, ENTRYPOINT_IMAGE_PATH, PROFILES_IMAGE_PATH, load_profiles,
                                         select_profiles)
from tools.image.profile_verdicts import Verdict, judge, parse_probe_output, probe_request
from tools.image.wheel_install import SITE_PACKAGES
from tools.jit_cache.inventory import read_inventory

# Where the profile check works inside the unpacked image (removed afterwards).
PROFILE_CHECK_DIR = "/tmp/kimi-k3-profile-check"
# Serving runs on GPUs without network access to model hubs; the check has no network at all, and
# these make Hugging Face code fail at once instead of retrying.
PROFILE_CHECK_ENV = ("CUDA_VISIBLE_DEVICES=", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1")


def check_launch_profiles(rootfs: Path, env: Sequence[str], names: Sequence[str] = (),
                          profiles_dir: Path | None = None, kernel_cache_plan: Path | None = None,
                          needs: Path = DEFAULT_NEEDS, inventory: Path | None = None,
                          triton_calls: Path | None = None) -> list[Verdict]:
    """Check launch profiles (all, or `names`) against the unpacked image at rootfs: the ones it
    ships, or those of profiles_dir (host) run through the image's entrypoint and SGLang; with an
    inventory (jit_cache/inventory.<stack>.json), the prebuilt sites each reaches are in the image
    (its Triton sites in the calls of triton_calls, jit_cache/triton_calls.json, which the image's
    Triton layer is built from, as the kernel cache's modules come from its plan)."""
    shipped = inside(rootfs, PROFILES_IMAGE_PATH)
    if profiles_dir is None and not shipped.is_dir():
        raise UserError(f"the image ships no launch profiles ({PROFILES_IMAGE_PATH}); rebuild it, or pass "
                        "--launch-profiles-dir image/profiles")
    chosen = select_profiles(load_profiles(profiles_dir or shipped), [n for n in names if n != "*"])
    table = load_needs(needs)
    cache = (kernel_cache_of_plan(kernel_cache_plan) if kernel_cache_plan
             else kernel_cache_of_image(inside(rootfs, "/" + SITE_PACKAGES)))
    listed = read_inventory(inventory, "--inventory") if inventory else None
    caches = first_use_caches_of_image(inside(rootfs, SGLANG_JIT_IMAGE_PATH))
    if triton_calls is not None and listed is not None:
        caches = dataclasses.replace(caches, triton=triton_plan(triton_calls, str(listed.get("stack"))))
    work = inside(rootfs, PROFILE_CHECK_DIR)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        shutil.copyfile(profile_probe.__file__, work / "profile_probe.py")
        image_profiles = PROFILES_IMAGE_PATH
        if profiles_dir is not None:
            (work / "profiles").mkdir()
            for p in chosen:
                shutil.copyfile(p.path, work / "profiles" / p.path.name)
            image_profiles = f"{PROFILE_CHECK_DIR}/profiles"
        request = probe_request(chosen, table, cache, ENTRYPOINT_IMAGE_PATH, image_profiles,
                                         f"{PROFILE_CHECK_DIR}/checkpoints")
        (work / "request.json").write_text(json.dumps(request))
        proc = run_in_chroot(rootfs, ["/usr/bin/python3", f"{PROFILE_CHECK_DIR}/profile_probe.py",
                                      f"{PROFILE_CHECK_DIR}/request.json"],
                             [*env, *PROFILE_CHECK_ENV], network=False, timeout=1800)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results, features, sglang = parse_probe_output(proc.stdout)
    if not results:
        tail = proc.stderr.strip().splitlines()[-3:]
        raise UserError(f"the profile probe did not run in {rootfs} (exit {proc.returncode}): {tail}; "
                        "does the image have /usr/bin/python3 and SGLang?")
    return judge(chosen, results, features, cache, table, sglang, listed, caches)
