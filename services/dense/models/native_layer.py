"""A decoder layer's dense side in one native call for a decode step: the input norm, grouped-query
attention (projections, head norms, rotation, the cache write, attention, output projection), the
post-attention norm, the router's logits and its softmax-top-k choice, where the pieces are those
the native kernels compute anyway (packed linears, float32 on the CPU). A decode step made some ten
binding calls a layer for these, each with its Python around it and a wake of the pool's helpers
(the int4 bench model's step took about a tenth longer so). The same kernels run in the same order,
so the bits are those of the pieces called apart. A paged cache's sequence is followed through its
block table where its blocks are not one run.
Shapes: T tokens of the step, D hidden size, E routed experts, S a sequence's cached positions.
"""

from __future__ import annotations

import torch

from services.dense.kv_cache import Segment
from services.dense.layers.attention import GROUPED_MAX_TOKENS, GQAttention
from services.dense.layers.native_ops import tandem_native as _native
from services.dense.moe.block import MoeBlock
from services.dense.weights import ExactLinear, PackedLinear, PackedLinears


def _packed(linear) -> tuple | None:
    """A packed linear's (or linears') tandem_native.Linear parts, None for another kind."""
    if isinstance(linear, PackedLinear):
        return (linear.packed,)
    return linear.packed if isinstance(linear, PackedLinears) else None


def _floats(t: torch.Tensor | None):
    return None if t is None else t.detach().float().contiguous().numpy()


class NativeLayer:
    def __init__(self, layer, pool, qkv: tuple, o: tuple, gate: ExactLinear | None):
        att, a = layer.attention, layer.attention.a
        head_norm = a.qk_norm == "head"
        self.pool = pool
        self.experts = 0 if gate is None else gate.weight.shape[0]
        router = layer.mlp.router if gate is not None else None
        self.top_k = router.top_k if router is not None and router.method == "softmax_topk" else 0  # routes too
        self.native = _native.DecodeLayer(
            _floats(layer.input_norm), _floats(layer.post_attention_norm), layer.eps, list(qkv), list(o), a.num_heads,
            a.num_kv_heads, a.head_dim, _floats(att.q_norm) if head_norm else None,
            _floats(att.k_norm) if head_norm else None, att.rotary.interleaved, a.softmax_scale, _floats(att.sinks),
            None if gate is None else gate.weight.numpy(), None if gate is None else _floats(gate.bias), [*qkv, *o],
            self.top_k, bool(self.top_k and router.norm_topk_prob), router.routed_scaling_factor if self.top_k else 1.0)

    @classmethod
    def of(cls, layer) -> NativeLayer | None:
        """The layer's native decode call where its pieces allow it, else None."""
        att = layer.attention
        if _native is None or not isinstance(att, GQAttention) or att.pool is None or att.a.qk_norm == "all":
            return None
        if layer.input_norm.dtype != torch.float32 or layer.input_norm.device.type != "cpu":
            return None
        qkv, o = _packed(att.qkv_proj), _packed(att.o_proj)
        gate = layer.mlp.gate if isinstance(layer.mlp, MoeBlock) else None
        if qkv is None or o is None or (isinstance(layer.mlp, MoeBlock) and not isinstance(gate, ExactLinear)):
            return None
        return cls(layer, att.pool, qkv, o, gate)

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos_sin,
                 segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None] | None:
        """As DecoderLayer's attention half: h [T, D] (+= delta, += attention, in place) -> x [T, D] for
        the MLP, the router's logits [T, E] (None without a router) and, where its method is
        softmax_topk, its choice (ids [T, K] int64, weights [T, K] float32; else None); None where
        the step does not fit (a prompt chunk)."""
        t, (cos, sin) = h.shape[0], cos_sin
        floats = h.dtype == cos.dtype == torch.float32 and (delta is None or delta.dtype == torch.float32)
        if t > GROUPED_MAX_TOKENS or not floats or not h.is_contiguous():
            return None
        sequences = []
        for seg in segments:
            span = seg.kv.span()
            if span is None:
                return None
            (k, v), first, start, slots = span
            sequences.append((seg.rows.start, seg.rows.stop - seg.rows.start, k, v, first, start,
                              seg.mask.contiguous().numpy(), slots))
        x = torch.empty_like(h)
        logits = torch.empty((t, self.experts), dtype=torch.float32) if self.experts else None
        routing = None
        if self.top_k:
            routing = torch.empty((t, self.top_k), dtype=torch.int64), torch.empty((t, self.top_k), dtype=torch.float32)
        self.native.forward(h.numpy(), None if delta is None else delta.contiguous().numpy(), cos.numpy(), sin.numpy(),
                            sequences, x.numpy(), None if logits is None else logits.numpy(),
                            *((None, None) if routing is None else (r.numpy() for r in routing)), self.pool)
        return x, logits, routing
