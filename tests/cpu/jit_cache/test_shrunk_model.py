"""The H200 proof's inputs without a GPU: the shrunk Kimi-K3 config (tools/jit_cache/shrunk_model.py)
keeps every real dimension of jit_cache/checkpoint_facts.json and has a KDA, an MLA and a MoE
layer after the dense first one, within the weight budget; the workload file is well formed and
a malformed entry is refused in one line; the stdlib-only runner (tools/jit_cache/workload.py),
against a fake SGLang in this process, sends the workload's requests and writes their timings.
With KIMI_SGLANG_TREE (an unpacked sglang package directory, e.g. of the pinned 0.5.23 wheel),
the config's keys are also checked against that tree's KimiLinearConfig and kimi_k3.py, read as
source: loading SGLang's KimiK3Config itself needs torch (configs/mamba_utils.py imports it)."""
from __future__ import annotations

import ast
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tools.common.errors import UserError
from tools.common.jsonfmt import review_json
from tools.jit_cache import shrunk_model, workload

REPO_ROOT = Path(__file__).absolute().parents[3]
WORKLOAD = REPO_ROOT / "jit_cache" / "workload.json"


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return shrunk_model.load_facts()


@pytest.fixture(scope="module")
def served(facts: dict[str, Any]) -> dict[str, Any]:
    return json.loads((REPO_ROOT / "jit_cache" / "h200_model" / "config.json").read_text())


def test_checked_in_config_is_what_the_facts_give(facts: dict[str, Any], served: dict[str, Any]) -> None:
    assert (REPO_ROOT / "jit_cache" / "h200_model" / "config.json").read_bytes() == review_json(
        shrunk_model.served_config(facts))
    assert served["architectures"] == ["KimiK3LinearForCausalLM"] and served["model_type"] == "kimi_linear"
    assert "quantization_config" not in served  # BF16 experts: SM90 has no MXFP8 x MXFP4 MoE


def test_every_real_dimension_is_kept(facts: dict[str, Any], served: dict[str, Any]) -> None:
    lac = served["linear_attn_config"]
    kept = {
        "hidden_size": served["hidden_size"], "num_attention_heads": served["num_attention_heads"],
        "num_kv_heads_kda": lac["num_heads"], "kda_head_dim": lac["head_dim"],
        "kda_short_conv_kernel_size": lac["short_conv_kernel_size"],
        "kda_use_full_rank_gate": lac["use_full_rank_gate"], "kda_gate_lower_bound": lac["gate_lower_bound"],
        "mla_kv_lora_rank": served["kv_lora_rank"], "mla_qk_rope_head_dim": served["qk_rope_head_dim"],
        "mla_qk_head_dim": served["qk_nope_head_dim"] + served["qk_rope_head_dim"],
        "mla_v_head_dim": served["v_head_dim"], "mla_q_lora_rank": served["q_lora_rank"],
        "num_experts": served["num_experts"], "num_experts_per_tok": served["num_experts_per_token"],
        "num_shared_experts": served["num_shared_experts"], "moe_intermediate_size": served["moe_intermediate_size"],
        "routed_expert_hidden_size": served["routed_expert_hidden_size"], "hidden_act": served["hidden_act"],
        "activation_situ_beta": served["activation_situ_beta"],
        "activation_situ_linear_beta": served["activation_situ_linear_beta"],
        "first_k_dense_replace": served["first_k_dense_replace"], "vocab_size": served["vocab_size"],
        "intermediate_size": served["intermediate_size"], "attn_res_block_size": served["attn_res_block_size"],
    }
    assert kept == {name: facts[name] for name in kept}
    # the layer count is the one change
    assert facts["num_hidden_layers"] == 93 and served["num_hidden_layers"] == shrunk_model.NUM_LAYERS


def test_layers_cover_every_kind_within_the_budget(served: dict[str, Any]) -> None:
    kinds = shrunk_model.layer_kinds(served)
    assert kinds == [("kda", "dense"), ("mla", "moe")]
    parts = dict(shrunk_model.weight_bytes(served))
    assert parts["layer 1 routed experts"] == 896 * 3 * 3584 * 3072 * 2
    total = sum(parts.values())
    assert 60e9 < total < shrunk_model.WEIGHT_BUDGET_BYTES
    # a second MoE layer would not fit: why the model has two layers
    assert total + parts["layer 1 routed experts"] > shrunk_model.WEIGHT_BUDGET_BYTES


def test_vl_form_wraps_the_same_text_config(facts: dict[str, Any]) -> None:
    vl = shrunk_model.vl_config(facts)
    assert vl["architectures"] == ["KimiK3ForConditionalGeneration"] and vl["model_type"] == "kimi_k3"
    assert vl["text_config"] == shrunk_model.text_config(facts)


def test_a_null_fact_is_one_line(tmp_path: Path) -> None:
    data = json.loads((REPO_ROOT / "jit_cache" / "checkpoint_facts.json").read_text())
    data["architectures"]["KimiK3ForConditionalGeneration"]["facts"]["hidden_size"]["value"] = None
    bad = tmp_path / "facts.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        shrunk_model.load_facts(bad)
    assert "\n" not in str(e.value) and "hidden_size" in str(e.value) and str(bad) in str(e.value)


def test_a_changed_dimension_is_refused(facts: dict[str, Any]) -> None:
    config = shrunk_model.served_config(facts)
    config["hidden_size"] = 4096
    with pytest.raises(UserError) as e:
        shrunk_model.check_config(config, facts)
    assert "\n" not in str(e.value) and "hidden_size" in str(e.value)
    config = shrunk_model.served_config(facts)
    config["linear_attn_config"] = {**config["linear_attn_config"], "kda_layers": [1, 2], "full_attn_layers": []}
    with pytest.raises(UserError) as e:
        shrunk_model.check_config(config, facts)
    assert "linear_attn_config" in str(e.value)


SGLANG_TREE = os.environ.get("KIMI_SGLANG_TREE")


@pytest.mark.skipif(not SGLANG_TREE, reason="KIMI_SGLANG_TREE (an unpacked sglang package directory) unset")
def test_config_keys_are_sglangs(served: dict[str, Any]) -> None:
    tree = Path(SGLANG_TREE or "")
    module = ast.parse((tree / "srt" / "configs" / "kimi_linear.py").read_text())
    init = next(node for cls in module.body if isinstance(cls, ast.ClassDef) and cls.name == "KimiLinearConfig"
                for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    params = {a.arg for a in init.args.args + init.args.kwonlyargs} | {"architectures", "torch_dtype"}
    assert sorted(set(served) - params) == []
    # every linear_attn_config key kimi_k3.py subscripts must be there
    model = ast.parse((tree / "srt" / "models" / "kimi_k3.py").read_text())
    required = {node.slice.value for node in ast.walk(model)
                if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "linear_attn_config"}
    assert required and required <= set(served["linear_attn_config"])


# --- the workload and its runner -------------------------------------------------------------


def test_checked_in_workload() -> None:
    data = workload.load_workload(WORKLOAD)
    lens = [s["prompt_len"] for s in data["steps"]]
    assert {1, 64, 2048, 8192, 8193} <= set(lens)
    assert max(s.get("concurrency", 1) for s in data["steps"]) > 8  # above --cuda-graph-max-bs-decode
    assert any(s.get("return_logprob") and s.get("top_logprobs_num") for s in data["steps"])
    assert [s["name"] for s in data["skipped"]] == ["image"]
    profile = json.loads((REPO_ROOT / "image" / "profiles" / "kimi-k3-h200-proof.json").read_text())
    args = profile["args"]
    assert args[args.index("--chunked-prefill-size") + 1] == "8192"
    assert args[args.index("--cuda-graph-max-bs-decode") + 1] == "8"
    assert data["token_ids_below"] <= json.loads(
        (REPO_ROOT / "jit_cache" / "h200_model" / "config.json").read_text())["vocab_size"]


def test_a_key_twice_or_truncated_json_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "workload.json"
    for text, named in (('{"seed": 1, "seed": 2}', "key 'seed' given twice"), ('{"seed": ', "not JSON")):
        path.write_text(text)
        with pytest.raises(workload.WorkloadError) as e:
            workload.load_workload(path)
        assert "\n" not in str(e.value) and named in str(e.value)


@pytest.mark.parametrize("mutate, named", [
    (lambda d: d["steps"][2].update(prompt_len="2048"), "steps[2] (prompt-2048): prompt_len"),
    (lambda d: d["steps"][0].update(sampling={"temprature": 0.0}), "steps[0] (prompt-1) sampling: unknown sampling parameter 'temprature'"),
    (lambda d: d["steps"][1].update(sampling={"top_k": True}), "steps[1] (prompt-64) sampling.top_k"),
    (lambda d: d["steps"][3].update(concurrency=0), "steps[3] (prompt-8192): concurrency"),
    (lambda d: d["steps"][4].update(extra=1), "steps[4] (prompt-8193): unknown keys ['extra']"),
    (lambda d: d["steps"][1].update(name="prompt-1"), "steps[1] (prompt-1): name"),
    (lambda d: d["steps"][0].update(top_logprobs_num=5), "top_logprobs_num"),
    (lambda d: d.update(seed="38"), "seed"),
])
def test_malformed_workload_is_one_line(tmp_path: Path, mutate: Any, named: str) -> None:
    data = json.loads(WORKLOAD.read_text())
    mutate(data)
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(data))
    with pytest.raises(workload.WorkloadError) as e:
        workload.load_workload(path)
    assert "\n" not in str(e.value) and named in str(e.value) and str(path) in str(e.value)
    # as a script: the same line, exit 2
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "jit_cache" / "workload.py"),
                          "--workload", str(path), "--url", "http://127.0.0.1:9"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and named in run.stderr


class FakeSGLang(http.server.ThreadingHTTPServer):
    """/health_generate (503 for the first `not_ready` polls) and a streaming /generate that
    answers max_new_tokens chunks the way SGLang's skip-tokenizer-init path does."""
    daemon_threads = True

    def __init__(self, not_ready: int = 2) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.not_ready = not_ready
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeSGLang

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/health_generate":
            self.send_error(404)
            return
        with self.server.lock:
            ready = self.server.not_ready <= 0
            self.server.not_ready -= 1
        self.send_response(200 if ready else 503)
        self.end_headers()

    def do_POST(self) -> None:
        if self.path != "/generate":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["sampling_params"]["max_new_tokens"]
        for i in range(1, n + 1):
            meta = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": i,
                    "finish_reason": {"type": "length", "length": n} if i == n else None}
            if body.get("return_logprob"):
                meta["output_top_logprobs"] = [[[-0.1, 5, None]] * body["top_logprobs_num"]] * i
            chunk = {"output_ids": list(range(i)), "meta_info": meta}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server() -> Iterator[FakeSGLang]:
    server = FakeSGLang()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_runner_sends_the_workload_and_writes_timings(tmp_path: Path, fake_server: FakeSGLang,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = workload.load_workload(WORKLOAD)
    out = tmp_path / "timings.json"
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    assert workload.main(["--workload", str(WORKLOAD), "--url", url, "--wait-ready", "30", "--out", str(out)]) == 0
    expected = sum(s.get("concurrency", 1) for s in data["steps"])
    assert len(fake_server.bodies) == expected
    for body in fake_server.bodies:
        assert body["stream"] is True and body["sampling_params"]["max_new_tokens"] == 8
        assert body["sampling_params"]["ignore_eos"] is True
        assert all(0 < t < data["token_ids_below"] for t in body["input_ids"])
    assert sorted({len(b["input_ids"]) for b in fake_server.bodies}) == [1, 64, 2048, 8192, 8193]
    logprob = [b for b in fake_server.bodies if b.get("return_logprob")]
    assert len(logprob) == 1 and logprob[0]["top_logprobs_num"] == 5
    assert any(b["sampling_params"].get("min_p") == 0.05 for b in fake_server.bodies)
    # the same prompts every run, different ones per request of a step
    step = next(s for s in data["steps"] if s["name"] == "concurrent-12")
    assert workload.prompt_ids(data, step, 0) == workload.prompt_ids(data, step, 0)
    assert workload.prompt_ids(data, step, 0) != workload.prompt_ids(data, step, 1)

    timings = json.loads(out.read_text())
    assert timings["failed"] == 0 and timings["ready_s"] is not None and len(timings["requests"]) == expected
    for row in timings["requests"]:
        assert 0 <= row["ttft_s"] <= row["total_s"] and row["output_tokens"] == 8 and row["error"] is None
    assert [s["step"] for s in timings["steps"]] == [s["name"] for s in data["steps"]]
    printed = capsys.readouterr().out
    assert "skipped image:" in printed and "concurrent-12" in printed and "ttft_s" in printed


def test_runner_reports_a_failed_request(tmp_path: Path, fake_server: FakeSGLang) -> None:
    data = json.loads(WORKLOAD.read_text())
    data["steps"] = [data["steps"][0]]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    bad_url = f"http://127.0.0.1:{fake_server.server_address[1]}/nowhere"
    out = tmp_path / "t.json"
    assert workload.main(["--workload", str(path), "--url", bad_url, "--out", str(out)]) == 1
    row = json.loads(out.read_text())["requests"][0]
    assert row["error"].startswith("HTTP 404")


def test_runner_gives_up_waiting_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert workload.main(["--workload", str(WORKLOAD), "--url", "http://127.0.0.1:9", "--wait-ready", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not ready after" in err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
