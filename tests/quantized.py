"""Quantized test checkpoints made from a tiny float one, each with its dequantized twin.

The quantization here is the tests' own, written from the formats' specifications, never the
readers' code: `quantized(kind)` is the checkpoint as a release would ship it, `dequantized(kind)`
the same weights dequantized to float32 in the plain layout, which transformers then runs as the
numerical truth.
  fp8         DeepSeek's block-scaled FP8 (128x128 blocks), float32 scales, one module left
              unquantized through modules_to_not_convert
  fp8_ue8m0   the same with power-of-two scales stored as float8_e8m0fnu (scale_fmt ue8m0)
  int4        compressed-tensors pack-quantized: routed experts in symmetric 4-bit, group 32,
              bfloat16 scales; everything else on the ignore list
  mxfp4       gpt-oss's release format (of the tiny gpt_oss): stacked experts as E2M1 blocks of 32
              with power-of-two scales; the twin is transformers' own MXFP4 dequantization
O output features, I input features.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import cached, checkpoint

BASE = "deepseek_v3_tiles"
BLOCK = 128
GROUP = 32
NOT_CONVERTED = "model.layers.2.self_attn.o_proj"
KINDS = ("fp8", "fp8_ue8m0", "int4", "mxfp4")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _base(kind: str) -> str:
    return "gpt_oss" if kind == "mxfp4" else BASE


def _fp8_target(name: str, t: torch.Tensor) -> bool:
    keep = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", NOT_CONVERTED)
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in keep)


def _int4_target(name: str, t: torch.Tensor) -> bool:
    return ".mlp.experts." in name and t.dim() == 2


def _fp8(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [O, I] -> (q float8_e4m3fn [O, I], scales [ceil(O/128), ceil(I/128)], dequantized float32)."""
    o, i = w.shape
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(o / BLOCK), math.ceil(i / BLOCK))
    deq = torch.empty(o, i)
    for r in range(scales.shape[0]):
        for c in range(scales.shape[1]):
            rows, cols = slice(r * BLOCK, (r + 1) * BLOCK), slice(c * BLOCK, (c + 1) * BLOCK)
            scale = w[rows, cols].abs().max().item() / 448.0
            scale = 2.0 ** math.ceil(math.log2(scale)) if ue8m0 else scale
            q[rows, cols] = (w[rows, cols] / scale).to(torch.float8_e4m3fn)
            scales[r, c] = scale
            deq[rows, cols] = q[rows, cols].float() * torch.tensor(scale, dtype=torch.float32)
    return q, scales, deq


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [O, I] -> (packed int32 [O, I/8], bf16 scales [O, I/32], dequantized float32)."""
    o, i = w.shape
    groups = w.view(o, i // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)  # [O, I/32]
    q = torch.clamp(torch.round(groups / scale.float()[..., None]), -8, 7).to(torch.int32)
    deq = (q * scale.float()[..., None]).view(o, i)
    nibbles = (q.view(o, i) + 8).view(o, i // 8, 8)
    packed = torch.zeros(o, i // 8, dtype=torch.int32)
    for k in range(8):
        packed |= nibbles[:, :, k] << (4 * k)
    return packed, scale, deq


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, K, N] (applied as x @ w[e]) -> (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32],
    transformers' dequantization [E, K, N])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rows = w.transpose(1, 2)  # [E, N, K]: output rows
    blocks = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-30) / 6.0))  # [E, N, G]
    scaled = blocks / torch.exp2(exponent)[..., None]
    nearest = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # [E, N, G, 32]
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = (exponent + 127).to(torch.uint8)
    return packed, scales, convert_moe_packed_tensors(packed, scales, dtype=torch.float32)


def _quantize(kind: str, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    stored, deq = {}, {}
    for name, t in sorted(tensors.items()):
        t = t.float()
        if kind == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"], deq[name] = _mxfp4(t)
            continue
        if kind.startswith("fp8") and _fp8_target(name, t):
            q, scales, deq[name] = _fp8(t, kind == "fp8_ue8m0")
            stored[name] = q
            stored[name + "_scale_inv"] = scales.to(torch.float8_e8m0fnu) if kind == "fp8_ue8m0" else scales
        elif kind == "int4" and _int4_target(name, t):
            base = name[: -len(".weight")]
            stored[base + ".weight_packed"], stored[base + ".weight_scale"], deq[name] = _int4(t)
            stored[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            stored[name] = deq[name] = t
    return stored, deq


def _quant_config(kind: str) -> dict:
    if kind == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"]}
    if kind.startswith("fp8"):
        cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
               "modules_to_not_convert": [NOT_CONVERTED]}
        return {**cfg, "scale_fmt": "ue8m0"} if kind == "fp8_ue8m0" else cfg
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$"]}


def _write(kind: str, out: Path, quantized: bool) -> None:
    base = checkpoint(_base(kind))
    stored, deq = _quantize(kind, load_file(base / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    if quantized:
        config["quantization_config"] = _quant_config(kind)
    save_file(stored if quantized else deq, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _digest(kind: str) -> str:
    recipe = [kind, BLOCK, GROUP, NOT_CONVERTED, Path(__file__).read_text(), str(checkpoint(_base(kind)))]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]


def quantized(kind: str) -> Path:
    return cached(f"{_base(kind)}-{kind}", _digest(kind), lambda out: _write(kind, out, True))


def dequantized(kind: str) -> Path:
    return cached(f"{_base(kind)}-{kind}-dequantized", _digest(kind), lambda out: _write(kind, out, False))
