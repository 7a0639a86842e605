"""Generation for one sequence: prefill the prompt, then decode until EOS or max_tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.common.errors import InvalidRequestError
from services.dense.models.decoder import MoeDecoder
from services.dense.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length"


def stream(model: MoeDecoder, prompt: list[int], params: SamplingParams, eos_ids=()) -> Iterator[int]:
    """Yields generated token ids; an EOS token is yielded, then the stream ends."""
    if not prompt:
        raise InvalidRequestError("prompt must hold at least one token")
    total = len(prompt) + params.max_tokens
    if total > model.cfg.max_position_embeddings:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the model's "
            f"context length of {model.cfg.max_position_embeddings}"
        )
    sample, cache = Sampler(params), model.new_cache(total)
    logits = model.forward(torch.tensor(prompt), cache, last_only=True)
    for step in range(params.max_tokens):
        token = sample(logits[-1])
        yield token
        if token in eos_ids or step + 1 == params.max_tokens:
            return
        logits = model.forward(torch.tensor([token]), cache)


def generate(model: MoeDecoder, prompt: list[int], params: SamplingParams, eos_ids=()) -> Generation:
    tokens = list(stream(model, prompt, params, tuple(eos_ids)))
    reason = "stop" if tokens and tokens[-1] in eos_ids else "length"
    return Generation(tokens, reason)
