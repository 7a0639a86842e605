"""Runs one MoE layer call on the native kernels, after checking it against what this server holds.

Both transports end in the same native Executor: the inline gRPC stream with arrays decoded from
the message (here), the shared-memory session inside native code (shm_session.py). x travels as
float32 or bfloat16 bits; the conversion to the kernels' float32 happens in native code.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import numpy as np

from services.common.errors import InvalidRequestError


class ExpertExecutor:
    def __init__(self, layers: dict, pool, hidden: int, num_experts: int, max_tokens: int, echo: bool = False):
        import tandem_native

        self.layers, self.pool = layers, pool
        self.hidden, self.num_experts, self.max_tokens, self.echo = hidden, num_experts, max_tokens, echo
        # one call at a time on the pool (it is the whole machine already): the native side locks
        self.native = tandem_native.Executor(layers, pool, hidden, num_experts, max_tokens, echo)

    def check(self, layer: int, tokens: int, hidden: int, top_k: int) -> None:
        """Checks a call's header before any of its data is touched; errors name the field."""
        try:
            self.native.check(layer, tokens, hidden, top_k)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """out [T, D] in x's representation (float32, or bfloat16 bits as uint16)."""
        if x.ndim != 2 or ids.ndim != 2:
            raise InvalidRequestError(f"x and ids must be [T, D] and [T, K], got {list(x.shape)} and {list(ids.shape)}")
        self.check(layer, x.shape[0], x.shape[1], ids.shape[1])
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        try:
            self.native.run(layer, x, np.ascontiguousarray(ids), np.ascontiguousarray(weights), out)
        except ValueError as exc:  # the binding's own checks (expert ids out of range, shapes...)
            raise InvalidRequestError(str(exc)) from exc
        return out
