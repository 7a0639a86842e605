"""A GGUF model as Hugging Face tensors: names mapped back, llama's q/k row permutation undone,
merged expert tensors sliced per expert, DeepSeek's split attn_k_b / attn_v_b joined into kv_b_proj.

Q8_0, Q4_0 and IQ4_NL store 32 values under one fp16 scale with int8 or 16-level codes: the packed
int8 / int4 formats exactly, so experts of those types import without a second rounding; Q4_1 (an
fp16 scale and minimum per 32) is int4_asym exactly, and Q4_K's 32-value sub-blocks are int4_asym
with their scales and minimums rounded to fp16.
E experts, I expert intermediate size, H heads, L kv_lora_rank, N/V the MLA nope and value head sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import CheckpointError
from services.common.sources.base import QuantizedWeight, TensorSource
from services.common.sources.gguf_file import GgufFile

IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
UNIFORM_LEVELS = tuple(range(-8, 8))

# GGUF tensor (in block N) -> Hugging Face name inside model.layers.N; "{moe}" is the MoE block's prefix.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "{moe}.gate.weight",
    "exp_probs_b.bias": "{moe}.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "{moe}.{shared}.gate_proj.weight",
    "ffn_up_shexp.weight": "{moe}.{shared}.up_proj.weight",
    "ffn_down_shexp.weight": "{moe}.{shared}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "{moe}.shared_expert_gate.weight",
}
_PROJECTIONS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # -> index into the family's expert names
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Layout:
    """How a family names its MoE block in Hugging Face checkpoints."""

    moe: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = "shared_experts"
    permuted_heads: tuple[int, int] = (0, 0)  # llama: q and k rows permuted per head by the converter


def layout(config: dict) -> Layout:
    family = config.get("model_type")
    if family == "mixtral":
        heads = config["num_attention_heads"]
        return Layout("block_sparse_moe", ("w1", "w3", "w2"), "", (heads, config.get("num_key_value_heads") or heads))
    if family == "llama":
        heads = config["num_attention_heads"]
        return Layout(permuted_heads=(heads, config.get("num_key_value_heads") or heads))
    return Layout(shared="shared_expert" if family == "qwen2_moe" else "shared_experts")


@dataclass(frozen=True)
class Ref:
    """Where a Hugging Face tensor lives in the GGUF."""

    tensor: str
    expert: int | None = None    # slice of a merged [E, ...] tensor
    rows: slice | None = None     # part of a fused gate_up tensor
    permute: int = 0              # heads of llama's q/k permutation to undo
    kv_b: tuple[str, str] | None = None  # (attn_k_b, attn_v_b), joined into kv_b_proj


def _refs(g: GgufFile, lay: Layout) -> dict[str, Ref]:
    refs: dict[str, Ref] = {}
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    for name in g.tensors:
        if name in fixed:
            refs[fixed[name]] = Ref(name)
            continue
        m = _BLOCK.match(name)
        if not m:
            continue
        layer, rest = int(m[1]), m[2]
        prefix = f"model.layers.{layer}."
        kind, _, suffix = rest.rpartition(".")
        if rest in _LAYER_NAMES:
            refs[prefix + _LAYER_NAMES[rest].format(moe=lay.moe, shared=lay.shared)] = Ref(name)
        elif kind in _PROJECTIONS:
            heads = {"attn_q": lay.permuted_heads[0], "attn_k": lay.permuted_heads[1]}.get(kind, 0)
            refs[f"{prefix}self_attn.{_PROJECTIONS[kind]}.{suffix}"] = Ref(name, permute=heads)
        elif kind in _EXPERTS or kind == "ffn_gate_up_exps":
            _expert_refs(g, name, kind, prefix + f"{lay.moe}.experts", lay, refs)
        elif rest == "attn_k_b.weight" and f"blk.{layer}.attn_kv_b.weight" not in g.tensors:
            refs[prefix + "self_attn.kv_b_proj.weight"] = Ref(name, kv_b=(name, f"blk.{layer}.attn_v_b.weight"))
    return refs


def _expert_refs(g: GgufFile, name: str, kind: str, base: str, lay: Layout, refs: dict[str, Ref]) -> None:
    shape = g.shape(name)
    if len(shape) != 3:
        raise CheckpointError(f"{g.path}: merged expert tensor {name!r} has shape {list(shape)}, expected [E, rows, cols]")
    for e in range(shape[0]):
        if kind == "ffn_gate_up_exps":
            half = shape[1] // 2
            refs[f"{base}.{e}.{lay.experts[0]}.weight"] = Ref(name, e, slice(0, half))
            refs[f"{base}.{e}.{lay.experts[1]}.weight"] = Ref(name, e, slice(half, 2 * half))
        else:
            refs[f"{base}.{e}.{lay.experts[_EXPERTS[kind]]}.weight"] = Ref(name, e)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's converter, which interleaves each head's two rotary halves: w [H * Dh, ...]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GgufSource(TensorSource):
    kind = "gguf"

    def __init__(self, g: GgufFile, config: dict):
        self.g = g
        self.refs = _refs(g, layout(config))

    def names(self):
        return self.refs.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        ref = self.refs[name]
        if ref.kv_b:
            (h, l, n), (_, v, _) = self.g.shape(ref.kv_b[0]), self.g.shape(ref.kv_b[1])
            return h * (n + v), l
        shape = self.g.shape(ref.tensor)[0 if ref.expert is None else 1:]
        if ref.rows is not None:
            shape = (ref.rows.stop - ref.rows.start, *shape[1:])
        return tuple(shape)

    def read(self, name: str) -> torch.Tensor:
        ref = self.refs[name]
        if ref.kv_b:
            k_b = torch.from_numpy(self.g.dequantize(ref.kv_b[0]))  # [H, L, N]
            v_b = torch.from_numpy(self.g.dequantize(ref.kv_b[1]))  # [H, V, L]
            return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(self.shape(name)).contiguous()
        w = torch.from_numpy(self.g.dequantize(ref.tensor, ref.expert))
        if ref.rows is not None:
            w = w[ref.rows].contiguous()
        return unpermute(w, ref.permute) if ref.permute else w

    def stored_bytes(self, name: str) -> int:
        ref = self.refs[name]
        if ref.kv_b:
            return sum(self.g.nbytes(t) for t in ref.kv_b)
        n = self.g.nbytes(ref.tensor, ref.expert)
        return n if ref.rows is None else n * (ref.rows.stop - ref.rows.start) // self.g.shape(ref.tensor)[1]

    def quantized(self, name: str, index: int | None = None) -> QuantizedWeight | None:
        ref = self.refs[name]
        kind = self.g.type_name(ref.tensor)
        if ref.kv_b or ref.permute or kind not in BLOCK_BYTES:
            return None
        raw = self.g.raw(ref.tensor, ref.expert)
        if ref.rows is not None:
            raw = raw[ref.rows]
        return blocks_to_codes(np.ascontiguousarray(raw).reshape(raw.shape[0], -1), kind)

    def fingerprint(self, h) -> None:
        self.g.fingerprint(h)


BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "IQ4_NL": 18, "Q4_1": 20, "Q4_K": 144}


def _halves(body: np.ndarray) -> np.ndarray:
    """[..., 16 bytes] of 32 4-bit codes (low nibbles 0-15, high nibbles 16-31) -> [..., 32]."""
    return np.concatenate((body & 0x0F, body >> 4), axis=-1)


def blocks_to_codes(raw: np.ndarray, kind: str) -> QuantizedWeight:
    """Rows of one block type (uint8 [O, blocks * bytes]) -> codes [O, I] with fp16 scales (and mins).

    Q8_0: an fp16 scale, 32 int8 values. Q4_0 / IQ4_NL: an fp16 scale, 32 4-bit codes (value =
    code - 8, or an IQ4_NL level). Q4_1: fp16 scale d and minimum m, 32 codes: d * q + m."""
    o = raw.shape[0]
    if kind == "Q4_K":
        return _q4_k(raw.reshape(o, -1, BLOCK_BYTES[kind]))
    blocks = raw.reshape(o, -1, BLOCK_BYTES[kind])
    halves = lambda a: np.ascontiguousarray(a).view(np.uint16).reshape(o, -1)  # noqa: E731
    if kind == "Q8_0":
        return QuantizedWeight("int8", np.ascontiguousarray(blocks[:, :, 2:]).reshape(o, -1), halves(blocks[:, :, :2]), 32)
    if kind == "Q4_1":
        return QuantizedWeight("int4_asym", _halves(blocks[:, :, 4:]).reshape(o, -1), halves(blocks[:, :, :2]), 32,
                               mins=halves(blocks[:, :, 2:4]))
    return QuantizedWeight("int4", _halves(blocks[:, :, 2:]).reshape(o, -1), halves(blocks[:, :, :2]), 32,
                           UNIFORM_LEVELS if kind == "Q4_0" else IQ4_NL_LEVELS)


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    """Q4_K super-blocks [O, S, 144] of 256 values: fp16 d and dmin, 8 six-bit (scale, min) pairs packed
    in 12 bytes, then 4 runs of 32 bytes whose low nibbles are one 32-value sub-block and high nibbles
    the next. Sub-block j: w = d * sc_j * q - dmin * m_j, as int4_asym with those rounded to fp16."""
    import gguf

    o, s, _ = blocks.shape
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)       # [O, S, 1]
    dmin = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)    # [O, S, 1]
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, :, 4:16].reshape(o * s, 12))
    scales = (d * sc.reshape(o, s, 8).astype(np.float32)).astype(np.float16)
    mins = (-(dmin * m.reshape(o, s, 8).astype(np.float32))).astype(np.float16)
    qs = blocks[:, :, 16:].reshape(o, s, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(o, -1)
    return QuantizedWeight("int4_asym", np.ascontiguousarray(codes, dtype=np.uint8), scales.view(np.uint16).reshape(o, -1),
                           32, mins=mins.view(np.uint16).reshape(o, -1))
