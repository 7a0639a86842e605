"""config.json dialects and validation."""

import json
import shutil

import pytest
import torch

from services.common.checkpoint import Checkpoint, read_config
from services.common.errors import ConfigError
from services.common.model_config import parse_model_config
from services.dense.loader import load_model
from services.dense.runtime import DenseRuntime
from tests.checkpoints import FAMILY_CHECKPOINTS, checkpoint


def _config(name):
    return read_config(checkpoint(name))


def _old_dialect(raw: dict) -> dict:
    """What a real DeepSeek-V3 / Qwen / Mixtral / GLM / MiniMax release carries instead of
    transformers 5.x keys (GLM-4.5: a top-level partial_rotary_factor; MiniMax-M2: rotary_dim)."""
    old = dict(raw)
    rope = dict(old.pop("rope_parameters"))
    old["rope_theta"] = rope.pop("rope_theta")
    partial = rope.pop("partial_rotary_factor", None)
    if partial is not None and old["model_type"] == "minimax_m2":
        old["rotary_dim"] = int(partial * old["head_dim"])
    elif partial is not None:
        old["partial_rotary_factor"] = partial
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")
        old["rope_scaling"] = rope
    if old["model_type"] == "deepseek_v3":
        old.update(scoring_func="sigmoid", topk_method="noaux_tc")
    return old


@pytest.mark.parametrize("name", FAMILY_CHECKPOINTS)
def test_old_and_new_dialects_parse_to_the_same_config(name):
    raw = _config(name)
    assert parse_model_config(_old_dialect(raw)) == parse_model_config(raw)


def test_old_dialect_checkpoint_gives_identical_logits(tmp_path):
    src = checkpoint("deepseek_v3")
    old = tmp_path / "old"
    shutil.copytree(src, old)
    (old / "config.json").write_text(json.dumps(_old_dialect(read_config(src))))
    tokens = torch.arange(10, 50)
    runtime = DenseRuntime(dtype="float32", device="cpu")
    a, _ = load_model(src, runtime)
    b, _ = load_model(old, runtime)
    assert torch.equal(a.forward(tokens, a.new_cache(40)), b.forward(tokens, b.new_cache(40)))


@pytest.mark.parametrize("key", ["n_routed_experts", "num_experts", "num_local_experts"])
def test_expert_count_key_of_any_family_dialect(key):
    raw = _config("qwen3_moe")
    for k in ("n_routed_experts", "num_experts", "num_local_experts"):
        raw.pop(k, None)
    raw[key] = 16
    assert parse_model_config(raw).moe.num_experts == 16


@pytest.mark.parametrize("name, edit, message", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ("deepseek_v3", {"n_group": 3}, r"not divisible by n_group \(3\)"),
    ("deepseek_v3", {"topk_group": 9}, "topk_group"),
    ("qwen3_moe", {"num_attention_heads": 0}, "'num_attention_heads' must be positive"),
    ("qwen3_moe", {"num_key_value_heads": 3}, "not divisible by num_key_value_heads"),
    ("qwen3_moe", {"num_experts_per_tok": 40}, "exceeds the expert count"),
    ("mixtral", {"vocab_size": None}, "missing required key 'vocab_size'"),
    ("mixtral", {"hidden_size": "64"}, "'hidden_size' must be int"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("mixtral", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "unsupported rope type"),
])
def test_invalid_configs_name_the_cause(name, edit, message):
    raw = {**_config(name), **edit}
    with pytest.raises(ConfigError, match=message):
        parse_model_config(raw)


def test_tiny_checkpoints_exercise_what_real_models_use():
    """Grouped routing with a live correction bias, dense first layers, several shared experts,
    q_lora_rank set and null, YaRN, and the dense/MoE layer patterns of the Qwen families."""
    v3 = parse_model_config(_config("deepseek_v3"))
    assert v3.moe.router.n_group > 1 and v3.moe.router.topk_group > 1 and v3.rope.kind == "yarn"
    bias = Checkpoint(checkpoint("deepseek_v3")).get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.abs().min() > 0
    assert v3.moe_layers[0] is False and all(v3.moe_layers[1:])
    assert v3.moe.shared_intermediate_size == 2 * v3.moe.intermediate_size
    assert v3.attention.q_lora_rank is not None
    assert parse_model_config(_config("deepseek_v3_qnull")).attention.q_lora_rank is None
    v2 = parse_model_config(_config("deepseek_v2"))
    assert v2.moe.router.method == "group_limited_greedy" and v2.attention.q_lora_rank is None
    assert parse_model_config(_config("deepseek_v2_greedy")).moe.router.method == "greedy"
    assert parse_model_config(_config("qwen3_moe")).moe_layers == (True, False, True)
    q2 = parse_model_config(_config("qwen2_moe"))
    assert q2.moe_layers == (False, True, True) and q2.moe.shared_gated and q2.attention.qkv_bias
