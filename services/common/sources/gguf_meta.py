"""What a GGUF's metadata says about its model: a Hugging Face config.json for it, its tokenizer
(tokenizer.json and tokenizer_config.json from tokenizer.ggml.*), and whether a config.json given
next to it describes the same model.
"""

from __future__ import annotations

from pathlib import Path

from services.common.errors import CheckpointError
from services.common.sources.gguf_file import GgufFile

ARCHITECTURES = ("llama", "qwen3moe", "qwen2moe", "deepseek2")
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# Keys a config.json given next to the GGUF must agree on (the shapes every tensor follows).
CHECKED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts",
                "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank")


def _need(g: GgufFile, key: str):
    value = g.key(key)
    if value is None:
        raise CheckpointError(f"{g.path}: GGUF metadata lacks {g.arch}.{key}")
    return value


def _common(g: GgufFile) -> dict:
    heads = _need(g, "attention.head_count")
    tokens = g.key("tokenizer.ggml.tokens", arch=False) or ()
    return {
        "vocab_size": g.key("vocab_size") or len(tokens) or g.shape("token_embd.weight")[0],
        "hidden_size": _need(g, "embedding_length"), "num_hidden_layers": _need(g, "block_count"),
        "intermediate_size": g.key("feed_forward_length") or g.key("expert_feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": g.key("attention.head_count_kv") or heads,
        "rms_norm_eps": g.key("attention.layer_norm_rms_epsilon", 1e-6), "rope_theta": g.key("rope.freq_base", 10000.0),
        "max_position_embeddings": g.key("context_length", 4096), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": g.key("tokenizer.ggml.bos_token_id", arch=False),
        "eos_token_id": g.key("tokenizer.ggml.eos_token_id", arch=False),
    }


def _dense_layers(g: GgufFile) -> list[int]:
    return [i for i in range(_need(g, "block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors]


def _llama(g: GgufFile) -> dict:
    experts = g.key("expert_count") or 0
    if not experts:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_common(g),
                "head_dim": g.key("rope.dimension_count")}
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **_common(g),
            "head_dim": g.key("attention.key_length") or g.key("rope.dimension_count"),
            "num_local_experts": experts, "num_experts_per_tok": _need(g, "expert_used_count"), "sliding_window": None}


def _qwen_moe(g: GgufFile) -> dict:
    qwen3 = g.arch == "qwen3moe"
    config = {
        "model_type": "qwen3_moe" if qwen3 else "qwen2_moe", **_common(g),
        "num_experts": _need(g, "expert_count"), "num_experts_per_tok": _need(g, "expert_used_count"),
        "moe_intermediate_size": _need(g, "expert_feed_forward_length"), "norm_topk_prob": qwen3,
        "decoder_sparse_step": 1, "mlp_only_layers": _dense_layers(g),
    }
    if qwen3:
        return {**config, "head_dim": _need(g, "attention.key_length"),
                "attention_bias": "blk.0.attn_q.bias" in g.tensors, "architectures": ["Qwen3MoeForCausalLM"]}
    return {**config, "shared_expert_intermediate_size": g.key("expert_shared_feed_forward_length", 0),
            "qkv_bias": "blk.0.attn_q.bias" in g.tensors, "architectures": ["Qwen2MoeForCausalLM"]}


def _rope_scaling(g: GgufFile) -> dict | None:
    if g.key("rope.scaling.type") != "yarn":
        return None
    return {"type": "yarn", "factor": _need(g, "rope.scaling.factor"),
            "original_max_position_embeddings": _need(g, "rope.scaling.original_context_length"),
            "beta_fast": g.key("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": g.key("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": 1.0, "mscale_all_dim": round(g.key("rope.scaling.yarn_log_multiplier", 0.0) / 0.1, 6)}


def _deepseek(g: GgufFile) -> dict:
    # Sigmoid gating is DeepSeek-V3's; a GGUF without the key (converted from a config without
    # scoring_func) still has V3's router when it carries the correction biases.
    gating = g.key("expert_gating_func")
    v3 = gating == _GATING_SIGMOID or (gating is None and any(n.endswith("exp_probs_b.bias") for n in g.tensors))
    rope = _need(g, "rope.dimension_count")
    key = g.key("attention.key_length_mla") or _need(g, "attention.key_length")
    n_group = g.key("expert_group_count") or 1
    method = "noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy")
    return {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", **_common(g),
        "num_key_value_heads": _need(g, "attention.head_count"),  # llama.cpp writes 1 (MLA as MQA)
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "q_lora_rank": g.key("attention.q_lora_rank") or None, "kv_lora_rank": _need(g, "attention.kv_lora_rank"),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope,
        "v_head_dim": g.key("attention.value_length_mla") or _need(g, "attention.value_length"),
        "n_routed_experts": _need(g, "expert_count"), "num_experts_per_tok": _need(g, "expert_used_count"),
        "moe_intermediate_size": _need(g, "expert_feed_forward_length"),
        "n_shared_experts": g.key("expert_shared_count", 0), "first_k_dense_replace": g.key("leading_dense_block_count", 0),
        "routed_scaling_factor": g.key("expert_weights_scale", 1.0), "norm_topk_prob": bool(g.key("expert_weights_norm", False)),
        "n_group": n_group, "topk_group": g.key("expert_group_used_count") or 1, "topk_method": method,
        "scoring_func": "sigmoid" if v3 else "softmax", "rope_scaling": _rope_scaling(g), "rope_interleave": True,
        "moe_layer_freq": 1, "attention_bias": False,
    }


_CONFIGS = {"llama": _llama, "qwen3moe": _qwen_moe, "qwen2moe": _qwen_moe, "deepseek2": _deepseek}


def hf_config(g: GgufFile) -> dict:
    """A config.json for the GGUF's model, from its metadata."""
    if g.arch not in _CONFIGS:
        raise CheckpointError(
            f"{g.path}: GGUF architecture {g.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return _CONFIGS[g.arch](g)


def check_agrees(g: GgufFile, config: dict, config_path: Path) -> None:
    """A config.json given next to the GGUF must describe the model the GGUF holds."""
    ours = hf_config(g)
    for key in CHECKED_KEYS:
        if key in config and key in ours and config[key] != ours[key]:
            raise CheckpointError(
                f"{g.path} and {config_path} disagree: GGUF metadata gives {key} = {ours[key]}, config.json {config[key]}"
            )
