"""Loads named checkpoint tensors onto the dense side's device and dtype, checking shapes; the
dense linears in the runtime's weight format (float, or packed for the native kernels).

Shapes: M rows (tokens), I input features, O output features (of several linears, side by side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.common.checkpoint import Checkpoint
from services.common.expert_weights import DEFAULT_GROUP_SIZE


ROW_BLOCK = 4
# Bytes per weight of each packed format, scales included (group of 32), for memory estimates.
PACKED_BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0625, "int4": 0.5625, "int4_asym": 0.625}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is independent of the batch around it (batch invariance).

    CPU BLAS picks kernels by the row count, so a token's result would change with its batch-mates;
    rows padded to a multiple of ROW_BLOCK always take the same kernels (checked in the tests).
    x [M, I], weight [O, I] -> [M, O].
    """
    m = x.shape[0]
    pad = -m % ROW_BLOCK
    if x.device.type != "cpu" or x.dim() != 2 or not pad:
        return F.linear(x, weight, bias)
    return F.linear(torch.cat((x, x.new_zeros(pad, x.shape[1]))), weight, bias)[:m]


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # [O, I]
    bias: torch.Tensor | None = None  # [O]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class PackedLinear:
    """A dense linear held in a packed format and computed by the native kernels (one always-active
    expert's matrix): float32 activations in, float32 out, returned in x's dtype."""

    packed: object  # tandem_native.Linear
    pool: object    # tandem_native.ThreadPool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, I] -> [M, O]
        x32 = x.detach().to(torch.float32).contiguous()
        out = torch.empty((x.shape[0], self.packed.out_features), dtype=torch.float32)
        self.packed.forward(x32.numpy(), out.numpy(), self.pool)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class WeightLoader:
    """weights: "float" keeps linears as dtype tensors; a packed format ("bf16", "int8", "int4",
    "int4_asym") packs them for the native kernels on `pool`, importing a checkpoint's stored codes
    as they are where they are that format (an int4 request also takes stored int4_asym codes)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, weights: str = "float",
                 pool=None):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.device = device
        self.weights = weights
        self.pool = pool

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        raw = self.checkpoint.get(name, shape)
        return raw.to(device=self.device, dtype=dtype or self.dtype)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear | PackedLinear:
        return self.linears([prefix], [out_features], in_features, bias)

    def linears(self, prefixes: list[str], outs: list[int], in_features: int, bias: bool = False) -> Linear | PackedLinear:
        """Linears of one input as one: their weights' rows stacked ([sum O, I]), outputs side by side."""
        if self.weights != "float":
            return PackedLinear(self._pack(prefixes, outs, in_features, bias), self.pool)
        weights = [self.tensor(f"{p}.weight", (o, in_features)) for p, o in zip(prefixes, outs)]
        biases = [self.tensor(f"{p}.bias", (o,)) for p, o in zip(prefixes, outs)] if bias else None
        join = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
        return Linear(join(weights), join(biases) if biases else None)

    def float_linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear:
        """A linear kept as dtype tensors whatever the weight format (its weight is used as a tensor)."""
        weight = self.tensor(f"{prefix}.weight", (out_features, in_features))
        return Linear(weight, self.tensor(f"{prefix}.bias", (out_features,)) if bias else None)

    def norm(self, prefix: str, size: int) -> torch.Tensor:
        return self.tensor(f"{prefix}.weight", (size,))

    def _pack(self, prefixes: list[str], outs: list[int], in_features: int, bias: bool):
        import tandem_native

        names = [f"{p}.weight" for p in prefixes]
        stored = self._stored_codes(names, outs, in_features)
        if stored:
            first = stored[0]
            packed = tandem_native.Linear(first.format, sum(outs), in_features, first.group, list(first.levels) or None)
        else:
            packed = tandem_native.Linear(self.weights, sum(outs), in_features, DEFAULT_GROUP_SIZE)
        row0 = 0
        for i, (name, out) in enumerate(zip(names, outs)):
            if stored:
                q = stored[i]
                packed.put_codes(row0, q.codes, q.scales, q.mins)
            else:
                w = self.checkpoint.get(name, (out, in_features)).to(torch.float32).contiguous()
                packed.pack(w.numpy(), self.pool, row0)
            row0 += out
        if bias:
            b = [self.checkpoint.get(f"{p}.bias", (o,)).to(torch.float32) for p, o in zip(prefixes, outs)]
            packed.set_bias(np.ascontiguousarray(torch.cat(b).numpy()))
        return packed

    def _stored_codes(self, names: list[str], outs: list[int], in_features: int) -> list | None:
        """Every part's stored codes when they are all of one packed format the request keeps (the
        same group and levels), else None: the weights are quantized from floats."""
        if self.weights == "bf16":
            return None
        takes = {"int4": ("int4", "int4_asym")}.get(self.weights, (self.weights,))
        codes = [self.checkpoint.quantized(n, (o, in_features)) for n, o in zip(names, outs)]
        if any(q is None for q in codes):
            return None
        first = codes[0]
        same = all((q.format, q.group, tuple(q.levels)) == (first.format, first.group, tuple(first.levels)) for q in codes)
        fits = first.format in takes and first.group % 32 == 0 and in_features % first.group == 0
        return codes if same and fits else None
