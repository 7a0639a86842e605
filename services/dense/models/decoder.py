"""The one generic MoE decoder: every family is this assembly, configured by ModelConfig.

A step runs the tokens of several sequences together (each a Chunk continuing its own cache):
everything but attention sees one [T, D] batch, so each MoE layer makes one expert call per step.
Shapes: T tokens of this step, S cached positions, D hidden size, V vocabulary size, R logit rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.model_config import ModelConfig
from dataclasses import dataclass

from services.dense.kv_cache import Segment, SequenceKV
from services.dense.layers.attention import make_attention
from services.dense.layers.mlp import GatedMLP
from services.dense.layers.norm import add_rms_norm
from services.dense.layers.rope import Rotary
from services.dense.models.native_layer import NativeLayer
from services.dense.moe.block import MoeBlock
from services.dense.moe.experts import ExpertBackend
from services.dense.pool import torch_threads
from services.dense.weights import Linear, WeightLoader


@dataclass
class Chunk:
    """Tokens [T] that continue one sequence's cache (a prompt piece or a decoded token)."""

    tokens: torch.Tensor
    cache: object


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: WeightLoader, layer: int, rotary: Rotary, experts: ExpertBackend):
        prefix, d = f"model.layers.{layer}", cfg.hidden_size
        self.eps, self.window = cfg.rms_norm_eps, cfg.window(layer)
        self.input_norm = w.norm(f"{prefix}.input_layernorm", d)
        self.post_attention_norm = w.norm(f"{prefix}.post_attention_layernorm", d)
        self.attention = make_attention(cfg, w, f"{prefix}.self_attn", rotary)
        if cfg.is_moe(layer):
            self.mlp = MoeBlock(cfg, w, layer, experts)
        else:
            self.mlp = GatedMLP(w, f"{prefix}.mlp", d, cfg.intermediate_size, cfg.mlp_bias)
        self.native = NativeLayer.of(self)  # the attention half of a decode step in one call, where it applies

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos_sin,
                 segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h [T, D] with the block output delta [T, D] not yet added into it (None
        at the first layer) -> the same after this layer: each add goes with the norm after it."""
        fused = self.native(h, delta, cos_sin, segments) if self.native is not None else None
        if fused is not None:
            x, logits, routing = fused
            return h, self.mlp(x) if logits is None else self.mlp(x, logits, routing)
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps)
        h, x = add_rms_norm(h, self.attention(x, cos_sin, segments), self.post_attention_norm, self.eps)
        return h, self.mlp(x)


# Up to this many tokens a step is a decode step.
DECODE_TOKENS = 16


class MoeDecoder:
    def __init__(self, cfg: ModelConfig, w: WeightLoader, experts: ExpertBackend):
        d, v = cfg.hidden_size, cfg.vocab_size
        self.cfg, self.dtype, self.device = cfg, w.dtype, w.device
        # packed dense linears leave torch only small ops at decode, and with float32 activations at
        # prefill too (attention is native then): it runs them on one thread, so that no worker of
        # its own spins against the native pool's helpers on the same cores
        packed = w.weights != "float"
        self.decode_threads = 1 if packed else None
        self.prefill_threads = 1 if packed and w.dtype == torch.float32 else None
        self.experts = experts
        self.rotary = Rotary(cfg.rope, w.device)
        self.embed = w.tensor("model.embed_tokens.weight", (v, d))
        self.layers = [DecoderLayer(cfg, w, i, self.rotary, experts) for i in range(cfg.num_layers)]
        self.windows = {layer.window for layer in self.layers}  # the attention spans the layers use
        self.norm = w.norm("model.norm", d)
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in w.checkpoint
        if tied and w.weights == "float":
            self.lm_head = Linear(self.embed)
        else:
            self.lm_head = w.output_linear("model.embed_tokens" if tied else "lm_head", v, d)

    def new_cache(self, capacity: int) -> SequenceKV:
        return SequenceKV(self.cfg, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: SequenceKV, last_only: bool = False) -> torch.Tensor:
        """tokens [T] continuing the cached sequence -> logits [T, V] float32 ([1, V] if last_only)."""
        t = tokens.shape[0]
        return self.forward_batch([Chunk(tokens, cache)], [t - 1] if last_only else list(range(t)))

    @torch.inference_mode()
    def forward_batch(self, chunks: list["Chunk"], logit_rows: list[int]) -> torch.Tensor:
        """Chunks of several sequences in one step -> logits [R, V] float32 of the batch rows asked."""
        decode = sum(len(c.tokens) for c in chunks) <= DECODE_TOKENS
        threads = self.decode_threads if decode else self.prefill_threads
        if threads:
            with torch_threads(threads):
                return self._forward_batch(chunks, logit_rows)
        return self._forward_batch(chunks, logit_rows)

    def _forward_batch(self, chunks: list["Chunk"], logit_rows: list[int]) -> torch.Tensor:
        tokens = torch.cat([c.tokens for c in chunks]).to(self.device)
        positions = []
        for c in chunks:
            c.cache.begin(len(c.tokens))
            positions.append(torch.arange(c.cache.start, c.cache.start + len(c.tokens), device=self.device))
        ends = [c.cache.start + len(c.tokens) for c in chunks]
        cos_sin = self.rotary.cos_sin(torch.cat(positions), max(ends), self.dtype)
        masks = {w: [self._mask(p, end, w) for p, end in zip(positions, ends)] for w in self.windows}
        rows, start = [], 0
        for c in chunks:
            rows.append(slice(start, start + len(c.tokens)))
            start += len(c.tokens)
        h, delta = F.embedding(tokens, self.embed), None
        for i, layer in enumerate(self.layers):
            segments = [Segment(r, c.cache.layers[i], m) for r, c, m in zip(rows, chunks, masks[layer.window])]
            h, delta = layer(h, delta, cos_sin, segments)
        for c in chunks:
            c.cache.commit(len(c.tokens))
        if logit_rows != list(range(h.shape[0])):  # a decode step's rows are all kept: no gather
            keep = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            h, delta = h[keep], None if delta is None else delta[keep]
        _, x = add_rms_norm(h, delta, self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(x).float()

    def _mask(self, positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
        """[T, S] bool: causal, and inside the sliding window when the layer has one."""
        keys = torch.arange(length, device=self.device)
        mask = keys[None, :] <= positions[:, None]
        if window:
            mask &= keys[None, :] > positions[:, None] - window
        return mask
