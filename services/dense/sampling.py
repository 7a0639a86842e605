"""Per-request sampling: penalties, temperature, min-p / top-k / top-p, a seeded generator, logprobs.

Sampling runs on the CPU in float32 with the request's own generator, so a seed gives the same
tokens on every device and whatever else shares the batch. Every validation error names its field.
V vocabulary size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from services.common.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_BIAS = 100.0  # a logit_bias value's bound: -100 bans a token, +100 forces it, in practice


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    max_tokens: int | None = None  # None: until EOS, a stop, or the end of the context
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages any token already in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    min_tokens: int = 0  # EOS and stop tokens are barred before this many tokens
    stop: tuple[str, ...] = ()  # stop strings (not part of the output)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the n most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), clamped to +-MAX_BIAS

    def __post_init__(self):
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
               f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")
        _check(all(isinstance(t, int) and t >= 0 for t, _ in self.logit_bias), "logit_bias",
               "keys must be non-negative token ids")
        _check(all(math.isfinite(v) for _, v in self.logit_bias), "logit_bias", "values must be finite numbers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}: {message}")


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the n most likely (token, logprob), best first


@dataclass
class Sampler:
    """One request's sampler; `history` is the prompt, `generated` grows with each sampled token."""

    params: SamplingParams
    history: list[int] = field(default_factory=list)
    barred: tuple[int, ...] = ()  # EOS and stop ids, barred while fewer than min_tokens are out
    generated: list[int] = field(default_factory=list)
    constraint: object | None = None  # a constraint.Constraint: the grammar's mask, applied last

    def __post_init__(self):
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()
        self._counts: Counter = Counter()
        self._seen = set(self.history)
        bias = self.params.logit_bias
        self._bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self._bias = torch.tensor([v for _, v in bias], dtype=torch.float32).clamp(-MAX_BIAS, MAX_BIAS)
        p = self.params
        self._plain_greedy = (p.greedy and not bias and p.repetition_penalty == 1 and not p.presence_penalty
                              and not p.frequency_penalty and not (p.min_tokens and self.barred)
                              and self.constraint is None and p.logprobs is None)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> the next token id (recorded as generated)."""
        return self.sample(logits)[0]

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        if self._plain_greedy:  # one op where nothing would change the logits: a decode step's Python runs cold
            token = int(logits.argmax())
            self.generated.append(token)
            return token, None
        raw = logits.detach().float().cpu()
        token = self._choose(self._process(raw.clone()))
        self.generated.append(token)
        self._counts[token] += 1
        self._seen.add(token)
        return token, self._logprobs(raw, token)

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.logit_bias:
            logits.index_add_(0, self._bias_ids, self._bias)
        if p.repetition_penalty != 1 and self._seen:
            ids = torch.tensor(sorted(self._seen))
            picked = logits[ids]
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = torch.tensor(list(self._counts))
            counts = torch.tensor([float(c) for c in self._counts.values()])
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if len(self.generated) < p.min_tokens and self.barred:
            logits[torch.tensor(self.barred)] = float("-inf")
        if self.constraint is not None:
            self.constraint.mask(logits)
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1:
            probs = _top_p(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _logprobs(self, raw: torch.Tensor, token: int) -> TokenLogprobs | None:
        """Log-probabilities of the model's own distribution (before penalties and temperature)."""
        n = self.params.logprobs
        if n is None:
            return None
        logp = raw.log_softmax(-1)
        top = logp.topk(n) if n else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprobs(token, float(logp[token]), alternatives)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
