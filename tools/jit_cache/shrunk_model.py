"""The shrunk Kimi-K3 the H200 proof serves: the real model's dimensions from
jit_cache/checkpoint_facts.json, two layers instead of 93, written as the config.json SGLang
loads with `--load-format dummy` (random weights, no checkpoint files).

Why two layers: one MoE layer's routed experts in BF16 are 896 x 3 x 3584 x 3072 x 2 bytes =
59.2 GB (Latent MoE: the experts run in routed_expert_hidden_size 3584, not the hidden 7168), so
a second MoE layer takes the weights past 100 GB on a 141 GB H200. Layer 0 is the real model's
dense layer (first_k_dense_replace 1) on KDA, layer 1 a MoE layer on MLA: every kind of layer
the real model has, each once.

Why KimiK3LinearForCausalLM and not KimiK3ForConditionalGeneration: for a multimodal model
SGLang's tokenizer manager loads the HF processor (AutoProcessor from the model directory) even
with --skip-tokenizer-init (sglang/srt/managers/tokenizer_manager.py
init_tokenizer_and_processor), and Kimi's processor and tiktoken tokenizer are trust_remote_code
files no pin of this repository holds; --language-model-only, which skips the processor, refuses
Kimi-K3 (server_args.py LANGUAGE_MODEL_ONLY_ARCHITECTURES). KimiK3LinearForCausalLM is the
text-only EntryClass of the same sglang/srt/models/kimi_k3.py, and its config is what SGLang's own
expert-pack runtime writes for text-only Kimi-K3 (model_loader/expert_pack_runtime.py
prepare_kimi_model_metadata: text_config, architectures KimiK3LinearForCausalLM, model_type
kimi_linear, no quantization_config). `vl_config` gives the KimiK3ForConditionalGeneration form
of the same text config, for the CPU tests.

    python3 -m tools.jit_cache.shrunk_model write     # jit_cache/h200_model/config.json
    python3 -m tools.jit_cache.shrunk_model check     # the checked-in file is what the facts give
    python3 -m tools.jit_cache.shrunk_model memory    # the BF16 weight estimate, per part
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from tools.common.errors import UserError, run_cli
from tools.common.jsondata import load_json_file
from tools.common.jsonfmt import review_json
from tools.jit_cache.inventory import CHECKPOINT_FACT_SCHEMA

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_VALUES_FILE = REPO / "jit_cache" / "checkpoint_facts.json"
OUT_DIR = REPO / "jit_cache" / "h200_model"
ARCH = "KimiK3ForConditionalGeneration"

# The one change from the real model. Layer ids in linear_attn_config are 1-based
# (configs/kimi_linear.py is_kda_layer: layer_idx + 1 in kda_layers).
NUM_LAYERS = 2
KDA_LAYERS = [1]
FULL_ATTN_LAYERS = [2]

# Values the facts leave null (no pinned input gives them); each fact's source says why these.
CONTEXT_LENGTH = 131072
RMS_NORM_EPS = 1e-5
# Kimi tokenizer special ids are not pinned anywhere; the workload sends ignore_eos, so these
# only need to be inside the vocabulary.
BOS_TOKEN_ID = 163584
EOS_TOKEN_ID = 163585

# What the proof's GPU must hold besides the weights is SGLang's KV/state pool and activations:
# the weights stay under this (141 GB card).
WEIGHT_BUDGET_BYTES = 100 * 10**9
BF16 = 2

# Facts a config value is taken from; a null among them is a missing input, not a default.
REQUIRED_CHECKPOINT_VALUES = ("hidden_size", "num_attention_heads", "num_kv_heads_kda", "kda_head_dim",
                  "kda_short_conv_kernel_size", "kda_use_full_rank_gate", "kda_gate_lower_bound",
                  "mla_kv_lora_rank", "mla_qk_rope_head_dim", "mla_qk_head_dim", "mla_v_head_dim",
                  "mla_q_lora_rank", "mla_use_output_gate", "num_experts", "num_experts_per_tok",
                  "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
                  "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
                  "latent_moe_use_norm", "first_k_dense_replace", "moe_layer_freq",
                  "attn_res_block_size", "intermediate_size", "vocab_size", "num_hidden_layers")


def load_facts(path: Path = CHECKPOINT_VALUES_FILE) -> dict[str, Any]:
    """The Kimi-K3 facts' values, or a UserError naming the file and the null fact."""
    data = load_json_file(path, "checkpoint facts", CHECKPOINT_FACT_SCHEMA)
    facts = data["architectures"].get(ARCH, {}).get("facts", {})
    values = {name: fact["value"] for name, fact in facts.items()}
    missing = [name for name in REQUIRED_CHECKPOINT_VALUES if values.get(name) is None]
    if missing:
        raise UserError(f"{path}: {ARCH} facts {', '.join(missing)} are null or absent; the shrunk model "
                        "takes each from there: give each a value with its source")
    return values


def text_config(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The KimiLinearConfig keys (sglang/srt/configs/kimi_linear.py) of the shrunk model."""
    qk_nope = facts["mla_qk_head_dim"] - facts["mla_qk_rope_head_dim"]
    return {
        "model_type": "kimi_linear",
        "torch_dtype": "bfloat16",
        "vocab_size": facts["vocab_size"],
        "hidden_size": facts["hidden_size"],
        "intermediate_size": facts["intermediate_size"],
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": facts["num_attention_heads"],
        "num_key_value_heads": facts["num_attention_heads"],
        "hidden_act": facts["hidden_act"],
        "activation_situ_beta": facts["activation_situ_beta"],
        "activation_situ_linear_beta": facts["activation_situ_linear_beta"],
        "rms_norm_eps": RMS_NORM_EPS,
        "max_position_embeddings": CONTEXT_LENGTH,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": 0,
        # MoE: ungrouped sigmoid routing with the correction bias (facts moe_routing)
        "num_experts": facts["num_experts"],
        "num_experts_per_token": facts["num_experts_per_tok"],
        "num_shared_experts": facts["num_shared_experts"],
        "moe_intermediate_size": facts["moe_intermediate_size"],
        "routed_expert_hidden_size": facts["routed_expert_hidden_size"],
        "latent_moe_use_norm": facts["latent_moe_use_norm"],
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": facts["first_k_dense_replace"],
        "moe_layer_freq": facts["moe_layer_freq"],
        # MLA (no RoPE: KimiK3MLAAttention passes skip_rope=True)
        "q_lora_rank": facts["mla_q_lora_rank"],
        "kv_lora_rank": facts["mla_kv_lora_rank"],
        "qk_nope_head_dim": qk_nope,
        "qk_rope_head_dim": facts["mla_qk_rope_head_dim"],
        "v_head_dim": facts["mla_v_head_dim"],
        "mla_use_nope": True,
        "mla_use_output_gate": facts["mla_use_output_gate"],
        "attn_res_block_size": facts["attn_res_block_size"],
        "linear_attn_config": {
            "kda_layers": KDA_LAYERS,
            "full_attn_layers": FULL_ATTN_LAYERS,
            "num_heads": facts["num_kv_heads_kda"],
            "head_dim": facts["kda_head_dim"],
            "short_conv_kernel_size": facts["kda_short_conv_kernel_size"],
            "use_full_rank_gate": facts["kda_use_full_rank_gate"],
            "gate_lower_bound": facts["kda_gate_lower_bound"],
        },
    }


def served_config(facts: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of the model directory the proof serves (text-only K3; the module doc says why)."""
    return {**text_config(facts), "architectures": ["KimiK3LinearForCausalLM"]}


def vl_config(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The same model as KimiK3ForConditionalGeneration (KimiK3VisionConfig's defaults for the
    vision tower: the checkpoint's vision_config is not an input)."""
    return {"architectures": [ARCH], "model_type": "kimi_k3", "text_config": text_config(facts),
            "vision_config": {}}


def layer_kinds(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(attention, ffn) per layer, decided as sglang/srt/models/kimi_k3.py decides it."""
    lac = config["linear_attn_config"]
    kinds = []
    for idx in range(config["num_hidden_layers"]):
        attention = "kda" if idx + 1 in lac["kda_layers"] else "mla"
        moe = idx >= config["first_k_dense_replace"] and idx % config["moe_layer_freq"] == 0
        kinds.append((attention, "moe" if moe else "dense"))
    return kinds


def weight_bytes(config: Mapping[str, Any]) -> list[tuple[str, int]]:
    """BF16 bytes of each part of the model SGLang builds for `config` (dummy weights are
    allocated at full size): the big matrices of sglang/srt/models/kimi_k3.py, norms and
    the vision tower left out (each well under 1 GB)."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    lac = config["linear_attn_config"]
    kda_proj = lac["num_heads"] * lac["head_dim"]
    heads = config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    parts = [("embedding", vocab * h), ("lm_head", vocab * h)]
    for idx, (attention, ffn) in enumerate(layer_kinds(config)):
        if attention == "kda":
            # [q, k, v, g], o_proj, b_proj, f_a, f_b
            n = 4 * kda_proj * h + kda_proj * h + lac["num_heads"] * h + lac["head_dim"] * h + lac["head_dim"] * kda_proj
        else:
            # q_a, q_b, kv_a (+rope), kv_b, o_proj, output gate
            n = (h * config["q_lora_rank"] + config["q_lora_rank"] * heads * qk
                 + h * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
                 + config["kv_lora_rank"] * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
                 + heads * config["v_head_dim"] * h
                 + (h * heads * config["v_head_dim"] if config["mla_use_output_gate"] else 0))
        parts.append((f"layer {idx} {attention} attention", n))
        if ffn == "dense":
            parts.append((f"layer {idx} dense MLP", 3 * h * config["intermediate_size"]))
        else:
            latent, inter = config["routed_expert_hidden_size"], config["moe_intermediate_size"]
            parts.append((f"layer {idx} routed experts", config["num_experts"] * 3 * latent * inter))
            parts.append((f"layer {idx} shared experts, router, latent projections",
                          3 * h * inter * config["num_shared_experts"] + config["num_experts"] * h + 2 * h * latent))
    return [(name, n * BF16) for name, n in parts]


def check_config(config: Mapping[str, Any], facts: Mapping[str, Any]) -> None:
    """UserError unless `config` keeps every real dimension, has a KDA, an MLA, a MoE and (as
    the real model does) a dense first layer, and its weights fit the budget."""
    expected = text_config(facts)
    changed = sorted(k for k in expected if config.get(k) != expected[k])
    if changed:
        raise UserError(f"shrunk model config: {', '.join(changed)} differ from what checkpoint_facts.json gives; "
                        "regenerate with python3 -m tools.jit_cache.shrunk_model write")
    kinds = layer_kinds(config)
    have = {a for a, _ in kinds} | {f for _, f in kinds}
    lacking = sorted({"kda", "mla", "moe"} - have)
    if lacking or (facts["first_k_dense_replace"] > 0 and kinds[0][1] != "dense"):
        raise UserError(f"shrunk model config: layers {kinds} lack {lacking or 'a dense first layer'}; "
                        "change NUM_LAYERS / KDA_LAYERS in tools/jit_cache/shrunk_model.py")
    total = sum(n for _, n in weight_bytes(config))
    if total > WEIGHT_BUDGET_BYTES:
        raise UserError(f"shrunk model config: {total / 1e9:.1f} GB of BF16 weights, over the "
                        f"{WEIGHT_BUDGET_BYTES / 1e9:.0f} GB budget; drop a MoE layer")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.jit_cache.shrunk_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["write", "check", "memory"])
    parser.add_argument("--facts", type=Path, default=CHECKPOINT_VALUES_FILE)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    facts = load_facts(args.facts)
    config = served_config(facts)
    check_config(config, facts)
    target = args.out_dir / "config.json"
    if args.command == "write":
        args.out_dir.mkdir(parents=True, exist_ok=True)
        target.write_bytes(review_json(config))
        print(target)
    elif args.command == "check":
        if not target.is_file() or target.read_bytes() != review_json(config):
            raise UserError(f"{target}: not what {args.facts} gives; run python3 -m tools.jit_cache.shrunk_model write")
        print(f"{target}: current")
    else:
        parts = weight_bytes(config)
        width = max(len(name) for name, _ in parts)
        for name, n in parts:
            print(f"{name:<{width}}  {n / 1e9:8.3f} GB")
        print(f"{'total':<{width}}  {sum(n for _, n in parts) / 1e9:8.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
