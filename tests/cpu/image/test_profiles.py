"""Launch profiles without an image (tag cpu, seconds): their format, the entrypoint's --profile and
--print-profile, the needs table and verdicts, the kernel-cache facts, the probe's skip rules.

The check against a real image (its SGLang) is test_profiles_image.py (:profiles_check_pypi).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.conftest import stack_version
from tools.common.errors import UserError
from tools.image import profile_probe, profiles, smoke

REPO_ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = REPO_ROOT / "image" / "entrypoint.py"
PYPI_PLAN = REPO_ROOT / "kernel_cache" / "plan_120f_kimi-k3.pypi.bzl"
# The SGLang version the probe reports (as the pypi stack's image would).
SGLANG_PYPI = stack_version("pypi", "sglang")
ROLES = ["kimi-k3-pd-decode", "kimi-k3-pd-prefill", "kimi-k3-tp32ep32"]


def write_profile(directory: Path, name: str, **changes: object) -> Path:
    data = json.loads((profiles.DEFAULT_PROFILES_DIR / "kimi-k3-pd-prefill.json").read_text())
    data.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the profiles and their format

def test_the_three_roles_are_valid_profiles() -> None:
    loaded = profiles.load_profiles(profiles.DEFAULT_PROFILES_DIR)
    assert sorted(loaded) == ROLES
    profiles.load_needs(profiles.DEFAULT_NEEDS)
    for p in loaded.values():
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
             for n, p in loaded.items()}
    assert sizes["kimi-k3-tp32ep32"] == {"--tp-size": "32", "--ep-size": "32"}
    assert sizes["kimi-k3-pd-prefill"] == {"--tp-size": "4", "--ep-size": "4"}
    assert sizes["kimi-k3-pd-decode"] == {"--tp-size": "32", "--ep-size": "4"}


@pytest.mark.parametrize("changes,message", [
    ({"args": ["--model-path", "${MODEL_PATH}", "--port", "${PROT}"]}, "used but not declared ['PROT']"),
    ({"placeholders": {"MODEL_PATH": {"description": "d", "example": "/m"}}}, "used but not declared"),
    ({"checkpoint": {"placeholder": "MODEL_PATH", "config": {"architectures": ["X"], "model_type": "x",
                                                             "num_hidden_layers": 61}}},
     "the only checkpoint facts the check may assume"),
    ({"needs": {}}, "kernel_selection"),
    ({"schema_version": 2}, "not a launch profile"),
    ({"args": ["--port", 30000]}, "args[1]: expected a non-empty string"),
    ({"extra": 1}, "unknown keys ['extra']"),
])
def test_a_malformed_profile_is_one_line_naming_the_file(tmp_path: Path, changes: dict, message: str) -> None:
    path = write_profile(tmp_path, "broken", **changes)
    with pytest.raises(UserError) as e:
        profiles.load_profiles(tmp_path)
    assert str(e.value).startswith(f"profile {path}") and message in str(e.value) and "\n" not in str(e.value)


def test_a_declared_placeholder_nothing_uses_is_refused(tmp_path: Path) -> None:
    data = json.loads((profiles.DEFAULT_PROFILES_DIR / "kimi-k3-tp32ep32.json").read_text())
    data["placeholders"]["UNUSED"] = {"description": "d", "example": "e"}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"declared but not used \['UNUSED'\]"):
        profiles.load_profiles(tmp_path)


def test_the_needs_table_names_only_features_the_probe_knows(tmp_path: Path) -> None:
    table = json.loads(profiles.DEFAULT_NEEDS.read_text())
    table["settings"]["moe_runner_backend"]["flashinfer_mxfp4"]["features"] = ["situ-typo"]
    path = tmp_path / "needs.json"
    path.write_text(json.dumps(table))
    with pytest.raises(UserError, match="feature 'situ-typo' has no probe; known: situ-mxfp4-cutlass"):
        profiles.load_needs(path)


def test_image_paths_agree_with_constants_and_the_entrypoint() -> None:
    constants = (REPO_ROOT / "image" / "constants.bzl").read_text()
    values = dict(re.findall(r'^([A-Z_]+) = "([^"]*)"', constants, re.M))
    assert values["ENTRYPOINT"] == profiles.ENTRYPOINT_IMAGE_PATH
    assert values["PROFILES_DIR"] == profiles.PROFILES_IMAGE_PATH
    assert profiles.load_entrypoint().PROFILES_DIR == profiles.PROFILES_IMAGE_PATH


# ---------------------------------------------------------------- the entrypoint

def run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The entrypoint with profiles from image/profiles and a python3 that prints its exec."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "python3").write_text("#!/bin/sh\necho \"exec: $*\"\nenv | sort | sed 's/^/env: /'\n")
    (fake_bin / "python3").chmod(0o755)
    script = tmp_path / "entrypoint.py"
    text = ENTRYPOINT.read_text()
    # The shipped path, pointed at the repository's profiles (the image has them there).
    script.write_text(text.replace(f'PROFILES_DIR = "{profiles.PROFILES_IMAGE_PATH}"',
                                   f'PROFILES_DIR = "{profiles.DEFAULT_PROFILES_DIR}"'))
    assert script.read_text() != text
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env={"PATH": f"{fake_bin}:/usr/bin:/bin", **env})


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


def test_profiles_show_uses_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert profiles.main(["show", "kimi-k3-tp32ep32"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("env FLASHINFER_DISABLE_JIT=1 GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 "
                          "kimi-k3-entrypoint --model-path /models/kimi-k3 --trust-remote-code --tp-size 32")


# ---------------------------------------------------------------- kernel cache facts and verdicts

def test_kernel_cache_from_the_plan_and_from_the_image(tmp_path: Path) -> None:
    plan = profiles.kernel_cache_of_plan(PYPI_PLAN)
    assert (plan.arch, plan.selection) == ("12.0f", "kimi-k3")
    assert plan.modules["fused_moe_120"] == ("CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>",)
    assert plan.modules["norm"] is None
    aot = tmp_path / "site" / profiles.AOT_DIR
    for name in ("norm", "fused_moe_120"):
        (aot / name).mkdir(parents=True)
    (aot / "norm" / "norm.so").write_bytes(b"\x7fELF")
    (aot / profiles.CACHE_JSON).write_text(json.dumps({"arch_list": "12.0f", "modules": {
        "norm": {"path": "norm/norm.so"},
        "fused_moe_120": {"path": "fused_moe_120/fused_moe_120.so", "kernel_selection": {"name": "kimi-k3", "runners": ["R"]}},
    }}))
    image = profiles.kernel_cache_of_image(tmp_path / "site")
    assert image.selection == "full" and dict(image.modules) == {"norm": None}, "a module without its .so is absent"
    with pytest.raises(UserError, match="carries no kernel cache; for an image assembled without"):
        profiles.kernel_cache_of_image(tmp_path / "empty")
    assert profiles.capability_of("12.0f") == (12, 0) and profiles.capability_of("9.0a") == (9, 0)


def ok_result(name: str, moe: str = "flashinfer_mxfp4", attention: str | None = None) -> dict:
    return {"profile": name, "ok": True, "stage": "done", "args": ["--x"], "ran": ["a", "b", "check_server_args"],
            "skipped": [["handle_gpu_memory_settings", "reads the checkpoint's model_config.attention_arch"]],
            "stopped": None, "not_reached": [],
            "values": {"moe_runner_backend": moe, "attention_backend": attention, "sampling_backend": "flashinfer"},
            "flags": {"moe_runner_backend": "--moe-runner-backend", "attention_backend": "--attention-backend",
                      "sampling_backend": "--sampling-backend"}}


def verdict(result: dict, cache: profiles.KernelCache, features: dict | None = None) -> profiles.Verdict:
    loaded = profiles.load_profiles(profiles.DEFAULT_PROFILES_DIR)
    table = profiles.load_needs(profiles.DEFAULT_NEEDS)
    (v,) = profiles.judge([loaded[result["profile"]]], {result["profile"]: result},
                          features if features is not None else {"situ-mxfp4-cutlass": None}, cache, table, SGLANG_PYPI)
    return v


def test_verdicts_name_what_the_image_lacks() -> None:
    cache = profiles.kernel_cache_of_plan(PYPI_PLAN)
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

    other_runners = profiles.KernelCache("test", "12.0f", "kimi-k3", {**cache.modules, "fused_moe_120": ("CutlassMoeFCRunner<__nv_bfloat16, __nv_bfloat16>",)})
    runner = verdict(ok_result("kimi-k3-tp32ep32"), other_runners)
    assert not runner.ok and "needs fused_moe_120 with CutlassMoeFCRunner<__nv_fp8_e4m3, Fp4Type, __nv_bfloat16>" in runner.line
    full = profiles.KernelCache("test", "12.0f", "full", {m: None for m in cache.modules})
    assert verdict(ok_result("kimi-k3-tp32ep32"), full).ok, "a full cache compiles every runner"
    other_selection = profiles.KernelCache("test", "12.0f", "gpu-test-sm90", cache.modules)
    sel = verdict(ok_result("kimi-k3-tp32ep32"), other_selection)
    assert not sel.ok and "needs kernel selection kimi-k3, the image's kernel cache is selection gpu-test-sm90" in sel.line
    no_sampling = profiles.KernelCache("test", "12.0f", "kimi-k3", {m: r for m, r in cache.modules.items() if m != "sampling"})
    samp = verdict(ok_result("kimi-k3-tp32ep32"), no_sampling)
    assert not samp.ok and "--sampling-backend flashinfer needs FlashInfer module sampling" in samp.line


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
    v = verdict({"profile": "kimi-k3-pd-prefill", **result}, profiles.kernel_cache_of_plan(PYPI_PLAN))
    assert not v.ok and v.line == f"profile kimi-k3-pd-prefill (kimi-k3-pd-prefill.json): {line}"


def test_the_request_describes_the_image_target() -> None:
    cache = profiles.kernel_cache_of_plan(PYPI_PLAN)
    loaded = profiles.load_profiles(profiles.DEFAULT_PROFILES_DIR)
    table = profiles.load_needs(profiles.DEFAULT_NEEDS)
    request = profiles.probe_request(list(loaded.values()), table, cache, "/e", "/p", "/c")
    assert request["gpu_capability"] == [12, 0] and request["features"] == ["situ-mxfp4-cutlass"]
    assert "moe_runner_backend" in request["settings"]
    with pytest.raises(UserError, match="backend_needs.json is for arch '12.0f', the image's kernel cache for '9.0a'"):
        profiles.probe_request([], table, profiles.KernelCache("t", "9.0a", "gpu-test-sm90", {}), "/e", "/p", "/c")


def test_parse_probe_output_reads_only_marked_lines() -> None:
    mark = profile_probe.MARK
    out = "\n".join(["noise", f"{mark}\t" + json.dumps({"sglang": SGLANG_PYPI}),
                     f"{mark}\t" + json.dumps({"feature": "situ-mxfp4-cutlass", "why_not": None, "error": None}),
                     f"{mark}\t" + json.dumps({"profile": "p", "ok": True})])
    results, features, sglang = profiles.parse_probe_output(out)
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
    assert "CUDA_VISIBLE_DEVICES=" in smoke.PROFILE_CHECK_ENV and "HF_HUB_OFFLINE=1" in smoke.PROFILE_CHECK_ENV


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
