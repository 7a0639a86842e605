"""Structured output: an llguidance matcher per constrained request, whose token mask is applied to
the request's logits before sampling (every sampling mode), with plain torch ops.

The grammar tokenizer (llguidance's view of tokenizer.json) is built once per process, on the first
constrained request. Requests without a constraint never touch any of this.
V the model's vocabulary (logits), N the tokenizer's, W mask words ((N + 31) // 32).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from services.common.errors import InvalidRequestError

_SHIFTS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """Builds constraints for one tokenizer (tokenizer.json and the stop tokens)."""

    def __init__(self, tokenizer_json: Path, eos_ids: tuple[int, ...]):
        self.path, self.eos_ids = Path(tokenizer_json), eos_ids
        self._tokenizer = None
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(str(self.path), eos_token=list(self.eos_ids) or None)
            return self._tokenizer

    def constraint(self, grammar: str, after: str = "") -> Constraint:
        """A fresh matcher for `grammar` (llguidance JSON or Lark); InvalidRequestError if it is bad."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"constraint.grammar: {matcher.get_error()}")
        return Constraint(matcher, self.tokenizer().vocab_size, after)


class Constraint:
    """One request's grammar state: masks logits while active, follows each sampled token."""

    def __init__(self, matcher, n_vocab: int, after: str = ""):
        self.matcher, self.n_vocab, self.after = matcher, n_vocab, after
        self.active = not after
        self._words = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)  # [W]

    def allowed(self) -> torch.Tensor:
        """bool [N]: the tokens the grammar takes next."""
        w = self._words
        self.matcher.unsafe_compute_mask_ptr(w.data_ptr(), w.numel() * w.element_size())
        return ((w.unsqueeze(1) >> _SHIFTS) & 1).view(-1)[:self.n_vocab].bool()  # [W, 32] -> [N]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V], in place: -inf wherever the grammar forbids (and past the tokenizer's vocabulary)."""
        if not self.active:
            return logits
        n = min(self.n_vocab, logits.numel())
        logits[:n].masked_fill_(~self.allowed()[:n], float("-inf"))
        logits[n:] = float("-inf")
        return logits

    def advance(self, token: int, text: str) -> bool:
        """Follows a sampled token (`text`: all output so far); True when the grammar is complete."""
        if not self.active:
            self.active = bool(self.after) and self.after in text
            return False
        if not self.matcher.consume_token(token):
            raise InvalidRequestError(f"constraint: the grammar cannot continue: {self.matcher.get_error()}")
        return self.matcher.is_stopped()
