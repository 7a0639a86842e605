"""Random MoE layers and routings for kernel tests, with the torch reference result.

E experts, D hidden size, I expert intermediate size, T tokens, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch

from services.dense.moe.reference import moe_reference


def random_layer(rng: np.random.Generator, experts: int, hidden: int, intermediate: int):
    """float32 w13 [E, 2I, D] and w2 [E, D, I] with the spread of trained weights (std ~ 1/sqrt(fan-in))."""
    w13 = rng.standard_normal((experts, 2 * intermediate, hidden), dtype=np.float32) / hidden**0.5
    w2 = rng.standard_normal((experts, hidden, intermediate), dtype=np.float32) / intermediate**0.5
    return w13, w2


def random_routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int):
    """ids [T, K] int64 (distinct per token, drawn from a subset so some experts stay unused and
    others repeat across tokens) and weights [T, K] float32."""
    pool = rng.choice(experts, size=max(top_k, (3 * experts) // 4), replace=False)
    ids = np.stack([rng.choice(pool, size=top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, top_k), dtype=np.float32)
    return ids.reshape(tokens, top_k), weights


def reference(x, ids, weights, w13, w2) -> np.ndarray:
    t = torch.from_numpy
    return moe_reference(t(x), t(ids), t(weights), t(w13), t(w2)).numpy()


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
