"""Tiny GGUF files written with gguf-py from the tiny Hugging Face checkpoints, laid out as
llama.cpp's converter lays them out, each with the float checkpoint transformers runs as the truth.

`gguf_model(name, qtype)` is a directory holding only the GGUF (config and tokenizer come from its
metadata); `gguf_reference(name, qtype)` is the Hugging Face checkpoint of the same tensors as
gguf-py dequantizes them. Block quantization runs along each row, so stacking experts, permuting
llama's q/k rows and splitting kv_b into rows keep every value: the reference is each Hugging Face
tensor quantized and dequantized as its GGUF tensor is (the writer's choice of type).
O rows, I columns, H heads, E experts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import cached, checkpoint

ARCH = {"qwen3_moe": "qwen3moe", "qwen3_moe_k": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "deepseek_v3": "deepseek2",
        "deepseek_v2": "deepseek2"}
QTYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_a_proj": "attn_q_a",
          "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
          "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _qtype(gguf_name: str, shape: tuple[int, ...], qtype: str) -> str:
    """llama.cpp keeps norms, biases, routers and vectors in F32; a block type needs 32 | columns."""
    if len(shape) < 2 or any(k in gguf_name for k in ("norm", "ffn_gate_inp", "exp_probs", "attn_k_b", "attn_v_b")):
        return "F32"
    return "F32" if qtype != "BF16" and shape[-1] % 32 else qtype


def _quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    return w if qtype == "F32" else gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _roundtrip(w: torch.Tensor, qtype: str) -> torch.Tensor:
    import gguf

    if qtype == "F32":
        return w
    q = _quantize(w.numpy(), qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(q, gguf.GGMLQuantizationType[qtype]), np.float32)).reshape(w.shape)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(name: str, hf: dict[str, torch.Tensor], cfg: dict, fused: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors under llama.cpp's names and layouts (fused: gate and up experts as
    one ffn_gate_up_exps [E, 2I, D], as newer converters write them)."""
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, w in hf.items():
        if not key.startswith("model.layers."):
            continue
        parts = key.split(".")
        layer, rest, suffix = int(parts[2]), ".".join(parts[3:-1]), parts[-1]
        if ".experts." in key:
            e, proj = int(parts[-3]), parts[-2]
            kind = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}[proj]
            experts.setdefault((layer, kind), {})[e] = w
        elif rest == "self_attn.kv_b_proj":  # the converter's attn_k_b [H, L, N] and attn_v_b [H, V, L]
            h, n, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            k_b, v_b = w.view(h, n + v, -1).split([n, v], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2).contiguous()
            out[f"blk.{layer}.attn_v_b.weight"] = v_b.contiguous()
        elif suffix == "e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        else:
            if name == "mixtral" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if rest.endswith("q_proj") else cfg["num_key_value_heads"]
                w = _permute(w, heads)
            out[f"blk.{layer}.{_LAYER[rest]}.{suffix}"] = w
    for (layer, kind), per_expert in experts.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    for layer in {layer for layer, _ in experts} if fused else ():
        gate, up = out.pop(f"blk.{layer}.ffn_gate_exps.weight"), out.pop(f"blk.{layer}.ffn_up_exps.weight")
        out[f"blk.{layer}.ffn_gate_up_exps.weight"] = torch.cat((gate, up), dim=1)
    return out


def _metadata(w, name: str, cfg: dict) -> None:
    arch = ARCH[name]
    u32 = lambda k, v: w.add_uint32(f"{arch}.{k}", int(v))  # noqa: E731
    f32 = lambda k, v: w.add_float32(f"{arch}.{k}", float(v))  # noqa: E731
    rope = cfg.get("rope_parameters") or {}
    u32("block_count", cfg["num_hidden_layers"])
    u32("context_length", cfg["max_position_embeddings"])
    u32("embedding_length", cfg["hidden_size"])
    u32("feed_forward_length", cfg["intermediate_size"])
    u32("attention.head_count", cfg["num_attention_heads"])
    u32("attention.head_count_kv", cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    f32("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    f32("rope.freq_base", rope.get("rope_theta", 10000.0))
    u32("expert_count", cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
    u32("expert_used_count", cfg["num_experts_per_tok"])
    if name == "mixtral":
        u32("rope.dimension_count", cfg["hidden_size"] // cfg["num_attention_heads"])
    if name.startswith("qwen"):  # qwen3_moe, qwen3_moe_k, qwen2_moe
        u32("expert_feed_forward_length", cfg["moe_intermediate_size"])
        u32("attention.key_length", cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if name == "qwen2_moe":
        u32("expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    if name.startswith("deepseek"):
        u32("expert_feed_forward_length", cfg["moe_intermediate_size"])
        u32("leading_dense_block_count", cfg["first_k_dense_replace"])
        u32("expert_shared_count", cfg["n_shared_experts"])
        f32("expert_weights_scale", cfg["routed_scaling_factor"])
        w.add_bool(f"{arch}.expert_weights_norm", bool(cfg.get("norm_topk_prob", False)))
        u32("expert_gating_func", 2 if name == "deepseek_v3" else 1)
        u32("expert_group_count", cfg.get("n_group") or 1)
        u32("expert_group_used_count", cfg.get("topk_group") or 1)
        if cfg.get("q_lora_rank"):
            u32("attention.q_lora_rank", cfg["q_lora_rank"])
        u32("attention.kv_lora_rank", cfg["kv_lora_rank"])
        u32("attention.key_length", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        u32("attention.value_length", cfg["v_head_dim"])
        u32("rope.dimension_count", cfg["qk_rope_head_dim"])
        if rope.get("rope_type") == "yarn":
            w.add_string(f"{arch}.rope.scaling.type", "yarn")
            f32("rope.scaling.factor", rope["factor"])
            u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])
            f32("rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])


def _tokenizer(w, base: Path) -> None:
    tok = json.loads((base / "tokenizer.json").read_text())
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    w.add_array("tokenizer.ggml.merges", merges)
    for key, token in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[tok_cfg[token]])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", tok_cfg["chat_template"])


def _write_gguf(name: str, qtype: str, out: Path, variant: str = "") -> None:
    """variant "fused": ffn_gate_up_exps; "split": files of 8 tensors each (-0000k-of-0000n.gguf)."""
    import gguf

    base = checkpoint(name)
    cfg = json.loads((base / "config.json").read_text())
    tensors = _gguf_tensors(name, load_file(base / "model.safetensors"), cfg, fused=variant == "fused")
    w = gguf.GGUFWriter(out / f"{name}-{qtype}{variant}.gguf", ARCH[name], split_max_tensors=8 if variant == "split" else 0)
    _metadata(w, name, cfg)
    _tokenizer(w, base)
    for key, t in tensors.items():
        t_type = _qtype(key, tuple(t.shape), qtype)
        w.add_tensor(key, _quantize(t.float().numpy(), t_type), raw_dtype=gguf.GGMLQuantizationType[t_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_reference(name: str, qtype: str, out: Path) -> None:
    base = checkpoint(name)
    cfg = json.loads((base / "config.json").read_text())
    hf = load_file(base / "model.safetensors")
    ref = {key: _roundtrip(w.float(), _gguf_kind(name, key, w, cfg, qtype)) for key, w in hf.items()}
    save_file(ref, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((base / f).read_bytes())


def _gguf_kind(name: str, key: str, w: torch.Tensor, cfg: dict, qtype: str) -> str:
    """The type the writer gives the GGUF tensor that holds this Hugging Face tensor."""
    single = _gguf_tensors(name, {key: w, "model.embed_tokens.weight": w, "model.norm.weight": w}, cfg)
    mine = [k for k in single if k not in ("token_embd.weight", "output_norm.weight")] or (
        ["token_embd.weight"] if key == "model.embed_tokens.weight" else ["output_norm.weight"])
    return _qtype(mine[0], tuple(single[mine[0]].shape), qtype)


def _digest(name: str, qtype: str) -> str:
    return hashlib.sha256(json.dumps([name, qtype, Path(__file__).read_text(), str(checkpoint(name))]).encode()).hexdigest()[:12]


def gguf_model(name: str, qtype: str, variant: str = "") -> Path:
    """The GGUF file of the tiny checkpoint `name` with its weights in qtype (the first file of a
    split variant)."""
    def build(out: Path) -> None:
        _write_gguf(name, qtype, out, variant)
        (out / "complete").touch()

    d = cached(f"gguf-{name}-{qtype}{variant}", _digest(name, qtype), build, "complete")
    return next(p for p in sorted(d.glob("*.gguf")) if "-of-" not in p.name or "-00001-of-" in p.name)


def gguf_reference(name: str, qtype: str) -> Path:
    return cached(f"gguf-{name}-{qtype}-reference", _digest(name, qtype), lambda out: _write_reference(name, qtype, out))


def write_gguf(name: str, path: Path) -> None:
    """The tiny checkpoint `name` as an F32 GGUF at path (the input of llama.cpp's quantizer)."""
    _write_gguf(name, "F32", path.parent)
    (path.parent / f"{name}-F32.gguf").replace(path)


def qwen3_reference(gguf_path: Path, out: Path, base: str = "qwen3_moe_k") -> Path:
    """A qwen3moe GGUF's tensors as gguf-py dequantizes them, under Hugging Face names (the inverse of
    the writer's names; qwen3moe has no permutation or kv_b), saved with the base's config and tokenizer."""
    import gguf

    inverse = {v: k for k, v in _LAYER.items() if not k.startswith("block_sparse") and "shared" not in k}
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    names = ("gate_proj", "up_proj", "down_proj")
    state = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if t.name in fixed:
            state[fixed[t.name]] = torch.from_numpy(w)
            continue
        _, layer, kind, suffix = t.name.split(".")
        if kind.endswith("_exps"):
            proj = names[("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps").index(kind)]
            for e in range(w.shape[0]):
                state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.{suffix}"] = torch.from_numpy(w[e].copy())
        else:
            state[f"model.layers.{layer}.{inverse[kind]}.{suffix}"] = torch.from_numpy(w)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((checkpoint(base) / f).read_bytes())
    return out


def converted_reference(name: str, gguf_path: Path, out: Path) -> Path:
    """The tiny checkpoint `name` as llama.cpp's converter stored it (make_fixtures.py): each tensor
    rounded to fp16 where the GGUF holds it in F16 (elementwise, so its layout does not matter)."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors}
    base = checkpoint(name)
    cfg = json.loads((base / "config.json").read_text())
    ref = {}
    for key, w in load_file(base / "model.safetensors").items():
        mapped = _gguf_tensors(name, {key: w, "model.embed_tokens.weight": w, "model.norm.weight": w}, cfg)
        own = [k for k in mapped if k not in ("token_embd.weight", "output_norm.weight")] or (
            ["token_embd.weight"] if key == "model.embed_tokens.weight" else ["output_norm.weight"])
        kinds = {types[k] for k in own}
        assert len(kinds) == 1 and kinds <= {"F16", "F32"}, (key, own, kinds)
        ref[key] = w.half().float() if kinds == {"F16"} else w.float()
    save_file(ref, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((base / f).read_bytes())
    return out
