"""The one interface every checkpoint source gives: named float tensors in the Hugging Face naming.

A source reads one tensor at a time, dequantized from however it is stored, so nothing ever holds
a whole high-precision copy of a big checkpoint. A source whose stored codes coincide with a packed
expert format also hands them out as they are (QuantizedWeight), so they import without a second
rounding. O output features (rows), I input features (columns), G group size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import CheckpointError


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight in a packed format's own terms: w[o, i] = fp16(scales[o, i // G]) * level(codes[o, i]),
    plus fp16(mins[o, i // G]) for int4_asym."""

    format: str          # "int8" (codes: the int8 values' bits), "int4" (indices into levels), "int4_asym" (q 0-15)
    codes: np.ndarray    # uint8 [O, I]
    scales: np.ndarray   # uint16 [O, I / G]: fp16 bits
    group: int
    levels: tuple[int, ...] = ()  # int4: the 16 int8 levels, strictly increasing
    mins: np.ndarray | None = None  # int4_asym: uint16 [O, I / G], fp16 bits


class TensorSource(ABC):
    """Named tensors of one checkpoint; `kind` says where they come from (printed at load)."""

    kind: str

    @abstractmethod
    def names(self) -> Iterable[str]:
        """Every tensor's Hugging Face name."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The logical (dequantized) shape; raises KeyError for an unknown name."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The tensor in a float dtype (float32, bfloat16 or float16)."""

    @abstractmethod
    def stored_bytes(self, name: str) -> int:
        """Bytes of the file(s) behind the tensor, scales included (what reading it costs)."""

    def quantized(self, name: str, index: int | None = None) -> QuantizedWeight | None:
        """The stored codes (of slice `index` of a stacked expert tensor) when they are a packed
        format's, else None."""
        return None

    @abstractmethod
    def fingerprint(self, h) -> None:
        """Adds what identifies the stored weights (names, sizes, headers; not the data) to the hash h."""


def fp16_bits(scales: torch.Tensor) -> np.ndarray | None:
    """Scales as fp16 bits when every one converts exactly (else None: they would be rounded)."""
    s = scales.float()
    half = s.to(torch.float16)
    if not torch.equal(half.float(), s) or not torch.isfinite(s).all():
        return None
    return half.view(torch.int16).numpy().view(np.uint16)


def check_scale_shape(name: str, file: str, shape: tuple[int, ...], want: tuple[int, ...], why: str) -> None:
    if tuple(shape) != tuple(want):
        raise CheckpointError(
            f"scale tensor {name!r} in {file} has shape {list(shape)}, expected {list(want)} ({why})"
        )
