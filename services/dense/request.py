"""One generation request as the engine tracks it, and the outputs it streams back."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import torch

from services.common.errors import TandemError
from services.dense.detokenizer import Detokenizer
from services.dense.sampling import Sampler, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class Output:
    """A streamed piece: new token ids, their text, logprobs; the last one has finish_reason set."""

    token_ids: tuple[int, ...]
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: TandemError | None = None  # set when the request failed (the stream ends with it)
    timing: tuple[float, float, float] | None = None  # (queue, prefill, decode) seconds, in the last one
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    stop_text: str = ""  # the stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)  # identity: the engine finds requests in its lists by the object, not its fields
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    tokenizer: object | None = None
    deadline: float | None = None  # time.monotonic() after which the request is dropped
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    prefilled: int = 0  # tokens of `target` already in the cache
    cache: object | None = None  # the PagedSequence, while running
    limit: int | None = None  # tokens it may generate: max_tokens, capped by the context (set by the engine)
    cancelled: bool = False
    preempted: int = 0  # times its blocks were taken back to let others run
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    span: object | None = None  # the request's trace span, when traced
    constraint: object | None = None  # a constraint.Constraint (structured output), or None
    keep_special_tokens: bool = False  # special tokens' text is part of the output
    submitted_ns: int = field(default_factory=time.time_ns)
    admitted_ns: int | None = None
    first_token_ns: int | None = None

    def __post_init__(self):
        stop_ids = tuple(self.params.stop_token_ids)
        barred = stop_ids + (() if self.params.ignore_eos else self.eos_ids)
        self.sampler = Sampler(self.params, history=list(self.prompt), barred=barred, constraint=self.constraint)
        self.stop_ids = set(stop_ids) | (set() if self.params.ignore_eos else set(self.eos_ids))
        self.detokenizer = (Detokenizer(self.tokenizer, self.prompt, self.params.stop, self.keep_special_tokens)
                            if self.tokenizer else None)
        self.target = self.prompt  # what prefill puts in the cache: the prompt, or after a preemption all so far
        if self.limit is None:
            self.limit = self.params.max_tokens

    @property
    def generated(self) -> list[int]:
        return self.sampler.generated

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.target)

    def next_tokens(self, budget: int) -> torch.Tensor:
        """The tokens this request feeds in the next step: a prefill chunk, or its last sampled token."""
        if self.prefilling:
            return torch.tensor(self.target[self.prefilled:self.prefilled + budget])
        return torch.tensor(self.generated[-1:])

    def preempt(self) -> None:
        """Gives its cache back; it resumes by prefilling everything so far (then samples on as if
        it had never stopped: the sampler and detokenizer keep their state)."""
        self.cache.free()
        self.cache = None
        self.target = self.prompt + self.generated
        self.prefilled = 0
        self.preempted += 1

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    def accept(self, logits: torch.Tensor) -> Output:
        """Samples the next token from logits [V] and says what to stream (and whether it is over)."""
        token, logprobs = self.sampler.sample(logits)
        eos = token in self.eos_ids and self.keep_special_tokens  # its text is no part of the answer
        text = self.detokenizer.add(token) if self.detokenizer and not eos else ""
        reason = None
        if token in self.stop_ids:
            reason = "stop"
        elif self._grammar_done(token):
            reason = "stop"
        elif self.detokenizer and self.detokenizer.stopped_by is not None:
            reason = "stop"
        elif self.limit is not None and len(self.generated) >= self.limit:
            reason = "length"
        if self.first_token_ns is None:
            self.first_token_ns = time.time_ns()
        if reason and self.detokenizer:
            text += self.detokenizer.flush()
        return Output((token,), text, (logprobs,) if logprobs else (), reason, len(self.prompt), len(self.generated),
                      timing=self.timing() if reason else None, cached_tokens=self.cached_tokens,
                      stop_text=(self.detokenizer.stopped_by or "") if reason and self.detokenizer else "")

    def _grammar_done(self, token: int) -> bool:
        """Moves the constraint on by the sampled token; True once its grammar is complete."""
        return self.constraint is not None and self.constraint.advance(token, self.detokenizer.text if self.detokenizer
                                                                        else "")

    def finish(self, reason: str | None = None, error: TandemError | None = None) -> None:
        self.outputs.put(Output((), "", (), reason, len(self.prompt), len(self.generated), error, self.timing(),
                                self.cached_tokens))

    def timing(self) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds so far."""
        now = time.time_ns()
        admitted = self.admitted_ns or now
        first = self.first_token_ns or now
        return (admitted - self.submitted_ns) / 1e9, (first - admitted) / 1e9, (now - first) / 1e9


def monotonic_deadline(seconds: float | None) -> float | None:
    return None if seconds is None else time.monotonic() + seconds
