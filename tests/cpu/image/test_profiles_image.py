"""The launch profiles against a real image: its SGLang, its entrypoint, its profiles (tag cpu).

Bazel passes (tests/cpu/image/BUILD.bazel, :profiles_check and :profiles_check_pypi):
KIMI_PROFILES_IMAGE (//image:rootfs_without_kernel_cache of the stack: a plan of the trees and
files the image's layers, without the kernel-cache layer, are written from),
KIMI_PROFILES_PLAN (the checked-in plan of that image's kernel cache, //kernel_cache:selected_plan),
KIMI_PROFILES_INVENTORY (the stack's first-use inventory, //jit_cache:inventory: its prebuilt
sites must be in the image; its Triton sites in KIMI_PROFILES_TRITON_CALLS, jit_cache/triton_calls.json,
the calls the image's Triton layer is built from) and KIMI_PROFILES_SGLANG_WHEEL (the stack's SGLang wheel before the
patch gate). The plan is
mounted once as an overlay (tools/image/image_rootfs.py mounted_rootfs_plan); every check then runs the
image's python3 in a chroot without network (check_launch_profiles). Needs root.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
from tests.cpu.conftest import env_path

from tools.image import image_caches
from tools.image import image_rootfs
from tools.image import launch_profile_check
from tools.image import launch_profiles
from tools.image import profile_verdicts
from tools.image import triton_driver_check
from tools.image.wheel_install import SITE_PACKAGES

REPO_ROOT = Path(__file__).resolve().parents[3]
# The SM120 deployment profiles, which the image must pass, and the H200 proof's (issue #38:
# SM90, the gpu-test-sm90 kernel selection), which the SM120 image must refuse, naming why.
SM120_PROFILES = ["kimi-k3-pd-decode", "kimi-k3-pd-prefill", "kimi-k3-tp32ep32"]
SM90_PROOF = "kimi-k3-h200-proof"
SHIPPED = sorted([*SM120_PROFILES, SM90_PROOF])
# The kda_prefill=flashkda variant's own profiles (image/profiles/flashkda/), shipped only there.
FLASHKDA_DIR = Path(__file__).resolve().parents[3] / "image" / "profiles" / "flashkda"
FLASHKDA_PROFILES = sorted(p.stem for p in FLASHKDA_DIR.glob("*.json"))


def single(var: str) -> Path:
    """The one path of a `$(rootpaths ...)` variable."""
    paths = str(env_path(var)).split()
    assert len(paths) == 1, f"{var}: expected one path, got {paths}"
    return Path(paths[0])


INVENTORY = json.loads(single("KIMI_PROFILES_INVENTORY").read_text())


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    if os.geteuid() != 0:
        pytest.fail("the profile check runs the image in a chroot: it needs root (CI runs tests as root)")
    work = tmp_path_factory.mktemp("image")
    # The layers' own trees under an overlay (nothing compressed, unpacked or copied but the
    # base tar and the small files); writes land in `work`, the mount dies with this process.
    with image_rootfs.mounted_rootfs_plan(single("KIMI_PROFILES_IMAGE"), work) as (rootfs, env):
        yield rootfs, env
    subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)


def check(image: tuple[Path, list[str]], names: list[str] = (), profiles_dir: Path | None = None
          ) -> dict[str, profile_verdicts.Verdict]:
    rootfs, env = image
    verdicts = launch_profile_check.check_launch_profiles(rootfs, env, names, profiles_dir, single("KIMI_PROFILES_PLAN"),
                                           inventory=single("KIMI_PROFILES_INVENTORY"),
                                           triton_calls=single("KIMI_PROFILES_TRITON_CALLS"))
    report = "".join(f"{'ok  ' if v.ok else 'FAIL'} {v.line}\n" + "".join(f"      {d}\n" for d in v.details)
                     for v in verdicts)
    print(report)  # in test.log for passed tests too (-rP below)
    return {v.profile: v for v in verdicts}


def test_the_image_ships_the_profiles_and_they_pass(image: tuple[Path, list[str]]) -> None:
    rootfs, _ = image
    shipped = image_rootfs.inside(rootfs, launch_profiles.PROFILES_IMAGE_PATH)
    names = sorted(p.stem for p in shipped.iterdir())
    variant = FLASHKDA_PROFILES if (shipped / f"{FLASHKDA_PROFILES[0]}.json").exists() else []
    assert names == sorted(SHIPPED + variant)
    for name in SHIPPED:
        assert (shipped / f"{name}.json").read_bytes() == (launch_profiles.DEFAULT_PROFILES_DIR / f"{name}.json").read_bytes()
    for name in variant:
        assert (shipped / f"{name}.json").read_bytes() == (FLASHKDA_DIR / f"{name}.json").read_bytes()
    verdicts = check(image)
    assert sorted(verdicts) == names
    for name in variant:  # the flashkda variant: SGLang resolved it, and flash_kda imports in the image
        v = verdicts.pop(name)
        assert v.ok and "guard accepts" in v.line and "flashkda-wheel" in v.line, v.line
    proof = verdicts.pop(SM90_PROOF)
    assert not proof.ok and "needs kernel selection gpu-test-sm90" in proof.line, proof.line
    failed = [v.line for v in verdicts.values() if not v.ok]
    assert not failed, "\n".join(failed)
    for name, v in verdicts.items():
        # What was checked is in the line: SGLang ran its resolution, the guard, the modules the
        # MXFP4 backend needs, the SiTU probe.
        assert "resolution steps" in v.line and "guard accepts" in v.line and " 0 resolution steps" not in v.line
        assert "fused_moe_120" in v.line and "mxfp8_quantization_sm100" in v.line and "situ-mxfp4-cutlass" in v.line
        # The inventory's prebuilt sites (FlashInfer modules, SGLang JIT builds) were looked up.
        prebuilt = [i for i, site in INVENTORY["sites"].items() if site["status"] == "prebuilt" and name in site["profiles"]]
        assert any(i.startswith("sglang-jit:") for i in prebuilt)
        assert f"; {len(prebuilt)} prebuilt first-use sites present" in v.line
        # No step may be skipped for a reason the check does not know.
        assert all(d.startswith(("skipped ", "stopped ")) for d in v.details), v.details
        reasons = " ".join(v.details)
        assert "reads the checkpoint's" in reasons, "the steps that need the checkpoint are reported as skipped"


def mutate(src: str, dest: Path, name: str, args: dict[str, str] = {}, add: list[str] = (),
           env: dict[str, str] = {}) -> None:
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / f"{src}.json").read_text())
    data["args"] = [args.get(a, a) for a in data["args"]] + list(add)
    data["env"].update(env)
    (dest / f"{name}.json").write_text(json.dumps(data))


# mutated profile -> (source profile, mutation, what the one-line error must name)
MUTATIONS = {
    "unknown-flag": ("kimi-k3-tp32ep32", {"args": {"--moe-runner-backend": "--moe-runner-backnd"}},
                     ["SGLang", "rejects its arguments", "unrecognized arguments: --moe-runner-backnd"]),
    "bad-choice": ("kimi-k3-tp32ep32", {"args": {"bf16": "bf17"}},
                   ["argument --kv-cache-dtype: invalid choice: 'bf17'"]),
    "bad-int": ("kimi-k3-tp32ep32", {"args": {"8192": "8k"}},
                ["argument --chunked-prefill-size: invalid int value: '8k'"]),
    "resolution-rejects": ("kimi-k3-pd-decode", {"add": ["--disaggregation-decode-host-receive-threshold", "2"]},
                           ["resolution rejects it in step handle_pd_disaggregation",
                            "--disaggregation-decode-host-receive-threshold must be between 0 and 1"]),
    "check-rejects": ("kimi-k3-tp32ep32", {"args": {"4": "3"}},
                      ["check_server_args rejects it", "tp_size must be divisible by number of nodes"]),
    "guard-refuses": ("kimi-k3-pd-prefill", {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
                      ["entrypoint guard refuses it", "PYTORCH_CUDA_ALLOC_CONF", "kvcache-ai/Mooncake#2511"]),
    # The guard reads the arguments with the image's SGLang parser: an abbreviation, a --config file.
    "guard-abbreviation": ("kimi-k3-pd-prefill", {"args": {"--disaggregation-mode": "--disaggregation-mod"},
                                                  "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
                           ["entrypoint guard refuses it", "(--disaggregation-mode prefill, transfer backend mooncake, "
                            "Mooncake 0.3.14, RDMA on --disaggregation-ib-device mlx5_0,mlx5_1,mlx5_2,mlx5_3",
                            "nvidia-peermem"]),
    "guard-config": ("kimi-k3-tp32ep32", {"add": ["--config", "/tmp/kimi-k3-guard-config.yaml"],
                                          "env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}},
                     ["entrypoint guard refuses it", "(--disaggregation-mode decode, transfer backend mooncake, "
                      "Mooncake 0.3.14, RDMA on --disaggregation-ib-device mlx5_7"]),
    "module-missing": ("kimi-k3-tp32ep32", {"add": ["--attention-backend", "flashinfer"]},
                       ["--attention-backend flashinfer needs FlashInfer module batch_mla_attention",
                        "which the image's kernel cache", "lacks"]),
}


def test_mutated_profiles_fail_naming_the_profile_and_the_argument(image: tuple[Path, list[str]],
                                                                   tmp_path: Path) -> None:
    for name, (src, mutation, _) in MUTATIONS.items():
        mutate(src, tmp_path, f"kimi-k3-{name}", **mutation)
    shutil.copyfile(launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json", tmp_path / "kimi-k3-tp32ep32.json")
    # Expandable segments over Mooncake 0.3.14's dma-buf registration (the image's pin): accepted.
    mutate("kimi-k3-pd-prefill", tmp_path, "kimi-k3-guard-dmabuf",
           env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WITH_NVIDIA_PEERMEM": "0"})
    config = image_rootfs.inside(image[0], "/tmp/kimi-k3-guard-config.yaml")
    config.write_text("disaggregation-mode: decode\ndisaggregation-ib-device: mlx5_7\n")
    try:
        verdicts = check(image, profiles_dir=tmp_path)
    finally:
        config.unlink()
    assert verdicts["kimi-k3-tp32ep32"].ok, "the unmutated profile in the same run passes"
    assert verdicts["kimi-k3-guard-dmabuf"].ok and "guard accepts" in verdicts["kimi-k3-guard-dmabuf"].line
    for name, (_, _, expected) in MUTATIONS.items():
        v = verdicts[f"kimi-k3-{name}"]
        assert not v.ok, f"{name}: {v.line}"
        assert v.line.startswith(f"profile kimi-k3-{name} (kimi-k3-{name}.json): ")
        assert "\n" not in v.line
        for part in expected:
            assert part in v.line, f"{name}: {part!r} not in {v.line!r}"


@pytest.fixture
def sglang_without_situ(image: tuple[Path, list[str]]) -> Iterator[list[str]]:
    """The image's SGLang with the files the gate patched put back to the wheel's (an image
    without the SiTU patch), restored afterwards."""
    rootfs, _ = image
    site = image_rootfs.inside(rootfs, "/" + SITE_PACKAGES)
    manifest = json.loads(image_rootfs.inside(rootfs, "/usr/share/kimi-k3/patch-gate/sglang.manifest.json").read_text())
    changed = [f["path"] for f in manifest["changed_files"]]
    assert "sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py" in changed
    saved = {p: (site / p).read_bytes() for p in changed}
    with zipfile.ZipFile(single("KIMI_PROFILES_SGLANG_WHEEL")) as wheel:
        for p in changed:
            (site / p).write_bytes(wheel.read(p))
    try:
        yield changed
    finally:
        for p, data in saved.items():
            (site / p).write_bytes(data)


@pytest.fixture
def image_jit_dir(image: tuple[Path, list[str]]) -> Iterator[Path]:
    """The image's SGLang JIT directory (its manifest and leaves), restored afterwards."""
    jit = image_rootfs.inside(image[0], image_caches.SGLANG_JIT_IMAGE_PATH)
    saved = {p: p.read_bytes() for p in jit.rglob("*") if p.is_file()}
    try:
        yield jit
    finally:
        for p, data in saved.items():
            p.write_bytes(data)


def test_an_image_without_a_prebuilt_sglang_jit_build_fails_naming_it(image: tuple[Path, list[str]],
                                                                      image_jit_dir: Path) -> None:
    manifest = json.loads((image_jit_dir / image_caches.SGLANG_JIT_MANIFEST).read_text())
    dropped, damaged = manifest["modules"][0], manifest["modules"][1]
    (image_jit_dir / image_caches.SGLANG_JIT_MANIFEST).write_text(
        json.dumps({**manifest, "modules": manifest["modules"][1:]}))
    so = image_jit_dir / damaged["leaf"] / f"{damaged['module']}.so"
    so.write_bytes(so.read_bytes() + b"\0")
    verdicts = check(image, ["kimi-k3-tp32ep32"])
    v = verdicts["kimi-k3-tp32ep32"]
    assert not v.ok
    assert "\n" not in v.line
    lines = [v.line, *v.details]
    for entry, why in ((dropped, "no entry for it in the image's /usr/share/kimi-k3/sglang-jit/kimi-k3-sglang-jit.json"),
                       (damaged, "is not the sha256 the manifest records")):
        key = f"{entry['call']} {json.dumps(entry['args'], sort_keys=True)}"
        assert any(f"which jit_cache/inventory.{INVENTORY['stack']}.json marks prebuilt ({key}), and the image "
                   f"lacks it:" in line and why in line and "//image:layer_sglang_jit" in line for line in lines), lines


def test_mxfp4_backend_on_an_image_without_the_situ_patch(image: tuple[Path, list[str]],
                                                          sglang_without_situ: list[str]) -> None:
    verdicts = check(image)
    for name in SM120_PROFILES:
        v = verdicts[name]
        assert not v.ok
        assert v.line.startswith(f"profile {name} ({name}.json): --moe-runner-backend flashinfer_mxfp4 needs "
                                 "situ-mxfp4-cutlass: the image's SGLang MXFP4 CUTLASS runner has no SiTU path"), v.line
        assert "sglang_patches 0001" in v.line


@pytest.fixture
def image_triton_driver(image: tuple[Path, list[str]]) -> Iterator[Path]:
    """The image's Triton directory holding //jit_cache:triton_driver_12_0 (Triton's driver module
    as the Triton layer ships it; the image checked here is built without that layer), removed
    afterwards."""
    shipped = image_rootfs.inside(image[0], image_caches.TRITON_IMAGE_PATH)
    assert not shipped.exists(), "the image under test already has a Triton directory"
    shutil.copytree(single("KIMI_PROFILES_TRITON_DRIVER"), shipped)
    try:
        yield shipped
    finally:
        shutil.rmtree(shipped)


def test_the_first_triton_launch_finds_the_shipped_driver_module(image: tuple[Path, list[str]],
                                                                 image_triton_driver: Path) -> None:
    """In the image's chroot its entrypoint binds the Triton cache and Triton's own CudaUtils()
    loads the shipped driver module: no build, which would need the C compiler the image lacks.
    Another TRITON_LIBCUDA_PATH is refused by the entrypoint in one line, and an entry under
    another key (what a changed driver.c, Triton or path would give) is a build, named."""
    rootfs, env = image
    assert any(e == "TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu" for e in env), env
    ok, line = triton_driver_check.check_triton_driver(rootfs, env)
    print(line)
    assert ok, line
    assert line.endswith("(TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu), 0 compiles"), line

    ok, line = triton_driver_check.check_triton_driver(rootfs, [*env, "TRITON_LIBCUDA_PATH=/usr/local/nvidia/lib64"])
    assert not ok and "CacheError: TRITON_LIBCUDA_PATH=/usr/local/nvidia/lib64: the image's prebuilt Triton " \
        "driver module" in line, line

    manifest_path = image_triton_driver / "kimi-k3-triton.json"
    manifest = json.loads(manifest_path.read_text())
    [module] = manifest["modules"]
    other = "0" * len(module["key"])
    (image_triton_driver / module["key"]).rename(image_triton_driver / other)
    manifest_path.write_text(json.dumps({**manifest, "modules": [{**module, "key": other}]}))
    ok, line = triton_driver_check.check_triton_driver(rootfs, env)
    assert not ok and line.startswith("Triton's driver module: Triton built cuda_utils;"), line


if __name__ == "__main__":
    # -rP: the check's report (what ran, what was skipped and why) is in test.log when it passes.
    sys.exit(pytest.main([__file__, "-v", "-rP"]))
