"""Rotary position embeddings: default, linear and YaRN frequencies; half or interleaved pairs.

Shapes: T tokens, H heads, R rotated dims per head (R/2 frequencies).
"""

from __future__ import annotations

import math

import torch

from services.common.model_config import RopeConfig, yarn_mscale

from services.dense.layers.native_ops import tandem_native as _native
from services.dense.layers.norm import rms_norm


def _yarn(rope: RopeConfig, base_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim = rope.dim

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rope.factor * base_freqs)) * (1 - extrapolation) + (1.0 / base_freqs) * extrapolation
    factor = rope.attention_factor
    if factor is None:
        if rope.mscale and rope.mscale_all_dim:
            factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            factor = yarn_mscale(rope.factor)
    return inv_freq, float(factor)


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """[R/2] inverse frequencies and the scale applied to cos/sin."""
    base_freqs = rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.float32) / rope.dim)
    if rope.kind == "yarn":
        return _yarn(rope, base_freqs)
    inv_freq = 1.0 / base_freqs
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    return inv_freq, 1.0


class Rotary:
    def __init__(self, rope: RopeConfig, device: torch.device):
        inv_freq, self.scale = inverse_frequencies(rope)
        self.inv_freq = inv_freq.to(device)
        self.interleaved = rope.interleaved
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [N, R/2] of positions 0..N-1

    def cos_sin(self, positions: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], all below end -> cos, sin [T, R/2]: rows of a table of every position up to
        the longest asked so far (a decode step takes its row in two small ops instead of six)."""
        if self._table is None or self._table[0].shape[0] < end or self._table[0].dtype != dtype:
            rows = max(64, 1 << (end - 1).bit_length())
            freqs = torch.arange(rows, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            self._table = (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        cos, sin = self._table  # [N, R/2]
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
              norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """x [T, H, R] -> rotated [T, H, R]; interleaved pairs come out as (evens, odds) halves. With
        partial rotary (x wider than R), the first R dims of each head turn and the rest pass. norm
        [R]: each head is RMS-normed (eps) first (Qwen3's per-head q and k norms), in the same call.
        out (x itself, say) receives the result where the native call applies: float32 on the CPU."""
        if _native is not None and x.device.type == "cpu" and all(t.dtype == torch.float32 for t in (x, cos, sin)):
            out = torch.empty(x.shape, dtype=torch.float32) if out is None else out
            _native.rope(x.detach().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), self.interleaved,
                         out.detach().numpy(), None if norm is None else norm.float().numpy(), eps)
            return out
        if norm is not None:
            x = rms_norm(x, norm, eps)
        dim = 2 * cos.shape[-1]
        if x.shape[-1] > dim:
            return torch.cat((self.apply(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
