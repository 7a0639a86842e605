"""The one interface through which the dense side reaches routed experts.

Contract: submit(layer, x [T, D], ids [T, K] int64, weights [T, K] float32) -> handle, then
wait(handle) -> [T, D] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), in x's dtype and device.
Inputs are never modified; failures raise ExpertBackendError carrying the layer.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class ExpertBackend(ABC):
    @abstractmethod
    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
        """Start computing one MoE layer; may return before the work is done."""

    @abstractmethod
    def wait(self, handle: Any) -> torch.Tensor:
        """The [T, D] result of a submitted call."""

    def expect(self, layer: int) -> None:
        """A hint that a call for layer follows shortly (its router logits are in, its routing starts
        now): a backend may get its threads ready. Never fails."""

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(layer, x, ids, weights))

    def close(self) -> None:
        """Release what the backend holds (threads, connections, memory)."""
