"""Launch profiles without an image (tag cpu, seconds): their format, the entrypoint's --profile and
--print-profile, the needs table and verdicts, the kernel-cache facts, the probe's skip rules.

The check against a real image (its SGLang) is test_profiles_image.py (:profiles_check_pypi).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import stack_version
from tools.common.errors import UserError
from tools.image import (backend_needs, image_caches, launch_profile_check, launch_profiles, profile_probe,
                         profile_verdicts, profiles, smoke)

REPO_ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = REPO_ROOT / "image" / "entrypoint.py"
PYPI_PLAN = REPO_ROOT / "kernel_cache" / "plan_120f_kimi-k3.pypi.bzl"
# The SGLang version the probe reports (as the pypi stack's image would).
SGLANG_PYPI = stack_version("pypi", "sglang")
ROLES = ["kimi-k3-pd-decode", "kimi-k3-pd-prefill", "kimi-k3-tp32ep32"]
# Not a serving role: the H200 proof (issue #38) on one SM90 GPU with the shrunk model.
H200_PROOF = "kimi-k3-h200-proof"


def write_profile(directory: Path, name: str, **changes: object) -> Path:
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-pd-prefill.json").read_text())
    data.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the profiles and their format

def test_the_three_roles_are_valid_profiles() -> None:
    loaded = launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR)
    assert sorted(loaded) == sorted(ROLES + [H200_PROOF])
    backend_needs.load_needs(launch_profiles.DEFAULT_NEEDS)
    for p in (loaded[role] for role in ROLES):
        assert p.architectures == ["KimiK3ForConditionalGeneration"] and p.kernel_selection == "kimi-k3"
        args = p.data["args"]
        assert args[args.index("--moe-runner-backend") + 1] == "flashinfer_mxfp4"
        assert args[args.index("--kv-cache-dtype") + 1] == "bf16"
        assert p.data["env"]["FLASHINFER_DISABLE_JIT"] == "1", "a missing module fails at once, never compiles"
    prefill, decode = loaded["kimi-k3-pd-prefill"].data, loaded["kimi-k3-pd-decode"].data
    for pd, mode in ((prefill, "prefill"), (decode, "decode")):
        a = pd["args"]
        assert a[a.index("--disaggregation-mode") + 1] == mode
        assert a[a.index("--disaggregation-transfer-backend") + 1] == "mooncake"
        assert a[a.index("--page-size") + 1] == "64"
        # What the entrypoint guard checks, stated in the profile: Mooncake, no expandable segments.
        assert "expandable_segments:True" not in pd["env"].get("PYTORCH_CUDA_ALLOC_CONF", "")
    sizes = {n: {f: p.data["args"][p.data["args"].index(f) + 1] for f in ("--tp-size", "--ep-size")}
             for n, p in loaded.items() if n in ROLES}
    assert sizes["kimi-k3-tp32ep32"] == {"--tp-size": "32", "--ep-size": "32"}
    assert sizes["kimi-k3-pd-prefill"] == {"--tp-size": "4", "--ep-size": "4"}
    assert sizes["kimi-k3-pd-decode"] == {"--tp-size": "32", "--ep-size": "4"}


@pytest.mark.parametrize("changes,message", [
    ({"args": ["--model-path", "${MODEL_PATH}", "--port", "${PROT}"]}, "used but not declared ['PROT']"),
    ({"placeholders": {"MODEL_PATH": {"description": "d", "example": "/m"}}}, "used but not declared"),
    ({"checkpoint": {"placeholder": "MODEL_PATH", "config": {"architectures": ["X"], "model_type": "x",
                                                             "num_hidden_layers": 61}}},
     "$.checkpoint.config: unknown key 'num_hidden_layers' (known: architectures, model_type)"),
    ({"needs": {}}, "$.needs: missing key 'kernel_selection'"),
    ({"schema_version": 2}, "$.schema_version: expected 1, found the number 2"),
    ({"args": ["--port", 30000]}, "$.args[1]: expected a non-empty string, found the number 30000"),
    ({"extra": 1}, "$: unknown key 'extra' (known: args, checkpoint"),
])
def test_a_malformed_profile_is_one_line_naming_the_file(tmp_path: Path, changes: dict, message: str) -> None:
    path = write_profile(tmp_path, "broken", **changes)
    with pytest.raises(UserError) as e:
        launch_profiles.load_profiles(tmp_path)
    assert str(e.value).startswith(f"profile {path}") and message in str(e.value) and "\n" not in str(e.value)


def test_the_h200_proof_profile() -> None:
    """The shrunk model on one SM90 GPU: no checkpoint, no tokenizer, BF16 experts on Triton, and
    FlashInfer allowed to JIT (the image's kernels are SM120's; the recording run records it)."""
    p = launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR)[H200_PROOF]
    assert p.architectures == ["KimiK3LinearForCausalLM"] and p.kernel_selection == "gpu-test-sm90"
    args = p.data["args"]
    for flag, value in (("--load-format", "dummy"), ("--tp-size", "1"), ("--moe-runner-backend", "triton"),
                        ("--attention-backend", "triton"), ("--kv-cache-dtype", "bf16"),
                        ("--chunked-prefill-size", "8192"), ("--host", "127.0.0.1")):
        assert args[args.index(flag) + 1] == value, flag
    assert "--skip-tokenizer-init" in args
    assert "FLASHINFER_DISABLE_JIT" not in p.data["env"] and p.data["env"]["TRITON_CACHE_AUTOTUNING"] == "1"


def test_a_declared_placeholder_nothing_uses_is_refused(tmp_path: Path) -> None:
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text())
    data["placeholders"]["UNUSED"] = {"description": "d", "example": "e"}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"declared but not used \['UNUSED'\]"):
        launch_profiles.load_profiles(tmp_path)


def test_the_needs_table_names_only_features_the_probe_knows(tmp_path: Path) -> None:
    table = json.loads(launch_profiles.DEFAULT_NEEDS.read_text())
    table["settings"]["moe_runner_backend"]["flashinfer_mxfp4"]["features"] = ["situ-typo"]
    path = tmp_path / "needs.json"
    path.write_text(json.dumps(table))
    with pytest.raises(UserError, match="feature 'situ-typo' has no probe; known: flashkda-wheel, situ-mxfp4-cutlass"):
        backend_needs.load_needs(path)


@pytest.mark.parametrize("where, wrong, expected", [
    (["architectures"], [], "$.architectures: expected an object, found a list"),
    (["settings", "sampling_backend"], [], "$.settings.sampling_backend: expected an object, found a list"),
    (["settings", "sampling_backend", "flashinfer"], [], "$.settings.sampling_backend.flashinfer: expected an object, "
                                                         "found a list"),
    (["architectures", "KimiK3ForConditionalGeneration", "modules"], ["norm"],
     "$.architectures.KimiK3ForConditionalGeneration.modules: expected an object, found a list"),
], ids=["architectures", "a setting", "a setting's value", "an entry's modules"])
def test_a_needs_table_of_the_wrong_shape_is_one_line_naming_the_path(tmp_path: Path, where: list[str], wrong: object,
                                                                      expected: str) -> None:
    """A part of image/backend_needs.json of the wrong type: one line naming --needs, the file and
    the JSON path (before: an AttributeError traceback from `profiles validate --needs FILE`)."""
    table = json.loads(launch_profiles.DEFAULT_NEEDS.read_text())
    parent = table
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = wrong
    path = tmp_path / "needs.json"
    path.write_text(json.dumps(table))
    with pytest.raises(UserError) as e:
        profiles.main(["validate", "--needs", str(path)])
    assert str(e.value).startswith(f"--needs {path}: {expected}; ") and "\n" not in str(e.value), str(e.value)


def test_image_paths_agree_with_constants_and_the_entrypoint() -> None:
    constants = (REPO_ROOT / "image" / "constants.bzl").read_text()
    values = dict(re.findall(r'^([A-Z_]+) = "([^"]*)"', constants, re.M))
    assert values["ENTRYPOINT"] == launch_profiles.ENTRYPOINT_IMAGE_PATH
    assert values["PROFILES_DIR"] == launch_profiles.PROFILES_IMAGE_PATH
    assert launch_profiles.load_entrypoint().PROFILES_DIR == launch_profiles.PROFILES_IMAGE_PATH
    assert values["SGLANG_JIT_DIR"] == image_caches.SGLANG_JIT_IMAGE_PATH == launch_profiles.load_entrypoint().SGLANG_JIT_DIR
    from tools.jit_cache.sglang_aot import MANIFEST

    assert MANIFEST == image_caches.SGLANG_JIT_MANIFEST == launch_profiles.load_entrypoint().SGLANG_JIT_MANIFEST
    from tools.jit_cache import triton_aot

    assert values["TRITON_DIR"] == image_caches.TRITON_IMAGE_PATH == launch_profiles.load_entrypoint().TRITON_DIR
    assert triton_aot.MANIFEST == launch_profiles.load_entrypoint().TRITON_MANIFEST
    assert values["FIRST_USE_SITE"] == launch_profiles.load_entrypoint().FIRST_USE_SITE


def test_the_entrypoint_turns_the_first_use_recorder_on_by_flag(tmp_path: Path) -> None:
    entrypoint = launch_profiles.load_entrypoint()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("")
    records = tmp_path / "records"
    argv, env = entrypoint.first_use_env(["--record-first-use", str(records), "--verify-first-use",
                                          "--profile", "p"], {"PYTHONPATH": "/x"}, site=str(site))
    assert argv == ["--profile", "p"]
    assert env == {"KIMI_K3_FIRST_USE_RECORD": str(records), "KIMI_K3_FIRST_USE_VERIFY": "1",
                   "PYTHONPATH": f"{site}:/x"}
    assert entrypoint.first_use_env(["--profile", "p"], {}, site=str(site)) == (["--profile", "p"], {})
    (records / "old").mkdir(parents=True)
    with pytest.raises(entrypoint.ProfileError, match="not empty"):
        entrypoint.first_use_env(["--record-first-use", str(records)], {}, site=str(site))
    with pytest.raises(entrypoint.ProfileError, match="takes a directory"):
        entrypoint.first_use_env(["--record-first-use", "--profile", "p"], {}, site=str(site))
    with pytest.raises(entrypoint.ProfileError, match="no first-use recorder"):
        entrypoint.first_use_env(["--verify-first-use"], {}, site=str(tmp_path / "none"))


# ---------------------------------------------------------------- the entrypoint

def run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str],
                   site: Path | None = None, jit_dir: Path | None = None,
                   triton_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The entrypoint with profiles from image/profiles and a python3 that prints its exec;
    `site` (on PYTHONPATH) holds a fake SGLang or Mooncake distribution; `jit_dir` and
    `triton_dir` stand in for the image's SGLang JIT and Triton directories (default: none, as on
    an image without them)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "python3").write_text("#!/bin/sh\necho \"exec: $*\"\nenv | sort | sed 's/^/env: /'\n")
    (fake_bin / "python3").chmod(0o755)
    script = tmp_path / "entrypoint.py"
    text = ENTRYPOINT.read_text()
    # The shipped path, pointed at the repository's profiles (the image has them there).
    script.write_text(text.replace(f'PROFILES_DIR = "{launch_profiles.PROFILES_IMAGE_PATH}"',
                                   f'PROFILES_DIR = "{launch_profiles.DEFAULT_PROFILES_DIR}"')
                      .replace(f'SGLANG_JIT_DIR = "{image_caches.SGLANG_JIT_IMAGE_PATH}"',
                               f'SGLANG_JIT_DIR = "{jit_dir or tmp_path / "no-sglang-jit"}"')
                      .replace('TRITON_DIR = "/usr/share/kimi-k3/triton"',
                               f'TRITON_DIR = "{triton_dir or tmp_path / "no-triton"}"'))
    assert script.read_text() != text
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env={"PATH": f"{fake_bin}:/usr/bin:/bin", **({"PYTHONPATH": str(site)} if site else {}),
                               **env})


SITE = {"MODEL_PATH": "/mnt/k3", "NODE_RANK": "2", "DIST_INIT_ADDR": "192.168.0.10:5000", "PORT": "8000",
        "BOOTSTRAP_PORT": "9000", "IB_DEVICES": "mlx5_0", "NET_IFNAME": "ib0"}


def test_print_profile_prints_what_profile_starts(tmp_path: Path) -> None:
    printed = run_entrypoint(tmp_path, ["--print-profile", "kimi-k3-pd-prefill"], SITE)
    assert printed.returncode == 0, printed.stderr
    line = printed.stdout.strip()
    assert line.startswith("env FLASHINFER_DISABLE_JIT=1 GLOO_SOCKET_IFNAME=ib0 NCCL_SOCKET_IFNAME=ib0 "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False kimi-k3-entrypoint --model-path /mnt/k3 ")
    assert "--node-rank 2 --dist-init-addr 192.168.0.10:5000" in line and "--disaggregation-bootstrap-port 9000" in line
    started = run_entrypoint(tmp_path, ["--profile", "kimi-k3-pd-prefill"], SITE)
    assert started.returncode == 0, started.stderr
    exec_line = started.stdout.splitlines()[0]
    assert exec_line == "exec: -m sglang.launch_server " + line.split(" kimi-k3-entrypoint ", 1)[1]
    assert "env: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in started.stdout
    assert "env: NCCL_SOCKET_IFNAME=ib0" in started.stdout


def test_profile_placeholders_must_be_set(tmp_path: Path) -> None:
    site = {k: v for k, v in SITE.items() if k != "DIST_INIT_ADDR"}
    for flag in ("--print-profile", "--profile"):
        proc = run_entrypoint(tmp_path, [flag, "kimi-k3-tp32ep32"], site)
        assert proc.returncode == 2 and "exec:" not in proc.stdout
        assert proc.stderr.strip() == ("error: profile kimi-k3-tp32ep32: placeholder DIST_INIT_ADDR is not set "
                                       "(host:port of node 0 for the distributed rendezvous); set it in the "
                                       "container's environment, e.g. DIST_INIT_ADDR=10.0.0.1:20000")


def test_profile_refusals(tmp_path: Path) -> None:
    unknown = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp64"], SITE)
    assert unknown.returncode == 2
    assert "profile 'kimi-k3-tp64': not in" in unknown.stderr and "kimi-k3-tp32ep32" in unknown.stderr
    extra = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32", "--port", "1"], SITE)
    assert extra.returncode == 2 and "takes no other arguments" in extra.stderr and "exec:" not in extra.stdout
    # The guard judges the profile with the container's environment: expandable segments set
    # there are overridden by the PD profile's own PYTORCH_CUDA_ALLOC_CONF ...
    ok = run_entrypoint(tmp_path, ["--profile", "kimi-k3-pd-decode"],
                        {**SITE, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert ok.returncode == 0, ok.stderr
    # ... but not PYTORCH_ALLOC_CONF, its alias, which the profile does not set.
    refused = run_entrypoint(tmp_path, ["--print-profile", "kimi-k3-pd-decode"],
                             {**SITE, "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert refused.returncode == 2 and refused.stdout.startswith("env ")
    assert "PYTORCH_ALLOC_CONF sets expandable_segments:True" in refused.stderr
    assert "--disaggregation-mode decode" in refused.stderr and "--disaggregation-ib-device mlx5_0" in refused.stderr


# ---------------------------------------------------------------- the guard: arguments as SGLang parses them

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
FIXED_DMABUF = {"WITH_NVIDIA_PEERMEM": "0"}  # Mooncake's dma-buf registration, fixed in 0.3.14


def mooncake_site(site: Path, version: str) -> Path:
    """`site` with an installed mooncake-transfer-engine-cuda13 distribution of `version`."""
    info = site / f"mooncake_transfer_engine_cuda13-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mooncake-transfer-engine-cuda13\nVersion: {version}\n")
    return site


# A stand-in for the image's SGLang launch parser (the image-level check runs the real one): argparse
# with abbreviations, a --config file of `key: value` lines merged before the command line, as
# sglang.srt.server_args.prepare_server_args does.
FAKE_SERVER_ARGS = """
import argparse, os
def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve")
    for flag, default in (("--model-path", None), ("--disaggregation-mode", "null"),
                          ("--disaggregation-transfer-backend", "mooncake"), ("--disaggregation-ib-device", None),
                          ("--disaggregation-bootstrap-port", "8998"), ("--config", None)):
        parser.add_argument(flag, default=default)
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1]
        if not os.path.exists(path):
            raise ValueError(f"Config file not found: {path}")
        merged = []
        for line in open(path):
            key, _, value = line.partition(":")
            merged += ["--" + key.strip(), value.strip()]
        argv = merged + argv[:i] + argv[i + 2:]
    return parser.parse_args(argv)
"""


def fake_sglang(site: Path) -> Path:
    pkg = site / "sglang" / "srt"
    (pkg / "plugins").mkdir(parents=True)
    for init in (site / "sglang", pkg, pkg / "plugins"):
        (init / "__init__.py").write_text("")
    (pkg / "plugins" / "__init__.py").write_text("def load_plugins():\n    pass\n")
    (pkg / "server_args.py").write_text(FAKE_SERVER_ARGS)
    return site


@pytest.mark.parametrize("with_sglang", [False, True])
def test_guard_reads_an_abbreviated_option_as_sglang_does(tmp_path: Path, with_sglang: bool) -> None:
    # SGLang's parser takes any unique prefix of a long option: --disaggregation-mod is --disaggregation-mode.
    site = mooncake_site(tmp_path / "site", "0.3.14")
    if with_sglang:
        fake_sglang(site)
    for args in (["--model-path", "/m", "--disaggregation-mod", "prefill"] if with_sglang else
                 ["--model-path", "/m", "--disaggregation-mo=decode", "--disaggregation-transfer-b", "mooncake"],):
        proc = run_entrypoint(tmp_path, args, EXPANDABLE, site)
        assert proc.returncode == 2 and "exec:" not in proc.stdout, (args, proc.stdout)
        assert "PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True while SGLang transfers the KV cache with " \
               "Mooncake (--disaggregation-mode " in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    # A prefix of none of them is left to SGLang.
    proc = run_entrypoint(tmp_path, ["--model-path", "/m", "--disaggregation-bootstrap", "9"], EXPANDABLE, site)
    assert proc.returncode == 0 and proc.stdout.startswith("exec: -m sglang.launch_server"), proc.stderr


def test_guard_refuses_an_abbreviation_it_cannot_resolve(tmp_path: Path) -> None:
    # Without SGLang's option list the guard refuses a prefix of two judged options (SGLang refuses it too).
    proc = run_entrypoint(tmp_path, ["--disaggregation-", "prefill"], EXPANDABLE)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    assert proc.stderr.strip() == (
        "error: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True, and the guard cannot judge the arguments: "
        "--disaggregation- could be any of --disaggregation-mode, --disaggregation-transfer-backend, "
        "--disaggregation-ib-device (SGLang refuses an ambiguous abbreviation); spell the option in full")


def test_guard_reads_a_config_file_as_sglang_does(tmp_path: Path) -> None:
    # SGLang merges `--config FILE.yaml` into its arguments: a disaggregation-mode there counts.
    config = tmp_path / "server.yaml"
    config.write_text("disaggregation-mode: decode\ndisaggregation-ib-device: mlx5_3\n")
    site = fake_sglang(mooncake_site(tmp_path / "site", "0.3.14"))
    proc = run_entrypoint(tmp_path, ["--model-path", "/m", "--config", str(config)], EXPANDABLE, site)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    assert "(--disaggregation-mode decode, transfer backend mooncake, Mooncake 0.3.14, RDMA on " \
           "--disaggregation-ib-device mlx5_3, WITH_NVIDIA_PEERMEM not 0)" in proc.stderr, proc.stderr
    # The command line wins over the file, as in SGLang.
    proc = run_entrypoint(tmp_path, ["--config", str(config), "--disaggregation-mode", "null"], EXPANDABLE, site)
    assert proc.returncode == 0, proc.stderr
    # A file SGLang cannot read is a refusal naming it.
    missing = tmp_path / "missing.yaml"
    proc = run_entrypoint(tmp_path, ["--config", str(missing)], EXPANDABLE, site)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    assert proc.stderr.strip() == (
        f"error: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True, and the guard cannot judge the arguments: "
        f"--config {missing}: SGLang's parser fails with it (ValueError: Config file not found: {missing}); fix the "
        "file, its path or the arguments (SGLang would refuse them too)")
    # Without SGLang the guard cannot read the file: refused, naming it.
    proc = run_entrypoint(tmp_path, ["--config", str(config)], EXPANDABLE, mooncake_site(tmp_path / "bare", "0.3.14"))
    assert proc.returncode == 2 and f"--config {config}: the guard reads a config file only with the image's " \
                                    "SGLang" in proc.stderr, proc.stderr
    # Without expandable segments nothing is parsed: SGLang gets the arguments as they are.
    proc = run_entrypoint(tmp_path, ["--config", str(missing)], {}, site)
    assert proc.returncode == 0 and proc.stdout.startswith(f"exec: -m sglang.launch_server --config {missing}")


# ---------------------------------------------------------------- the guard: Mooncake's facts

# (arguments, environment beside expandable_segments:True, Mooncake installed, refused: the facts the line names)
GUARD_CASES = [
    # TCP transfers expandable-segment memory (measured with 0.3.14): accepted.
    (["--disaggregation-mode", "prefill"], {"MC_FORCE_TCP": "1"}, "0.3.14", None),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake_tcp"], {}, "0.3.14", None),
    # dma-buf registration (WITH_NVIDIA_PEERMEM=0) is fixed in 0.3.14 (#3538), not before.
    (["--disaggregation-mode", "prefill", "--disaggregation-ib-device", "mlx5_0"], FIXED_DMABUF, "0.3.14", None),
    (["--disaggregation-mode", "prefill"], FIXED_DMABUF, "0.3.14.post1", None),
    (["--disaggregation-mode", "prefill"], FIXED_DMABUF, "0.3.13.post1",
     ["Mooncake 0.3.13.post1, RDMA on the RDMA devices of the node", "kvcache-ai/Mooncake#2511, fixed by #3538 in 0.3.14",
      "use Mooncake 0.3.14 or later with WITH_NVIDIA_PEERMEM=0"]),
    (["--disaggregation-mode", "prefill"], FIXED_DMABUF, "0.3.14rc1", ["fixed by #3538 in 0.3.14"]),
    (["--disaggregation-mode", "prefill"], FIXED_DMABUF, None, ["Mooncake of unknown version (none installed here)"]),
    # nvidia-peermem registration (ibv_reg_mr) is not covered by the fix.
    (["--disaggregation-mode", "prefill", "--disaggregation-ib-device", "mlx5_0"], {}, "0.3.14",
     ["RDMA on --disaggregation-ib-device mlx5_0, WITH_NVIDIA_PEERMEM not 0", "nvidia-peermem (ibv_reg_mr)",
      "set WITH_NVIDIA_PEERMEM=0 (dma-buf registration, fixed in 0.3.14) or MC_FORCE_TCP=1"]),
    (["--disaggregation-mode", "prefill"], {"WITH_NVIDIA_PEERMEM": "true"}, "0.3.14", ["nvidia-peermem"]),
    (["--disaggregation-mode", "prefill"], {"MC_FORCE_TCP": "0"}, "0.3.14", ["nvidia-peermem"]),
    # Intra-node NVLink refuses virtual-memory buffers (measured with 0.3.14), even with dma-buf.
    (["--disaggregation-mode", "decode"], {"MC_INTRANODE_NVLINK": "1", **FIXED_DMABUF}, "0.3.14",
     ["intra-node NVLink (MC_INTRANODE_NVLINK is set)", "no cudaIpc handle"]),
    # EFA: SGLang refuses it with expandable segments when its KV manager starts.
    (["--disaggregation-mode", "decode"], {"MOONCAKE_PROTOCOL": "efa", "MC_FORCE_TCP": "1"}, "0.3.14",
     ["EFA (MOONCAKE_PROTOCOL=efa)", "libfabric EFA provider cannot transfer CUDA virtual-memory allocations"]),
    # No Mooncake KV transfer: accepted. HiCache's Mooncake store registers host memory.
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl"], {}, "0.3.14", None),
    (["--hicache-storage-backend", "mooncake"], {"MOONCAKE_MASTER": "10.0.0.1:50051"}, "0.3.14", None),
    (["--model-path", "m"], {}, "0.3.14", None),
]


@pytest.mark.parametrize("args,env,version,facts", GUARD_CASES)
def test_guard_refuses_exactly_what_mooncake_cannot_transfer(args: list[str], env: dict[str, str],
                                                             version: str | None, facts: list[str] | None) -> None:
    # version None: the installed one, and the test's Python has none.
    line = launch_profiles.load_entrypoint().refusal(args, {**EXPANDABLE, **env}, mooncake_version=version)
    if facts is None:
        assert line is None
        return
    assert "\n" not in line and line.startswith("error: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True while "
                                                "SGLang transfers the KV cache with Mooncake (")
    assert line.endswith("remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF")
    for fact in facts:
        assert fact in line, line


def test_guard_judges_the_installed_mooncake(tmp_path: Path) -> None:
    args = ["--disaggregation-mode", "prefill"]
    fixed = run_entrypoint(tmp_path, args, {**EXPANDABLE, **FIXED_DMABUF}, mooncake_site(tmp_path / "a", "0.3.14"))
    assert fixed.returncode == 0 and fixed.stdout.startswith("exec: -m sglang.launch_server --disaggregation-mode"), \
        fixed.stderr
    old = run_entrypoint(tmp_path, args, {**EXPANDABLE, **FIXED_DMABUF}, mooncake_site(tmp_path / "b", "0.3.12.post1"))
    assert old.returncode == 2 and "exec:" not in old.stdout and "Mooncake 0.3.12.post1, RDMA" in old.stderr, old.stderr


@pytest.mark.parametrize("alloc_var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_guard_reads_both_allocator_variables(alloc_var: str) -> None:
    refusal = launch_profiles.load_entrypoint().refusal
    line = refusal(["--disaggregation-mode", "prefill"], {alloc_var: "max_split_size_mb:512,expandable_segments:True"})
    assert line and line.startswith(f"error: {alloc_var} sets expandable_segments:True")
    assert refusal(["--disaggregation-mode", "prefill"], {alloc_var: "expandable_segments:False"}) is None


def test_the_guard_judges_the_pinned_mooncake() -> None:
    versions = launch_profiles.pinned_mooncake(launch_profiles.DEFAULT_LOCK)
    assert versions == {"0.3.14": ["default", "pypi"]}
    entrypoint = launch_profiles.load_entrypoint()
    assert entrypoint.has_dmabuf_fix("0.3.14") and not entrypoint.has_dmabuf_fix("0.3.12.post1")


# ---------------------------------------------------------------- validate and the entrypoint's loading

def test_validate_refuses_an_unknown_kernel_selection(tmp_path: Path) -> None:
    write_profile(tmp_path, "p", needs={"kernel_selection": "kimi-k4"})
    known = ", ".join(sorted({"full", *json.loads(launch_profiles.DEFAULT_SELECTIONS.read_text())["selections"]}))
    with pytest.raises(UserError, match=r"needs kernel_selection: 'kimi-k4' is not a selection of .*selections.json "
                                        + re.escape(f"(known: {known})")):
        profiles.main(["validate", "--profiles-dir", str(tmp_path)])


def test_validate_refuses_a_flag_or_a_key_given_twice(tmp_path: Path) -> None:
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text())
    data["args"] += ["--tp-size=16"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"p.json args: --tp-size given twice \(SGLang keeps the last one silently\)"):
        launch_profiles.load_profiles(tmp_path)
    text = (launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text()
    (tmp_path / "p.json").write_text(text.replace('"env": {', '"env": {"NCCL_SOCKET_IFNAME": "lo", ', 1))
    with pytest.raises(UserError, match=r"p.json: \$\.env: key 'NCCL_SOCKET_IFNAME' appears twice in one object "
                                        r"\(the object at line \d+\); remove one"):
        launch_profiles.load_profiles(tmp_path)


def test_validate_runs_the_entrypoint_guard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-pd-prefill.json").read_text())
    data["env"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    (tmp_path / "kimi-k3-pd-prefill.json").write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        profiles.main(["validate", "--profiles-dir", str(tmp_path)])
    line = str(e.value)
    assert line.startswith(f"profile {tmp_path}/kimi-k3-pd-prefill.json: the image's entrypoint guard refuses it "
                           "(Mooncake 0.3.14, stack default, pypi): PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True")
    assert "--disaggregation-ib-device mlx5_0,mlx5_1,mlx5_2,mlx5_3" in line and "\n" not in line
    # The same profile over dma-buf registration is what 0.3.14 fixed: accepted.
    data["env"]["WITH_NVIDIA_PEERMEM"] = "0"
    (tmp_path / "kimi-k3-pd-prefill.json").write_text(json.dumps(data))
    assert profiles.main(["validate", "--profiles-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "ok   kimi-k3-pd-prefill\n"
    assert profiles.main(["validate"]) == 0, "the shipped profiles pass"


def test_entrypoint_refuses_a_broken_shipped_profile_in_one_line(tmp_path: Path) -> None:
    shipped = tmp_path / "profiles"
    shipped.mkdir()
    data = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text())
    for name, broken, message in [
        ("no-args", {k: v for k, v in data.items() if k != "args"}, "'args' is not a list of strings (the SGLang arguments)"),
        ("env-int", {**data, "env": {"X": 1}}, "'env' is not an object of strings"),
        ("a-list", [data], "not a JSON object"),
    ]:
        (shipped / f"{name}.json").write_text(json.dumps(broken))
        script = tmp_path / "entrypoint.py"
        script.write_text(ENTRYPOINT.read_text().replace(f'PROFILES_DIR = "{launch_profiles.PROFILES_IMAGE_PATH}"',
                                                         f'PROFILES_DIR = "{shipped}"'))
        for flag in ("--profile", "--print-profile") if name == "no-args" else ("--profile",):
            proc = subprocess.run([sys.executable, str(script), flag, name], capture_output=True, text=True,
                                  env={"PATH": "/usr/bin:/bin"})
            assert proc.returncode == 2 and proc.stdout == "", proc.stderr
            assert proc.stderr == (f"error: profile {name}: {message}; rebuild the image from profiles that pass "
                                   "`python3 -m tools.image.profiles validate`\n")


def entrypoint_layer_argv(tmp_path: Path, profile_files: list[Path]) -> list[str]:
    """tools/image/entrypoint_layer.py's arguments as the entrypoint_layer rule passes them."""
    argv = ["--entrypoint", str(ENTRYPOINT), "--entrypoint-image-path", launch_profiles.ENTRYPOINT_IMAGE_PATH]
    for f in profile_files:
        argv += ["--profile", str(f)]
    return argv + ["--profiles-image-dir", launch_profiles.PROFILES_IMAGE_PATH, "--needs", str(launch_profiles.DEFAULT_NEEDS),
                   "--selections", str(launch_profiles.DEFAULT_SELECTIONS), "--lock", str(launch_profiles.DEFAULT_LOCK),
                   "--name", "entrypoint", "--out", str(tmp_path / "out" / "layer.tar.gz"),
                   "--descriptor", str(tmp_path / "out" / "layer.layer.json"), "--source-date-epoch", "1767225600"]


def test_the_entrypoint_layer_action_refuses_a_bad_profile(tmp_path: Path) -> None:
    shipped = sorted(p for p in launch_profiles.DEFAULT_PROFILES_DIR.glob("*.json") if p.stem in ROLES)
    bad = tmp_path / "bad" / "kimi-k3-pd-prefill.json"
    bad.parent.mkdir()
    data = json.loads(shipped[1].read_text())
    assert shipped[1].name == bad.name
    data["env"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    bad.write_text(json.dumps(data))
    (tmp_path / "out").mkdir()
    run = [sys.executable, "-m", "tools.image.entrypoint_layer"]
    proc = subprocess.run([*run, *entrypoint_layer_argv(tmp_path, [shipped[0], bad, shipped[2]])],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: profile {bad}: the image's entrypoint guard refuses it")
    assert list((tmp_path / "out").iterdir()) == [], "a refused profile leaves no layer"
    proc = subprocess.run([*run, *entrypoint_layer_argv(tmp_path, shipped)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    # The layer is the entrypoint and the profiles, as tools/image/layer.py writes them.
    from tools.image import layer
    (tmp_path / "plain").mkdir()
    files = [f"{launch_profiles.ENTRYPOINT_IMAGE_PATH}={ENTRYPOINT}:755"]
    files += [f"{launch_profiles.PROFILES_IMAGE_PATH}/{f.name}={f}" for f in shipped]
    assert layer.main(["--name", "entrypoint", "--out", str(tmp_path / "plain" / "l.tar.gz"), "--descriptor",
                       str(tmp_path / "plain" / "l.json"), "--source-date-epoch", "1767225600",
                       *(x for f in files for x in ("--file", f))]) == 0
    assert (tmp_path / "out" / "layer.tar.gz").read_bytes() == (tmp_path / "plain" / "l.tar.gz").read_bytes()


def test_profiles_show_uses_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert profiles.main(["show", "kimi-k3-tp32ep32"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("env FLASHINFER_DISABLE_JIT=1 GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 "
                          "kimi-k3-entrypoint --model-path /models/kimi-k3 --trust-remote-code --tp-size 32")


# ---------------------------------------------------------------- kernel cache facts and verdicts

def test_kernel_cache_from_the_plan_and_from_the_image(tmp_path: Path) -> None:
    plan = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    assert (plan.arch, plan.selection) == ("12.0f", "kimi-k3")
    assert plan.modules["fused_moe_120"] == ("CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>",)
    assert plan.modules["norm"] is None
    aot = tmp_path / "site" / image_caches.AOT_DIR
    for name in ("norm", "fused_moe_120"):
        (aot / name).mkdir(parents=True)
    (aot / "norm" / "norm.so").write_bytes(b"\x7fELF")
    (aot / image_caches.CACHE_JSON).write_text(json.dumps({"arch_list": "12.0f", "modules": {
        "norm": {"path": "norm/norm.so"},
        "fused_moe_120": {"path": "fused_moe_120/fused_moe_120.so", "kernel_selection": {"name": "kimi-k3", "runners": ["R"]}},
    }}))
    image = image_caches.kernel_cache_of_image(tmp_path / "site")
    assert image.selection == "full" and dict(image.modules) == {"norm": None}, "a module without its .so is absent"
    with pytest.raises(UserError, match="carries no kernel cache; for an image assembled without"):
        image_caches.kernel_cache_of_image(tmp_path / "empty")
    assert image_caches.capability_of("12.0f") == (12, 0) and image_caches.capability_of("9.0a") == (9, 0)


def ok_result(name: str, moe: str = "flashinfer_mxfp4", attention: str | None = None) -> dict:
    return {"profile": name, "ok": True, "stage": "done", "args": ["--x"], "ran": ["a", "b", "check_server_args"],
            "skipped": [["handle_gpu_memory_settings", "reads the checkpoint's model_config.attention_arch"]],
            "stopped": None, "not_reached": [],
            "values": {"moe_runner_backend": moe, "attention_backend": attention, "sampling_backend": "flashinfer"},
            "flags": {"moe_runner_backend": "--moe-runner-backend", "attention_backend": "--attention-backend",
                      "sampling_backend": "--sampling-backend"}}


def verdict(result: dict, cache: image_caches.KernelCache, features: dict | None = None) -> profile_verdicts.Verdict:
    loaded = launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR)
    table = backend_needs.load_needs(launch_profiles.DEFAULT_NEEDS)
    (v,) = profile_verdicts.judge([loaded[result["profile"]]], {result["profile"]: result},
                          features if features is not None else {"situ-mxfp4-cutlass": None}, cache, table, SGLANG_PYPI)
    return v


def test_verdicts_name_what_the_image_lacks() -> None:
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    good = verdict(ok_result("kimi-k3-tp32ep32"), cache)
    assert good.ok and "ran 2 resolution steps and check_server_args, skipped 1;" in good.line
    assert "kernel cache has dsv3_fused_routing, fused_moe_120, mxfp8_quantization_sm100, norm, sampling" in good.line
    assert good.details == ["skipped handle_gpu_memory_settings: reads the checkpoint's model_config.attention_arch"]
    stopped = verdict({**ok_result("kimi-k3-tp32ep32"), "stopped": ["resolve_boundary_reduction", "reads x"],
                       "not_reached": ["handle_load_format"]}, cache)
    assert stopped.ok and "skipped 1, stopped early;" in stopped.line
    assert stopped.details[-1] == "stopped at resolve_boundary_reduction (reads x); not reached: handle_load_format"

    no_situ = verdict(ok_result("kimi-k3-tp32ep32"), cache, {"situ-mxfp4-cutlass": "the image's FlashInfer has no CUTLASS SiTU"})
    assert not no_situ.ok and no_situ.line == ("profile kimi-k3-tp32ep32 (kimi-k3-tp32ep32.json): --moe-runner-backend "
                                               "flashinfer_mxfp4 needs situ-mxfp4-cutlass: the image's FlashInfer has no CUTLASS SiTU")
    attention = verdict(ok_result("kimi-k3-tp32ep32", attention="flashinfer"), cache)
    assert not attention.ok and "--attention-backend flashinfer needs FlashInfer module batch_mla_attention_dtype_q_bf16" in attention.line

    other_runners = image_caches.KernelCache("test", "12.0f", "kimi-k3", {**cache.modules, "fused_moe_120": ("CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>",)})
    runner = verdict(ok_result("kimi-k3-tp32ep32"), other_runners)
    assert not runner.ok and "needs fused_moe_120 with CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>" in runner.line
    full = image_caches.KernelCache("test", "12.0f", "full", {m: None for m in cache.modules})
    assert verdict(ok_result("kimi-k3-tp32ep32"), full).ok, "a full cache compiles every runner"
    other_selection = image_caches.KernelCache("test", "12.0f", "gpu-test-sm90", cache.modules)
    sel = verdict(ok_result("kimi-k3-tp32ep32"), other_selection)
    assert not sel.ok and "needs kernel selection kimi-k3, the image's kernel cache is selection gpu-test-sm90" in sel.line
    no_sampling = image_caches.KernelCache("test", "12.0f", "kimi-k3", {m: r for m, r in cache.modules.items() if m != "sampling"})
    samp = verdict(ok_result("kimi-k3-tp32ep32"), no_sampling)
    assert not samp.ok and "--sampling-backend flashinfer needs FlashInfer module sampling" in samp.line


# ---------------------------------------------------------------- FlashKDA: the image variant's profile and warning

FLASHKDA_PROFILES = launch_profiles.DEFAULT_PROFILES_DIR / "flashkda"
FLASHKDA_PROFILE = "kimi-k3-tp32ep32-flashkda"


def test_the_flashkda_profile_is_tp32ep32_with_flashkda_prefill_and_its_notes() -> None:
    loaded = launch_profiles.load_profiles(FLASHKDA_PROFILES)
    assert sorted(loaded) == [FLASHKDA_PROFILE]
    # Validated like the shipped profiles: kernel selection known, the guard accepts every pinned Mooncake.
    launch_profiles.check_profiles(loaded, launch_profiles.DEFAULT_SELECTIONS, launch_profiles.DEFAULT_LOCK)
    data = loaded[FLASHKDA_PROFILE].data
    base = json.loads((launch_profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text())
    args = list(data["args"])
    i = args.index("--linear-attn-prefill-backend")
    assert args[i + 1] == "flashkda"
    assert args[:i] + args[i + 2:] == base["args"], "the same deployment as kimi-k3-tp32ep32 but for the KDA prefill"
    assert {k: data[k] for k in ("checkpoint", "needs", "placeholders", "env")} == \
        {k: base[k] for k in ("checkpoint", "needs", "placeholders", "env")}
    notes = " ".join(data["notes"])
    assert "4 and under 8 concurrent requests" in notes and "2693" in notes and "2695" in notes
    entrypoint = launch_profiles.load_entrypoint()
    assert "4 and under 8 concurrent requests" in entrypoint.FLASHKDA_KNOWN_ISSUES and "2693 vs 2695" in entrypoint.FLASHKDA_KNOWN_ISSUES
    # Not among the profiles every image ships: only the kda_prefill=flashkda variant carries it.
    assert FLASHKDA_PROFILE not in launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR)


@pytest.mark.parametrize("args, warns", [
    (["--model-path", "/m", "--linear-attn-prefill-backend", "flashkda"], True),
    (["--model-path", "/m", "--linear-attn-prefill-backend=flashkda"], True),
    (["--model-path", "/m", "--linear-attn-prefill", "flashkda"], True),  # argparse's unique prefix
    (["--model-path", "/m", "--linear-attn-backend", "flashkda"], True),  # the base backend is the prefill's default
    (["--model-path", "/m", "--linear-attn-backend", "flashkda", "--linear-attn-prefill-backend", "triton"], False),
    (["--model-path", "/m", "--linear-attn-backend", "triton"], False),
    (["--model-path", "/m"], False),
])
def test_the_entrypoint_warns_about_flashkda_and_starts_anyway(tmp_path: Path, args: list[str], warns: bool) -> None:
    proc = run_entrypoint(tmp_path, args, {})
    assert proc.returncode == 0 and "exec: -m sglang.launch_server " + " ".join(args) in proc.stdout
    # (The DeepGEMM warning of a container without nvcc is its own test's.)
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning:") and "DeepGEMM" not in line]
    if not warns:
        assert warning == [], proc.stderr
        return
    assert len(warning) == 1, proc.stderr
    assert warning[0].startswith("warning: the KDA prefill backend is FlashKDA (--linear-attn-prefill-backend flashkda): "
                                 "it fails under 4 and under 8 concurrent requests (the operators' manual)")
    assert "prefer --linear-attn-prefill-backend triton" in warning[0] and warning[0].endswith("starting anyway")
    # This process has no flash_kda: the warning also says which image has it.
    assert "this image has no flash_kda" in warning[0] and "--//image:kda_prefill=flashkda" in warning[0]


def test_the_entrypoint_warns_when_deepgemm_would_find_no_nvcc(tmp_path: Path) -> None:
    """On an H100 the replay's server died when its model runner started DeepGEMM's JIT runtime
    (deep_gemm.set_pdl asserts an executable nvcc); the image has none, and SGLang starts that
    runtime on SM120 too with this image's DeepGEMM. The entrypoint says so and starts anyway."""
    entrypoint = launch_profiles.load_entrypoint()
    no_cuda = str(tmp_path / "no-cuda")
    warning = entrypoint.deepgemm_warning({"PATH": str(tmp_path)}, no_cuda)
    assert warning is not None and warning.startswith("warning: SGLang starts DeepGEMM's JIT runtime")
    assert "set SGLANG_ENABLE_JIT_DEEPGEMM=0, or mount a CUDA toolkit and set CUDA_HOME" in warning
    assert warning.endswith("starting anyway")
    for off in ("0", "false", "False", "no"):
        assert entrypoint.deepgemm_warning({"PATH": str(tmp_path), "SGLANG_ENABLE_JIT_DEEPGEMM": off}, no_cuda) is None
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    assert entrypoint.deepgemm_warning({"PATH": str(tmp_path), "CUDA_HOME": str(toolkit)}, no_cuda) is not None  # not executable
    (toolkit / "bin" / "nvcc").chmod(0o755)
    assert entrypoint.deepgemm_warning({"PATH": str(tmp_path), "CUDA_HOME": str(toolkit)}, no_cuda) is None
    assert entrypoint.deepgemm_warning({"PATH": str(toolkit / "bin")}, no_cuda) is None
    assert entrypoint.deepgemm_warning({"PATH": str(tmp_path)}, str(toolkit)) is None
    # Started anyway, the warning on stderr, the proof profile (which turns DeepGEMM off) without it.
    proc = run_entrypoint(tmp_path, ["--model-path", "/m"], {})
    assert proc.returncode == 0 and proc.stdout.startswith("exec: -m sglang.launch_server")
    if not Path("/usr/local/cuda/bin/nvcc").exists():
        assert "warning: SGLang starts DeepGEMM's JIT runtime" in proc.stderr, proc.stderr
    proof = run_entrypoint(tmp_path, ["--print-profile", "kimi-k3-h200-proof"],
                           {"MODEL_PATH": "/models/p", "PORT": "30000"})
    assert proof.returncode == 0 and "DeepGEMM" not in proof.stderr, proof.stderr


def flashkda_site(site: Path, fwd: bool = True) -> Path:
    """`site` with an installed flash_kda distribution (a stand-in package, no extension)."""
    info = site / "flash_kda-0.0.1+1ce47ea.sm120a.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_kda\nVersion: 0.0.1+1ce47ea.sm120a\n")
    (site / "flash_kda").mkdir()
    (site / "flash_kda" / "__init__.py").write_text("def fwd(*args):\n    pass\n" if fwd else "")
    return site


def test_the_entrypoint_warning_with_flash_kda_installed(tmp_path: Path) -> None:
    site = flashkda_site(tmp_path / "site")
    proc = run_entrypoint(tmp_path, ["--model-path", "/m", "--linear-attn-prefill-backend", "flashkda"], {}, site)
    assert proc.returncode == 0 and "warning: the KDA prefill backend is FlashKDA" in proc.stderr
    assert "this image has no flash_kda" not in proc.stderr


@pytest.mark.parametrize("installed, fwd, why_not", [
    (False, True, "the image has no flash_kda (FlashKDA): build the image variant with --//image:kda_prefill=flashkda"),
    (True, False, "flash_kda 0.0.1+1ce47ea.sm120a imports but has no fwd()"),
    (True, True, None),
])
def test_the_flashkda_wheel_probe(tmp_path: Path, installed: bool, fwd: bool, why_not: str | None) -> None:
    # In a child interpreter: the probe imports flash_kda, which must not stay in this process.
    site = flashkda_site(tmp_path / "site", fwd) if installed else tmp_path
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from tools.image import profile_probe; "
            "print(json.dumps(profile_probe.FEATURES['flashkda-wheel']()))")
    proc = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result is None if why_not is None else result.startswith(why_not), result


def test_a_flashkda_profile_needs_the_wheel_in_the_image() -> None:
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    table = backend_needs.load_needs(launch_profiles.DEFAULT_NEEDS)
    profile = launch_profiles.load_profiles(FLASHKDA_PROFILES)[FLASHKDA_PROFILE]
    result = {**ok_result(FLASHKDA_PROFILE), "values": {**ok_result("x")["values"], "linear_attn_prefill_backend": "flashkda"},
              "flags": {**ok_result("x")["flags"], "linear_attn_prefill_backend": "--linear-attn-prefill-backend"}}
    missing = "the image has no flash_kda (FlashKDA): build the image variant with --//image:kda_prefill=flashkda"
    (bad,) = profile_verdicts.judge([profile], {FLASHKDA_PROFILE: result},
                                    {"situ-mxfp4-cutlass": None, "flashkda-wheel": missing}, cache, table, SGLANG_PYPI)
    assert not bad.ok and bad.line == (f"profile {FLASHKDA_PROFILE} ({FLASHKDA_PROFILE}.json): --linear-attn-prefill-backend "
                                       f"flashkda needs flashkda-wheel: {missing}")
    (good,) = profile_verdicts.judge([profile], {FLASHKDA_PROFILE: result},
                                     {"situ-mxfp4-cutlass": None, "flashkda-wheel": None}, cache, table, SGLANG_PYPI)
    assert good.ok and "flashkda-wheel" in good.line


@pytest.mark.parametrize("result,line", [
    ({"ok": False, "stage": "parse", "step": None, "error": "unrecognized arguments: --tp 4"},
     f"SGLang {SGLANG_PYPI} rejects its arguments: unrecognized arguments: --tp 4"),
    ({"ok": False, "stage": "resolve", "step": "handle_pd_disaggregation", "error": "bad threshold"},
     f"SGLang {SGLANG_PYPI} resolution rejects it in step handle_pd_disaggregation: bad threshold"),
    ({"ok": False, "stage": "guard", "step": None, "error": "PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True"},
     "the image's entrypoint guard refuses it: PYTORCH_CUDA_ALLOC_CONF sets expandable_segments:True"),
    ({"ok": False, "stage": "check", "step": None, "error": "tp_size must be divisible by number of nodes"},
     f"SGLang {SGLANG_PYPI} check_server_args rejects it: tp_size must be divisible by number of nodes"),
])
def test_probe_failures_are_one_line_naming_the_profile(result: dict, line: str) -> None:
    v = verdict({"profile": "kimi-k3-pd-prefill", **result}, image_caches.kernel_cache_of_plan(PYPI_PLAN))
    assert not v.ok and v.line == f"profile kimi-k3-pd-prefill (kimi-k3-pd-prefill.json): {line}"


def test_the_request_describes_the_image_target() -> None:
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    loaded = launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR)
    table = backend_needs.load_needs(launch_profiles.DEFAULT_NEEDS)
    request = profile_verdicts.probe_request(list(loaded.values()), table, cache, "/e", "/p", "/c")
    assert request["gpu_capability"] == [12, 0] and request["features"] == ["flashkda-wheel", "situ-mxfp4-cutlass"]
    assert "moe_runner_backend" in request["settings"] and "linear_attn_prefill_backend" in request["settings"]
    with pytest.raises(UserError, match="backend_needs.json is for arch '12.0f', the image's kernel cache for '9.0a'"):
        profile_verdicts.probe_request([], table, image_caches.KernelCache("t", "9.0a", "gpu-test-sm90", {}), "/e", "/p", "/c")


def test_parse_probe_output_reads_only_marked_lines() -> None:
    mark = profile_probe.MARK
    out = "\n".join(["noise", f"{mark}\t" + json.dumps({"sglang": SGLANG_PYPI}),
                     f"{mark}\t" + json.dumps({"feature": "situ-mxfp4-cutlass", "why_not": None, "error": None}),
                     f"{mark}\t" + json.dumps({"profile": "p", "ok": True})])
    results, features, sglang = profile_verdicts.parse_probe_output(out)
    assert results == {"p": {"profile": "p", "ok": True}} and features == {"situ-mxfp4-cutlass": None}
    assert sglang == SGLANG_PYPI


# ---------------------------------------------------------------- the probe's rules

def raise_from(filename: str, exc: BaseException) -> BaseException:
    """exc raised by code whose file is `filename` (as a torch.cuda frame would be)."""
    code = compile("def f(e):\n    raise e\n", filename, "exec")
    scope: dict = {}
    exec(code, scope)
    try:
        scope["f"](exc)
    except BaseException as e:
        return e
    raise AssertionError("not raised")


def test_skip_reasons() -> None:
    stand_in = profile_probe.checkpoint_stand_in({"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3"})
    assert stand_in.hf_config.architectures == ["KimiK3ForConditionalGeneration"]
    with pytest.raises(profile_probe.CheckpointValueNeeded, match="model_config.hf_config.num_hidden_layers"):
        stand_in.hf_config.num_hidden_layers
    with pytest.raises(AttributeError):
        stand_in.__deepcopy__  # copy protocol lookups are not checkpoint reads
    try:
        try:
            stand_in.attention_arch
        except profile_probe.CheckpointValueNeeded as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert profile_probe.skip_reason(outer) == "reads the checkpoint's model_config.attention_arch"
    gpu = raise_from("/usr/local/lib/python3.11/dist-packages/torch/cuda/__init__.py", RuntimeError("no driver"))
    assert profile_probe.skip_reason(gpu) == "queries the GPU (f in torch.cuda)"
    assert profile_probe.skip_reason(RuntimeError("x"), ["/sys/class/infiniband"]) == \
        "reads the node's hardware (/sys/class/infiniband), which a chroot has not"
    none = TypeError("'>' not supported between instances of 'NoneType' and 'int'")
    assert profile_probe.skip_reason(none) is None, "without a skipped step it is a failure"
    assert profile_probe.skip_reason(none, [], [["handle_gpu_memory_settings", "r"]]).startswith(
        "uses a value that skipped steps resolve in a launch (handle_gpu_memory_settings)")
    # SGLang rejecting a value is never a skip, even from a step that looked at the node.
    assert profile_probe.skip_reason(ValueError("--page-size must be a power of 2"), [], [["s", "r"]]) is None
    assert profile_probe.skip_reason(ValueError("Invalid IB devices specified"), ["/sys/class/infiniband"]) is None
    assert profile_probe.skip_reason(AssertionError("tp_size must be divisible"), ["/sys/x"], [["s", "r"]]) is None


def test_smoke_kimi_k3_checks_every_shipped_launch_profile() -> None:
    assert smoke.PROFILES["kimi-k3"]["launch_profiles"] == ["*"]
    assert "CUDA_VISIBLE_DEVICES=" in launch_profile_check.PROFILE_CHECK_ENV and "HF_HUB_OFFLINE=1" in launch_profile_check.PROFILE_CHECK_ENV


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---------------------------------------------------------------- first-use caches

JIT_LEAVES = ["sm_120f/situ_and_mul/build-aa/deps-11", "sm_120f/kda_fused_decode/build-bb/deps-22"]


def shipped_jit_dir(tmp_path: Path) -> Path:
    """An image's SGLang JIT directory: two leaves and the manifest that lists them."""
    shipped = tmp_path / "shipped"
    modules = []
    for leaf in JIT_LEAVES:
        module = leaf.split("/")[1]
        (shipped / leaf).mkdir(parents=True)
        (shipped / leaf / f"{module}.so").write_bytes(module.encode())
        (shipped / leaf / "sgl_deps.json").write_text("[]")
        modules.append({"call": f"sglang.kernels.ops.{module}:_jit_{module}_module", "args": [], "module": module,
                        "leaf": leaf, "so_sha256": hashlib.sha256(module.encode()).hexdigest()})
    (shipped / image_caches.SGLANG_JIT_MANIFEST).write_text(json.dumps({"arch": "12.0f", "modules": modules}))
    return shipped


def exec_env(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(line[len("env: "):].split("=", 1) for line in proc.stdout.splitlines() if line.startswith("env: "))


def test_the_entrypoint_links_the_shipped_sglang_jit_builds_into_a_writable_cache(tmp_path: Path) -> None:
    shipped = shipped_jit_dir(tmp_path)
    home = tmp_path / "home"
    for env, expected in (({"HOME": str(home)}, home / ".cache" / "sglang" / "jit"),
                          ({"HOME": str(home), "SGLANG_CACHE_DIR": str(tmp_path / "c")}, tmp_path / "c" / "jit"),
                          ({"HOME": str(home), "SGLANG_JIT_CACHE_DIR": str(tmp_path / "j")}, tmp_path / "j")):
        proc = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32"], {**SITE, **env}, jit_dir=shipped)
        assert proc.returncode == 0, proc.stderr
        assert exec_env(proc)["SGLANG_JIT_CACHE_DIR"] == str(expected)
        for leaf in JIT_LEAVES:
            link = expected / leaf
            assert link.is_symlink() and Path(os.readlink(link)) == shipped / leaf
            assert (link / f"{leaf.split('/')[1]}.so").is_file()
    # A second start keeps what is there: its own links, and a build SGLang published beside them.
    own = home / ".cache" / "sglang" / "jit" / "sm_120f" / "situ_and_mul" / "build-aa" / "deps-33"
    own.mkdir()
    again = run_entrypoint(tmp_path, ["--model-path", "/m"], {"HOME": str(home)}, jit_dir=shipped)
    assert again.returncode == 0, again.stderr
    assert own.is_dir() and not own.is_symlink()
    assert sorted(p.name for p in own.parent.iterdir()) == ["deps-11", "deps-33"]
    # An earlier image's link whose leaf this image does not ship is dropped (SGLang's lookup
    # stats every leaf of the directory, and a dangling one makes it a miss); another dangling
    # link, not into the image's directory, is the operator's and stays.
    (own.parent / "deps-00").symlink_to(shipped / "sm_120f" / "situ_and_mul" / "build-aa" / "deps-00")
    (own.parent / "deps-99").symlink_to(tmp_path / "elsewhere")
    again = run_entrypoint(tmp_path, ["--model-path", "/m"], {"HOME": str(home)}, jit_dir=shipped)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in own.parent.iterdir()) == ["deps-11", "deps-33", "deps-99"]


def test_the_entrypoint_refuses_a_cache_it_cannot_link_into_and_leaves_nothing(tmp_path: Path) -> None:
    shipped = shipped_jit_dir(tmp_path)
    root = tmp_path / "jit"
    # The first leaf links; the second's module directory is a file: the run fails there.
    (root / "sm_120f").mkdir(parents=True)
    (root / "sm_120f" / "kda_fused_decode").write_text("not a directory")
    proc = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32"], {**SITE, "SGLANG_JIT_CACHE_DIR": str(root)},
                          jit_dir=shipped)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: SGLANG_JIT_CACHE_DIR={root}: cannot link the image's prebuilt SGLang JIT modules")
    assert line.endswith("point SGLANG_JIT_CACHE_DIR (or SGLANG_CACHE_DIR) at a writable directory")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["sm_120f", "sm_120f/kda_fused_decode"]
    # A manifest that is not the build's: one line, nothing linked.
    (shipped / image_caches.SGLANG_JIT_MANIFEST).write_text('{"modules": [{"leaf": "../../etc"}]}')
    bad = run_entrypoint(tmp_path, ["--model-path", "/m"], {"SGLANG_JIT_CACHE_DIR": str(tmp_path / "j2")}, jit_dir=shipped)
    assert bad.returncode == 2 and "leaf '../../etc' is not a path inside" in bad.stderr
    assert not (tmp_path / "j2").exists()


def shipped_triton_dir(tmp_path: Path) -> Path:
    """A stand-in for the image's Triton directory: two entries and the manifest."""
    shipped = tmp_path / "triton-shipped"
    entries = {}
    for key, kernel in (("AAAA", "k1"), ("BBBB", "k2")):
        (shipped / key).mkdir(parents=True)
        files = {}
        for name in (f"{kernel}.cubin", f"{kernel}.json"):
            (shipped / key / name).write_bytes(name.encode())
            files[name] = hashlib.sha256(name.encode()).hexdigest()
        entries[key] = {"kernel": kernel, "files": files}
    (shipped / "CCCC").mkdir()
    (shipped / "CCCC" / DRIVER_FILE).write_bytes(b"\x7fELF stand-in")
    modules = [{"key": "CCCC", "module": "cuda_utils", "file": DRIVER_FILE,
                "env": {"TRITON_LIBCUDA_PATH": "/usr/lib/x86_64-linux-gnu"}}]
    (shipped / "kimi-k3-triton.json").write_text(json.dumps({"schema_version": 1, "entries": entries,
                                                             "modules": modules}))
    return shipped


DRIVER_FILE = "cuda_utils.cpython-311-x86_64-linux-gnu.so"


def test_the_entrypoint_binds_the_shipped_triton_kernels_into_a_writable_cache(tmp_path: Path) -> None:
    shipped = shipped_triton_dir(tmp_path)
    home = tmp_path / "home"
    for env, expected in (({"HOME": str(home)}, home / ".cache" / "sglang" / "triton"),
                          ({"HOME": str(home), "SGLANG_CACHE_DIR": str(tmp_path / "c")}, tmp_path / "c" / "triton"),
                          ({"HOME": str(home), "TRITON_CACHE_DIR": str(tmp_path / "t")}, tmp_path / "t")):
        proc = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32"], {**SITE, **env}, triton_dir=shipped)
        assert proc.returncode == 0, proc.stderr
        assert exec_env(proc)["TRITON_CACHE_DIR"] == str(expected)
        for key, kernel in (("AAAA", "k1"), ("BBBB", "k2")):
            group = json.loads((expected / key / f"__grp__{kernel}.json").read_text())
            assert group == {"child_paths": {n: str(shipped / key / n) for n in (f"{kernel}.cubin", f"{kernel}.json")}}
        assert sorted(p.name for p in expected.rglob("*") if p.is_file()) == [
            "__grp__k1.json", "__grp__k2.json", DRIVER_FILE]
        # Triton's driver module: a link to the shipped file where Triton looks it up, and the
        # TRITON_LIBCUDA_PATH it is keyed on.
        assert os.readlink(expected / "CCCC" / DRIVER_FILE) == str(shipped / "CCCC" / DRIVER_FILE)
        assert exec_env(proc)["TRITON_LIBCUDA_PATH"] == "/usr/lib/x86_64-linux-gnu"
    # What the directory has already is kept (Triton's own entry for the same key, a second start).
    own = tmp_path / "t" / "AAAA" / "__grp__k1.json"
    own.write_text("Triton's own")
    again = run_entrypoint(tmp_path, ["--model-path", "/m"], {"TRITON_CACHE_DIR": str(tmp_path / "t")}, triton_dir=shipped)
    assert again.returncode == 0, again.stderr
    assert own.read_text() == "Triton's own"


def test_the_entrypoint_refuses_a_triton_cache_it_cannot_write_and_leaves_nothing(tmp_path: Path) -> None:
    shipped = shipped_triton_dir(tmp_path)
    root = tmp_path / "triton"
    root.mkdir()
    (root / "BBBB").write_text("not a directory")  # the first entry is written, the second fails
    proc = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32"], {**SITE, "TRITON_CACHE_DIR": str(root)},
                          triton_dir=shipped)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: TRITON_CACHE_DIR={root}: cannot write the image's prebuilt Triton kernels' group files")
    assert line.endswith("point TRITON_CACHE_DIR (or SGLANG_CACHE_DIR) at a writable directory")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["BBBB"]
    # A manifest naming a path outside the directory: one line, nothing written.
    (shipped / "kimi-k3-triton.json").write_text(json.dumps({"entries": {"../x": {"kernel": "k", "files": {}}}}))
    bad = run_entrypoint(tmp_path, ["--model-path", "/m"], {"TRITON_CACHE_DIR": str(tmp_path / "t2")}, triton_dir=shipped)
    assert bad.returncode == 2 and "entry '../x' names '../x', not a file of" in bad.stderr
    assert not (tmp_path / "t2").exists()


def test_the_entrypoint_refuses_another_libcuda_path_than_the_triton_driver_module_is_keyed_on(tmp_path: Path) -> None:
    """Another TRITON_LIBCUDA_PATH would make Triton rebuild its driver module at the first
    kernel launch, with a compiler the image lacks: one line before anything is written."""
    shipped = shipped_triton_dir(tmp_path)
    root = tmp_path / "t"
    proc = run_entrypoint(tmp_path, ["--profile", "kimi-k3-tp32ep32"],
                          {**SITE, "TRITON_CACHE_DIR": str(root), "TRITON_LIBCUDA_PATH": "/usr/local/nvidia/lib64"},
                          triton_dir=shipped)
    assert proc.returncode == 2 and "exec:" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: TRITON_LIBCUDA_PATH=/usr/local/nvidia/lib64: the image's prebuilt Triton driver "
                           f"module ({DRIVER_FILE}) is keyed on TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu")
    assert line.endswith("loads from wherever the container runtime put it)") and "unset TRITON_LIBCUDA_PATH" in line
    assert not root.exists()
    same = run_entrypoint(tmp_path, ["--model-path", "/m"],
                          {"TRITON_CACHE_DIR": str(root), "TRITON_LIBCUDA_PATH": "/usr/lib/x86_64-linux-gnu"},
                          triton_dir=shipped)
    assert same.returncode == 0, same.stderr


def inventory_with(sites: dict[str, dict]) -> dict:
    return {"stack": "pypi", "sglang_version": SGLANG_PYPI, "profiles": {"kimi-k3-tp32ep32": {}}, "sites": sites}


def jit_site(call: str, profiles_: list[str] = ["kimi-k3-tp32ep32"]) -> dict:
    return {"kind": "sglang-jit", "status": "prebuilt", "profiles": profiles_, "name": call.split(":")[1],
            "specializations": {"prebuilt": [{"call": call, "args": []}]}}


def test_prebuilt_sites_must_be_in_the_image(tmp_path: Path) -> None:
    """The check's lookup of prebuilt sites: SGLang JIT builds in the image's manifest (its .so at
    the recorded sha256), FlashInfer modules in the kernel cache; a kind it cannot look up fails."""
    shipped = shipped_jit_dir(tmp_path)
    caches = image_caches.first_use_caches_of_image(shipped)
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    (profile,) = launch_profiles.select_profiles(launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR), ["kimi-k3-tp32ep32"])
    present = "sglang.kernels.ops.situ_and_mul:_jit_situ_and_mul_module"
    sites = {"sglang-jit:a.py:f": jit_site(present),
             "sglang-jit:b.py:g": jit_site(present, ["kimi-k3-pd-decode"]),  # another profile's: not judged
             "flashinfer:x.py:flashinfer.fused_moe.cutlass_fused_moe": {
                 "kind": "flashinfer", "status": "prebuilt", "name": "flashinfer.fused_moe.cutlass_fused_moe",
                 "profiles": ["kimi-k3-tp32ep32"], "specializations": {"prebuilt": [{"module": "fused_moe_120"}]}}}
    assert profile_verdicts._check_prebuilt(profile, inventory_with(sites), cache, caches) == ([], 2)
    missing = "sglang.kernels.ops.other:_jit_other_module"
    damaged = "sglang.kernels.ops.kda_fused_decode:_jit_kda_fused_decode_module"
    (shipped / JIT_LEAVES[1] / "kda_fused_decode.so").write_bytes(b"changed")
    caches = image_caches.first_use_caches_of_image(shipped)
    bad = {**sites, "sglang-jit:c.py:h": jit_site(missing), "sglang-jit:d.py:k": jit_site(damaged),
           "flashinfer:kernel_cache:nope": {"kind": "flashinfer", "status": "prebuilt", "name": "nope",
                                            "profiles": ["kimi-k3-tp32ep32"],
                                            "specializations": {"prebuilt": [{"module": "nope"}]}},
           "flashinfer:y.py:f": {"kind": "flashinfer", "status": "prebuilt", "name": "f", "profiles": ["kimi-k3-tp32ep32"],
                                 "specializations": {}},
           "triton:e.py:kern": {"kind": "triton", "status": "prebuilt", "name": "kern", "profiles": ["kimi-k3-tp32ep32"],
                                "specializations": {"prebuilt": [{"key": "k"}]}}}
    problems, checked = profile_verdicts._check_prebuilt(profile, inventory_with(bad), cache, caches)
    assert checked == 7 and len(problems) == 5
    text = "\n".join(problems)
    assert f"reaches sglang-jit:c.py:h, which jit_cache/inventory.pypi.json marks prebuilt ({missing} []), and the image " \
           "lacks it: no entry for it in the image's /usr/share/kimi-k3/sglang-jit/kimi-k3-sglang-jit.json" in text
    assert f"({damaged} []), and the image lacks it: its {JIT_LEAVES[1]}/kda_fused_decode.so is not the sha256" in text
    assert "the image's kernel cache" in text and "lacks its module nope" in text
    assert "flashinfer:y.py:f: jit_cache/inventory.pypi.json marks it prebuilt without what the image holds" in text
    assert "cannot look up a prebuilt triton site in the image" in text
    # An image with no manifest has none of them; a profile the inventory does not list is judged
    # against every prebuilt site.
    none = image_caches.first_use_caches_of_image(tmp_path / "nothing")
    (other,) = launch_profiles.select_profiles(launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR), ["kimi-k3-pd-decode"])
    problems, checked = profile_verdicts._check_prebuilt(other, {**inventory_with(sites), "profiles": {}}, cache, none)
    assert checked == 3 and len(problems) == 2 and "no entry for it in the image (no " in problems[0]


def test_prebuilt_triton_sites_must_be_run_by_the_calls_the_triton_layer_is_built_from(tmp_path: Path) -> None:
    """A Triton site marked prebuilt is looked up in jit_cache/triton_calls.json (the calls the
    image's Triton layer is built from, whose kernels its build checks): a site those calls do not
    run, or run with other args, fails naming it; without the calls the kind cannot be looked up."""
    calls = Path("jit_cache/triton_calls.json")
    plan = image_caches.triton_plan(calls, "pypi")
    (file, name), runs = next(iter(sorted(plan.items())))
    caches = dataclasses.replace(image_caches.first_use_caches_of_image(tmp_path / "nothing"), triton=plan)
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    (profile,) = launch_profiles.select_profiles(launch_profiles.load_profiles(launch_profiles.DEFAULT_PROFILES_DIR), ["kimi-k3-tp32ep32"])

    def site(file_: str, name_: str, builds: list) -> dict:
        return {"kind": "triton", "status": "prebuilt", "file": file_, "name": name_, "profiles": ["kimi-k3-tp32ep32"],
                "specializations": {"prebuilt": builds}}

    good = {f"triton:{file}:{name}": site(file, name, runs)}
    assert profile_verdicts._check_prebuilt(profile, inventory_with(good), cache, caches) == ([], 1)
    other_args = [{"call": runs[0]["call"], "args": {**runs[0]["args"], "heads": 7}}]
    bad = {**good, "triton:x.py:kern": site("x.py", "kern", runs[:1]), f"triton:{file}:{name}#2": site(file, name, other_args)}
    problems, checked = profile_verdicts._check_prebuilt(profile, inventory_with(bad), cache, caches)
    assert checked == 3 and len(problems) == 2, problems
    assert all("the calls the image's Triton layer is built from (jit_cache/triton_calls.json) do not run it" in p
               for p in problems), problems
    assert '"heads": 7' in "\n".join(problems)
    problems, _ = profile_verdicts._check_prebuilt(profile, inventory_with(good), cache, image_caches.first_use_caches_of_image(tmp_path / "n"))
    assert problems and "(for Triton: give it jit_cache/triton_calls.json)" in problems[0]


def test_an_inventory_of_another_sglang_is_refused() -> None:
    cache = image_caches.kernel_cache_of_plan(PYPI_PLAN)
    with pytest.raises(UserError, match="the inventory of stack pypi is for SGLang 0.0.1, the image has SGLang"):
        profile_verdicts.judge([], {}, {}, cache, {}, SGLANG_PYPI + "+kimik3.0", {**inventory_with({}), "sglang_version": "0.0.1"})
    assert profile_verdicts.judge([], {}, {}, cache, {}, SGLANG_PYPI + "+kimik3.e0dfccb6", inventory_with({})) == []
