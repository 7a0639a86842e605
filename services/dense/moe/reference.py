"""The PyTorch reference expert backend: float weights, in process, one expert at a time.

It is the oracle every other backend (native kernels, remote expert servers) is compared with.
Shapes: T tokens, D hidden size, K experts per token, E experts, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.checkpoint import Checkpoint
from services.common.errors import ExpertBackendError
from services.common.expert_weights import load_expert_stacks
from services.common.model_config import ModelConfig
from services.dense.moe.experts import ExpertBackend
from services.dense.weights import linear


def moe_reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """x [T, D], ids/weights [T, K], w13 [E, 2I, D], w2 [E, D, I] -> [T, D] in w13's dtype."""
    out = torch.zeros(x.shape, dtype=w13.dtype, device=x.device)
    x = x.to(w13.dtype)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        gate, up = linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
    return out


class TorchExperts(ExpertBackend):
    def __init__(self, cfg: ModelConfig, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.stacks = {
            layer: tuple(t.to(device=device, dtype=dtype) for t in load_expert_stacks(checkpoint, cfg, layer))
            for layer in range(cfg.num_layers)
            if cfg.is_moe(layer)
        }

    def submit(self, layer, x, ids, weights):
        if layer not in self.stacks:
            raise ExpertBackendError(layer, "not a MoE layer of this model")
        w13, w2 = self.stacks[layer]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w13.shape[0]):
            raise ExpertBackendError(layer, f"expert id out of range [0, {w13.shape[0]})")
        return moe_reference(x, ids, weights, w13, w2).to(x.dtype)

    def wait(self, handle):
        return handle
