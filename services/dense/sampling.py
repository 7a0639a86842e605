"""Per-request sampling: greedy, or temperature / top-k / top-p with a seeded generator.

Sampling runs on the CPU in float32 so a seed gives the same tokens on every device.
V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    max_tokens: int = 16

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> the next token id."""
        p = self.params
        logits = logits.detach().float().cpu()
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if p.top_p < 1:
            probs = _top_p(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
