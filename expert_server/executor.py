"""Runs one MoE layer call on the native kernels, after checking it against what this server holds.

Both transports end here: the inline gRPC stream with arrays decoded from the message, the
shared-memory session with views of the segment. T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import threading

import numpy as np

from services.common.errors import InvalidRequestError
from services.common.wire import bf16_bits_to_f32, f32_to_bf16_bits


class ExpertExecutor:
    def __init__(self, layers: dict, pool, hidden: int, num_experts: int, max_tokens: int, echo: bool = False):
        import tandem_native

        self._tn = tandem_native
        self.layers, self.pool = layers, pool
        self.hidden, self.num_experts, self.max_tokens, self.echo = hidden, num_experts, max_tokens, echo
        self._lock = threading.Lock()  # one call at a time on the pool: it is the whole machine already

    def check(self, layer: int, tokens: int, hidden: int, top_k: int) -> None:
        """Checks a call's header before any of its data is touched; errors name the field."""
        if layer not in self.layers:
            owned = sorted(self.layers)
            raise InvalidRequestError(f"layer: {layer} is not served here (this server owns {owned})")
        if hidden != self.hidden:
            raise InvalidRequestError(f"hidden: the model's hidden size is {self.hidden}, the call has {hidden}")
        if not 1 <= tokens <= self.max_tokens:
            raise InvalidRequestError(f"tokens: {tokens} is outside [1, {self.max_tokens}]")
        if not 1 <= top_k <= self.num_experts:
            raise InvalidRequestError(f"top_k: {top_k} is outside [1, {self.num_experts}]")

    def run(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> None:
        """out [T, D] float32 = the layer's weighted experts of x [T, D] float32."""
        with self._lock:
            if self.echo:
                out[...] = x
                return
            try:
                self._tn.moe_forward(self.layers[layer], x, ids, weights, out, self.pool)
            except ValueError as exc:  # the binding's own checks (expert ids out of range...)
                raise InvalidRequestError(str(exc)) from exc

    def compute(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, bf16: bool) -> np.ndarray:
        """The inline path: x as float32 or bfloat16 bits; returns out in the same representation."""
        self.check(layer, x.shape[0], x.shape[1], ids.shape[1] if ids.ndim == 2 else 0)
        x32 = bf16_bits_to_f32(x) if bf16 else np.ascontiguousarray(x)
        out = np.empty(x32.shape, np.float32)
        self.run(layer, x32, np.ascontiguousarray(ids), np.ascontiguousarray(weights), out)
        return f32_to_bf16_bits(out) if bf16 else out
