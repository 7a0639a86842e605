"""Hugging Face transformers running the same checkpoint: the numerical truth for the dense path."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=2)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """[T, V] float32 logits at every position."""
    return hf_model(path)(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: Path, tokens: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model(path).generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(tokens):].tolist()
