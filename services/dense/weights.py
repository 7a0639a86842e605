"""Loads named checkpoint tensors onto the dense side's device and dtype, checking shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common.checkpoint import Checkpoint


ROW_BLOCK = 4


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


class WeightLoader:
    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device):
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.device = device

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        raw = self.checkpoint.get(name, shape)
        return raw.to(device=self.device, dtype=dtype or self.dtype)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear:
        weight = self.tensor(f"{prefix}.weight", (out_features, in_features))
        return Linear(weight, self.tensor(f"{prefix}.bias", (out_features,)) if bias else None)

    def norm(self, prefix: str, size: int) -> torch.Tensor:
        return self.tensor(f"{prefix}.weight", (size,))
