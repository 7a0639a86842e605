"""Routing: router logits -> top-k expert ids and their final weights (scaled, renormalised).

Shapes: T tokens, E routed experts, K experts per token, G groups.
"""

from __future__ import annotations

import torch

from services.common.model_config import RouterConfig

from services.dense.layers.native_ops import tandem_native as _native


def _group_mask(scores: torch.Tensor, cfg: RouterConfig, group_score) -> torch.Tensor:
    """[T, E] bool: experts inside the topk_group best groups of each token."""
    t = scores.shape[0]
    groups = group_score(scores.view(t, cfg.n_group, -1))  # [T, G]
    best = groups.topk(cfg.topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand(t, cfg.n_group, cfg.num_experts // cfg.n_group).reshape(t, -1)


def _softmax_topk(logits, cfg, bias):
    probs = logits.softmax(dim=-1)
    weights, ids = probs.topk(cfg.top_k, dim=-1)
    return ids, weights


def _greedy(logits, cfg, bias):
    weights, ids = logits.softmax(dim=-1).topk(cfg.top_k, dim=-1, sorted=False)
    return ids, weights


def _group_limited_greedy(logits, cfg, bias):
    probs = logits.softmax(dim=-1)
    mask = _group_mask(probs, cfg, lambda g: g.max(dim=-1).values)
    weights, ids = probs.masked_fill(~mask, 0.0).topk(cfg.top_k, dim=-1, sorted=False)
    return ids, weights


def _noaux_tc(logits, cfg, bias):
    """DeepSeek-V3: sigmoid scores; the correction bias steers the choice but not the weights."""
    scores = logits.sigmoid()
    choice = scores + bias
    mask = _group_mask(choice, cfg, lambda g: g.topk(2, dim=-1).values.sum(dim=-1))
    ids = choice.masked_fill(~mask, float("-inf")).topk(cfg.top_k, dim=-1, sorted=False).indices
    return ids, scores.gather(1, ids)


def _topk_softmax(logits, cfg, bias):
    """gpt-oss: the top-k logits, then a softmax over those k."""
    values, ids = logits.topk(cfg.top_k, dim=-1)
    return ids, values.softmax(dim=-1)


_METHODS = {
    "softmax_topk": _softmax_topk,
    "greedy": _greedy,
    "group_limited_greedy": _group_limited_greedy,
    "noaux_tc": _noaux_tc,
    "topk_softmax": _topk_softmax,
}


def _native_softmax_topk(cfg: RouterConfig, logits: torch.Tensor):
    """softmax_topk, its normalisation and scaling in one native call (five small torch ops a layer)."""
    t = logits.shape[0]
    ids, weights = torch.empty((t, cfg.top_k), dtype=torch.int64), torch.empty((t, cfg.top_k), dtype=torch.float32)
    _native.route_softmax_topk(logits.detach().float().contiguous().numpy(), cfg.top_k, cfg.norm_topk_prob,
                               cfg.routed_scaling_factor, ids.numpy(), weights.numpy())
    return ids, weights


def route(cfg: RouterConfig, logits: torch.Tensor, bias: torch.Tensor | None = None):
    """logits [T, E] float32 -> ids [T, K] int64, weights [T, K] float32."""
    if cfg.method == "softmax_topk" and _native is not None and logits.device.type == "cpu":
        return _native_softmax_topk(cfg, logits)
    ids, weights = _METHODS[cfg.method](logits.float(), cfg, bias)
    if cfg.norm_topk_prob:
        eps = 1e-20 if cfg.method == "noaux_tc" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return ids, weights * cfg.routed_scaling_factor
