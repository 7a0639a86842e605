"""The engine: continuous batching over a paged KV cache with a fixed budget.

Each step takes every running sequence's next token plus prompt chunks (up to a token budget, so a
long prompt never stalls running decodes), runs them as one batch (one expert call per MoE layer),
samples per request, and streams outputs. New requests join between steps. A request reserves the
KV blocks for its prompt plus max_tokens when admitted, so a running request never runs out of
cache; requests that do not fit wait in a bounded queue, and past it are refused.
T tokens of a step, V vocabulary size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

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

    def __post_init__(self):
        for name in ("kv_blocks", "block_size", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise InvalidRequestError(f"max_queue: must be >= 0, got {self.max_queue}")


class Engine:
    def __init__(self, model: MoeDecoder, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.pool = BlockPool(model.cfg, cfg.kv_blocks, cfg.block_size, model.dtype, model.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0
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
        n, limit = len(request.prompt), self.model.cfg.max_position_embeddings
        if n == 0:
            raise InvalidRequestError("prompt: must hold at least one token")
        if n + request.params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) = {n + request.params.max_tokens} "
                f"exceeds the model's context length of {limit}"
            )
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise InvalidRequestError(f"prompt: token ids must be in [0, {vocab})")
        need = self.pool.blocks_for(n + request.params.max_tokens)
        if need > self.pool.num_blocks:
            raise ResourceExhaustedError(
                f"prompt + max_tokens = {n + request.params.max_tokens} tokens is more than the whole KV cache "
                f"({self.pool.num_blocks * self.pool.block_size} tokens)"
            )

    def abort(self, request: Request) -> None:
        """Marks a request cancelled; it leaves at the next step and its blocks are freed."""
        request.cancelled = True
        with self._lock:
            self._work.notify()

    @property
    def blocks_in_use(self) -> int:
        return self.pool.used_blocks

    def _fits_now(self, request: Request) -> bool:
        need = self.pool.blocks_for(len(request.prompt) + request.params.max_tokens)
        return self.reserved + need <= self.pool.num_blocks and len(self.running) < self.cfg.max_running

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
        while True:
            with self._lock:
                while not self._stopped and not self.waiting and not self.running:
                    self._work.wait()
                if self._stopped:
                    return
            self.step()

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
                request.reserved = self.pool.blocks_for(len(request.prompt) + request.params.max_tokens)
                request.cache = PagedSequence(self.pool)
                request.admitted_ns = time.time_ns()
                self.reserved += request.reserved
                self.running.append(request)

    def _plan(self) -> list[tuple[Request, Chunk, int | None]]:
        """(request, chunk, logit row or None) for this step: decodes first, then prompt chunks."""
        budget, rows, batch = self.cfg.max_batch_tokens, 0, []
        for request in sorted(self.running, key=lambda r: r.prefilling):
            if budget <= 0:
                break
            tokens = request.next_tokens(budget)
            done_prompt = not request.prefilling or request.prefilled + len(tokens) == len(request.prompt)
            rows += len(tokens)
            batch.append((request, Chunk(tokens, request.cache), rows - 1 if done_prompt else None))
            budget -= len(tokens)
        return batch

    def _emit(self, batch, logits: torch.Tensor) -> None:
        i = 0
        for request, chunk, row in batch:
            if request.prefilling:
                request.prefilled += len(chunk.tokens)
            if row is None:
                continue
            output = request.accept(logits[i])
            i += 1
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
                self.reserved -= request.reserved
            if request.cache is not None:
                request.cache.free()
                request.cache = None
