"""KV cache of one sequence: preallocated per layer, filled in order of position.

GQA layers keep keys and values [S, Hkv, Dh]; MLA layers keep the compressed latent [S, C] and the
shared rotated key [S, R], as the reference implementation does (the cache is what makes MLA small).
S cached positions, Hkv key/value heads, Dh head size, C kv_lora_rank, R rotated dims.
"""

from __future__ import annotations

import torch

from services.common.errors import InvalidRequestError
from services.common.model_config import ModelConfig


class LayerKV:
    def __init__(self, shapes: tuple[tuple[int, ...], ...], capacity: int, dtype: torch.dtype, device: torch.device):
        self.buffers = tuple(torch.empty((capacity, *s), dtype=dtype, device=device) for s in shapes)
        self.cache: SequenceKV | None = None

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write this step's entries [T, ...] at the step's offset; return everything cached [S, ...]."""
        start, end = self.cache.start, self.cache.start + new[0].shape[0]
        for buf, x in zip(self.buffers, new):
            buf[start:end] = x
        return tuple(buf[:end] for buf in self.buffers)


class SequenceKV:
    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        attn = config.attention
        if attn.kind == "mla":
            shapes = ((attn.kv_lora_rank,), (attn.qk_rope_head_dim,))
        else:
            shapes = ((attn.num_kv_heads, attn.head_dim), (attn.num_kv_heads, attn.head_dim))
        self.capacity = capacity
        self.length = 0  # positions committed so far
        self.start = 0  # offset of the step in progress
        self.layers = [LayerKV(shapes, capacity, dtype, device) for _ in range(config.num_layers)]
        for layer in self.layers:
            layer.cache = self

    def begin(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.capacity:
            raise InvalidRequestError(
                f"sequence of {self.length + num_tokens} tokens exceeds the KV cache capacity of {self.capacity}"
            )
        self.start = self.length

    def commit(self, num_tokens: int) -> None:
        self.length = self.start + num_tokens
