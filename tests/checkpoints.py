"""Tiny random-weight checkpoints of every supported family, made with transformers' own classes.

Each is saved in the Hugging Face layout (config.json, safetensors, tokenizer files) under
`.cache/tiny-models/<name>-<digest>`; the digest covers the recipe, so a changed recipe makes a new
checkpoint and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tests.random_model import corpus, write_tokenizer

CACHE_ROOT = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"
SEED = 1234
VOCAB = 512
BUILD = 4  # bump when _build changes what it writes

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

_MLA = dict(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
    moe_intermediate_size=64,
    n_shared_experts=2,
    n_routed_experts=16,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
)

_YARN_CONTEXT = {"max_position_embeddings": 128}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# name -> (model_type, config keyword arguments)
RECIPES: dict[str, tuple[str, dict]] = {
    "deepseek_v3": ("deepseek_v3", {
        **_COMMON, **_MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_interleave": True, "num_mtp_layers": 0,
        "rope_parameters": _YARN, **_YARN_CONTEXT,
    }),
    "deepseek_v3_qnull": ("deepseek_v3", {
        **_COMMON, **_MLA, "q_lora_rank": None, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.5, "rope_interleave": True, "num_mtp_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "deepseek_v2": ("deepseek_v2", {
        **_COMMON, **_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 1.0, "rope_parameters": _YARN, **_YARN_CONTEXT,
    }),
    "deepseek_v2_greedy": ("deepseek_v2", {
        **_COMMON, **_MLA, "q_lora_rank": 24, "topk_method": "greedy", "routed_scaling_factor": 16.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "qwen3_moe": ("qwen3_moe", {
        **_COMMON, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "qwen2_moe": ("qwen2_moe", {
        **_COMMON, "num_key_value_heads": 2, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [0], "qkv_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "mixtral": ("mixtral", {
        **_COMMON, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
        "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
    "glm4_moe": ("glm4_moe", {
        **_COMMON, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": True, "use_qk_norm": True,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "num_mtp_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }),
    "minimax_m2": ("minimax_m2", {
        **_COMMON, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    }),
    # swiglu_limit 0.1 clamps a good share of this model's gates and ups; windows of 8 < any prompt
    "gpt_oss": ("gpt_oss", {
        **_COMMON, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 64, "sliding_window": 8, "swiglu_limit": 0.1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    }),
}

FAMILY_CHECKPOINTS = list(RECIPES)

# Checkpoints that are not a family of their own: the bases of the quantized test checkpoints
# (tests/quantized.py). Hidden 192, dense intermediate 160 and kv_a_proj's 40 rows leave partial
# 128-blocks; the routed experts (I 64) fit the int4 kernels.
EXTRA_RECIPES: dict[str, tuple[str, dict]] = {
    "deepseek_v3_tiles": ("deepseek_v3", {
        **_COMMON, **_MLA, "hidden_size": 192, "intermediate_size": 160, "q_lora_rank": 24, "n_group": 4,
        "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
        "num_mtp_layers": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    # The base of the committed K-quant / IQ GGUF fixtures (tests/fixtures/gguf): rows of 256 columns.
    "qwen3_moe_k": ("qwen3_moe", {
        **_COMMON, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 1, "num_key_value_heads": 2,
        "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }),
}


def _digest(name: str) -> str:
    import transformers

    blob = json.dumps([_recipe(name), SEED, VOCAB, BUILD, transformers.__version__, _corpus()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _recipe(name: str) -> tuple[str, dict]:
    return RECIPES[name] if name in RECIPES else EXTRA_RECIPES[name]


def cached(name: str, digest: str, build, marker: str = "config.json") -> Path:
    """CACHE_ROOT/<name>-<digest>, made by build(tmp_dir) on first use (atomically; complete when it
    holds `marker`)."""
    path = CACHE_ROOT / f"{name}-{digest}"
    if not (path / marker).exists():
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE_ROOT))
        try:
            build(tmp)
            os.replace(tmp, path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / marker).exists():
                raise
    return path


def checkpoint(name: str) -> Path:
    """Path of the cached tiny checkpoint `name`, built on first use."""
    return cached(name, _digest(name), lambda out: _build(name, out))


def _build(name: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, kwargs = _recipe(name)
    config = CONFIG_MAPPING[model_type](**kwargs)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_router_bias(model)
    _perturb_parameters(model)
    model.save_pretrained(out)
    _write_tokenizer(out)


def _perturb_router_bias(model: torch.nn.Module) -> None:
    """A zero correction bias would hide bugs in noaux_tc routing: give it real values."""
    gen = torch.Generator().manual_seed(SEED + 1)
    for key, buf in model.named_buffers():
        if key.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=gen) * 0.2)


def _perturb_parameters(model: torch.nn.Module) -> None:
    """Linear biases start at zero and gpt-oss's sinks near it, which would hide one read from the
    wrong place: draw them."""
    gen = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("bias"):  # .bias, and gpt-oss's experts' gate_up_proj_bias, down_proj_bias
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif key.endswith(".sinks"):
                param.copy_(torch.randn(param.shape, generator=gen))


def _corpus() -> list[str]:
    return corpus()


def _write_tokenizer(out: Path) -> None:
    write_tokenizer(out, VOCAB, 256)
