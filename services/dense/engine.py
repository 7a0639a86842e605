"""The engine: continuous batching over a paged KV cache with a fixed budget.

Each step takes every running sequence's next token plus prompt chunks (up to a token budget, so a
long prompt never stalls running decodes), runs them as one batch (one expert call per MoE layer),
samples per request, and streams outputs. New requests join between steps. KV blocks are taken as
sequences grow: a request is admitted when its prompt fits with a block of headroom per running
sequence, and when a step's sequences need more blocks than are free, the most recently admitted
running request is preempted (its blocks freed, itself queued first to resume by prefilling all it
has so far) rather than any request failing. A request without max_tokens runs until EOS, a stop,
or the end of the context (or of the whole cache, if that is smaller). Requests that do not fit
wait in a bounded queue, and past it are refused.
T tokens of a step, V vocabulary size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from services.common.cpu_wake import CpuWake
from services.common.errors import (CancelledError, InvalidRequestError, ResourceExhaustedError,
                                    TandemError)
from services.dense.kv_cache import BlockPool, PagedSequence
from services.dense.models.decoder import Chunk, MoeDecoder
from services.dense import tracing
from services.dense.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    kv_blocks: int
    block_size: int = 16
    max_batch_tokens: int = 512  # tokens per step: decodes first, then prompt chunks
    max_running: int = 64
    max_queue: int = 256
    prefix_caching: bool = True  # full KV blocks kept and reused across requests
    keep_cpus_awake: bool = False  # the loop holds the CPUs' wake-up latency at 0 while it has work (cpu_wake)

    def __post_init__(self):
        for name in ("kv_blocks", "block_size", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise InvalidRequestError(f"max_queue: must be >= 0, got {self.max_queue}")


class Engine:
    def __init__(self, model: MoeDecoder, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.pool = BlockPool(model.cfg, cfg.kv_blocks, cfg.block_size, model.dtype, model.device,
                              caching=cfg.prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in order of admission
        self.preemptions = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None

    # --- the outside: submit, abort, counters -------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queues a request, or raises InvalidRequestError / ResourceExhaustedError right away."""
        self._validate(request)
        with self._lock:
            if len(self.waiting) >= self.cfg.max_queue and not self._fits_now(request):
                raise ResourceExhaustedError(
                    f"the KV cache is full and {len(self.waiting)} requests are already queued (limit "
                    f"{self.cfg.max_queue}); retry later"
                )
            self.waiting.append(request)
            self._work.notify()
        return request

    def _validate(self, request: Request) -> None:
        """Refuses what can never run; sets the request's limit (max_tokens, capped by the context)."""
        n, limit, wanted = len(request.prompt), self.model.cfg.max_position_embeddings, request.params.max_tokens
        if n == 0:
            raise InvalidRequestError("prompt: must hold at least one token")
        if wanted is not None and n + wanted > limit:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({wanted}) = {n + wanted} exceeds the model's context length "
                f"of {limit}"
            )
        if n >= limit:
            raise InvalidRequestError(f"prompt ({n} tokens) leaves no room to generate in the model's context length "
                                      f"of {limit}")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        outside = [t for t, _ in request.params.logit_bias if t >= vocab]
        if outside:
            raise InvalidRequestError(f"logit_bias: token id {outside[0]} is not in the vocabulary [0, {vocab})")
        capacity = self.pool.num_blocks * self.pool.block_size
        if n + (wanted or 1) > capacity:
            raise ResourceExhaustedError(
                f"prompt + max_tokens = {n + (wanted or 1)} tokens is more than the whole KV cache "
                f"({capacity} tokens)"
            )
        request.limit = min(wanted or limit, limit - n, capacity - n)

    def abort(self, request: Request) -> None:
        """Marks a request cancelled; it leaves at the next step and its blocks are freed."""
        request.cancelled = True
        with self._lock:
            self._work.notify()

    @property
    def blocks_in_use(self) -> int:
        return self.pool.used_blocks

    def _fits_now(self, request: Request) -> bool:
        """Room for its prefill and first token besides what the running sequences will take for
        theirs, with a block to grow into for each of them."""
        need = self._next_blocks(request) + sum(self._next_blocks(r) + 1 for r in self.running)
        return need <= self.pool.free_blocks and len(self.running) < self.cfg.max_running

    def _next_blocks(self, request: Request) -> int:
        """Blocks it still needs before its next token is sampled."""
        held = len(request.cache.blocks) if request.cache is not None else 0
        length = request.cache.length if request.cache is not None else 0
        return max(self.pool.blocks_for(max(length, len(request.target)) + 1) - held, 0)

    # --- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._work.notify()
        if self._thread is not None:
            self._thread.join()
        for request in list(self.waiting) + self.running:
            self._end(request, error=CancelledError("the server is shutting down"))

    def _loop(self) -> None:
        awake = CpuWake(self.cfg.keep_cpus_awake)
        try:
            while True:
                with self._lock:
                    if not self.has_work():
                        awake.release()  # idle: the machine's sleep states again
                    while not self._stopped and not self.has_work():
                        self._work.wait()
                    if self._stopped:
                        return
                awake.hold()
                self.step()
        finally:
            awake.release()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> None:
        """Drops cancelled and expired requests, admits new ones, runs one batch, streams outputs."""
        self._drop_finished_early()
        self._admit()
        batch = self._plan()
        if not batch:
            return
        chunks = [c for _, c, _ in batch]
        stats = getattr(self.model.experts, "take_step_stats", None)
        try:
            with tracing.step([r for r, _, _ in batch], sum(len(c.tokens) for c in chunks), stats):
                logits = self.model.forward_batch(chunks, [row for *_, row in batch if row is not None])
        except TandemError as exc:
            log.warning("step failed: %s", exc)
            for request, _, _ in batch:
                self._end(request, error=exc)
            return
        self._emit(batch, logits)

    def _drop_finished_early(self) -> None:
        now = time.monotonic()
        with self._lock:
            waiting = list(self.waiting)
        for request in waiting + list(self.running):
            if request.cancelled:
                self._end(request, reason="abort")
            elif request.expired(now):
                self._end(request, error=CancelledError("the request's deadline passed", deadline=True))

    def _admit(self) -> None:
        with self._lock:
            while self.waiting and self._fits_now(self.waiting[0]):
                request = self.waiting.popleft()
                request.cache = PagedSequence(self.pool)
                request.prefilled = request.cache.reuse(request.target)
                self.pool.queries += len(request.target)
                self.pool.hits += request.prefilled
                if not request.admitted_ns:  # usage counts a prompt's first admission, not a resumption
                    request.cached_tokens = request.prefilled
                request.admitted_ns = request.admitted_ns or time.time_ns()
                self.running.append(request)

    def _plan(self) -> list[tuple[Request, Chunk, int | None]]:
        """This step's batch, preempting the latest admitted requests while it needs more blocks than are free."""
        while True:
            batch = self._batch()
            need = sum(self.pool.blocks_for(r.cache.length + len(c.tokens)) - len(r.cache.blocks) for r, c, _ in batch)
            if need <= self.pool.free_blocks or len(self.running) <= 1:
                return batch
            self._preempt(self.running[-1])

    def _batch(self) -> list[tuple[Request, Chunk, int | None]]:
        """(request, chunk, logit row or None) for this step: decodes first, then prefill chunks."""
        budget, rows, batch = self.cfg.max_batch_tokens, 0, []
        for request in sorted(self.running, key=lambda r: r.prefilling):
            if budget <= 0:
                break
            tokens = request.next_tokens(budget)
            done_prefill = not request.prefilling or request.prefilled + len(tokens) == len(request.target)
            rows += len(tokens)
            batch.append((request, Chunk(tokens, request.cache), rows - 1 if done_prefill else None))
            budget -= len(tokens)
        return batch

    def _preempt(self, request: Request) -> None:
        log.info("preempting %s (%d tokens so far) to free KV blocks", request.request_id,
                 len(request.prompt) + len(request.generated))
        with self._lock:
            self.running.remove(request)
            request.preempt()
            self.waiting.appendleft(request)
        self.preemptions += 1

    def _emit(self, batch, logits: torch.Tensor) -> None:
        i = 0
        for request, chunk, row in batch:
            request.cache.record(chunk.tokens.tolist())
            if request.prefilling:
                request.prefilled += len(chunk.tokens)
            if row is None:
                continue
            row_logits, i = logits[i], i + 1
            try:
                output = request.accept(row_logits)
            except TandemError as exc:  # its constraint could not follow the sampled token
                self._end(request, error=exc)
                continue
            request.outputs.put(output)
            if output.finished:
                tracing.end_request(request, output.finish_reason, None)
                self._release(request)

    def _end(self, request: Request, reason: str | None = None, error: TandemError | None = None) -> None:
        request.finish(reason, error)
        tracing.end_request(request, reason, error)
        self._release(request)

    def _release(self, request: Request) -> None:
        with self._lock:
            if request in self.waiting:
                self.waiting.remove(request)
            if request in self.running:
                self.running.remove(request)
            if request.cache is not None:
                request.cache.free()
                request.cache = None
