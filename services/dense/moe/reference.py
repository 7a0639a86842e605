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


def glu(gate: torch.Tensor, up: torch.Tensor, act: tuple[str, float, float] = ("silu", 0.0, 0.0)) -> torch.Tensor:
    """The experts' gated activation: act = (kind, alpha, limit), ACTIVATIONS of model_config."""
    kind, alpha, limit = act
    if kind == "silu":
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def moe_reference(x, ids, weights, w13, w2, b13=None, b2=None, act=("silu", 0.0, 0.0)) -> torch.Tensor:
    """x [T, D], ids/weights [T, K], w13 [E, 2I, D], w2 [E, D, I] (biases b13 [E, 2I], b2 [E, D])
    -> [T, D] in w13's dtype."""
    out = torch.zeros(x.shape, dtype=w13.dtype, device=x.device)
    x = x.to(w13.dtype)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        gate, up = linear(x[tok], w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
        y = linear(glu(gate, up, act), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
    return out


class TorchExperts(ExpertBackend):
    def __init__(self, cfg: ModelConfig, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.act = (cfg.moe.activation, cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit)
        self.stacks = {}
        for layer in (i for i in range(cfg.num_layers) if cfg.is_moe(i)):
            s = load_expert_stacks(checkpoint, cfg, layer)
            self.stacks[layer] = tuple(None if t is None else t.to(device=device, dtype=dtype) for t in (s.w13, s.w2, s.b13, s.b2))

    def submit(self, layer, x, ids, weights):
        if layer not in self.stacks:
            raise ExpertBackendError(layer, "not a MoE layer of this model")
        w13, w2, b13, b2 = self.stacks[layer]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= w13.shape[0]):
            raise ExpertBackendError(layer, f"expert id out of range [0, {w13.shape[0]})")
        return moe_reference(x, ids, weights, w13, w2, b13, b2, self.act).to(x.dtype)

    def wait(self, handle):
        return handle
