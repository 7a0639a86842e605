"""The MoE block: the router and shared experts run here; routed experts go to the backend.

Shapes: T tokens, D hidden size, E routed experts.
"""

from __future__ import annotations

import torch

from services.common.model_config import ModelConfig
from services.dense.layers.mlp import GatedMLP
from services.dense.moe.experts import ExpertBackend
from services.dense.moe.router import route
from services.dense.weights import WeightLoader


class MoeBlock:
    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int, experts: ExpertBackend):
        moe, d = cfg.moe, cfg.hidden_size
        prefix = f"model.layers.{layer}.{moe.prefix}"
        self.layer, self.router, self.experts = layer, moe.router, experts
        self.gate = w.router(f"{prefix}.{moe.gate_name}", moe.num_experts, d, moe.router_bias)  # [E, D] (+ [E])
        self.bias = None
        if moe.correction_bias:
            self.bias = w.tensor(f"{prefix}.{moe.correction_bias}", (moe.num_experts,), torch.float32)
        self.shared = None
        if moe.shared_intermediate_size:
            shared_prefix = f"{prefix}.{moe.shared_name}"
            self.shared = GatedMLP(w, shared_prefix, d, moe.shared_intermediate_size, cfg.mlp_bias)
        self.shared_gate = w.linear(f"{prefix}.shared_expert_gate", 1, d) if moe.shared_gated else None

    def __call__(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                 routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # [T, D] -> [T, D]
        """logits [T, E] and routing (ids, weights [T, K]): the router's logits and choice, where the
        caller computed them with x (NativeLayer)."""
        if logits is None:
            logits = self.gate(x.float())  # on both of the pool's threads: expect() parks its helpers
        if routing is None:  # the routing runs now, here: time for the backend to get its threads ready
            self.experts.expect(self.layer)
            routing = route(self.router, logits, self.bias)
        ids, weights = routing
        if self.shared is None:  # nothing to compute meanwhile
            return self.experts.forward(self.layer, x, ids, weights)
        handle = self.experts.submit(self.layer, x, ids, weights)
        shared = self._shared(x)
        return self.experts.wait(handle) + shared

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)
        return out if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * out
