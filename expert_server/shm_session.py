"""The server side of a co-located session: a thread that answers doorbells in a mapped segment.

The gRPC OpenSession stream supervises it: when the stream ends (the client closed it, died, or
the server drains), the thread finishes the call in hand, stops, unmaps, and removes the segment's
name if the client had not yet. T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from expert_server.executor import ExpertExecutor
from expert_server.tracing import CallTracer
from services.common import shm_layout as shm
from services.common.errors import InvalidRequestError

log = logging.getLogger(__name__)

OK, INVALID_ARGUMENT, INTERNAL = 0, 3, 13
_I64, _F32 = np.dtype(np.int64), np.dtype(np.float32)


class ShmSession:
    def __init__(self, segment: shm.Segment, executor: ExpertExecutor, max_tokens: int, spin_us: float):
        import tandem_native

        self._tn = tandem_native
        self.segment, self.executor = segment, executor
        self.max_tokens, self.spin_us = max_tokens, spin_us
        self._stop = threading.Event()
        self._flat: dict = {}  # (offset, dtype) -> flat view; the client's slots never move
        self.calls = CallTracer(max(executor.layers))
        self._stopping = threading.Lock()
        self._seen = tandem_native.doorbell_load(segment.mm, shm.REQUEST_SEQ)
        self._thread = threading.Thread(target=self._serve, name=f"shm-{segment.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops after the call in hand (if any), then unmaps and unlinks; safe to call twice."""
        with self._stopping:  # the RPC's end callback and its handler may both get here
            if self.segment.mm.closed:
                return
            self._stop.set()
            self._tn.doorbell_wake(self.segment.mm, shm.REQUEST_SEQ)
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join()
            self.segment.unlink()
            self._flat = {}
            self.segment.close()

    def _serve(self) -> None:
        mm = self.segment.mm
        while True:
            seq = self._tn.doorbell_wait(mm, shm.REQUEST_SEQ, self._seen, self.spin_us, 0.5)
            if seq != self._seen:  # a call published before a stop is still answered (drain)
                self._seen = seq
                self._answer()
                self._tn.doorbell_ring(mm, shm.RESPONSE_SEQ, seq)
            elif self._stop.is_set():
                return

    def _answer(self) -> None:
        try:
            req = self.segment.read_request()
            start = time.time_ns()
            self._compute(req)
            end = time.time_ns()
            self.segment.write_response(OK, compute_s=(end - start) / 1e9)
            self.calls.record(*self.segment.read_trace(), req.layer, req.tokens, start, end)
        except InvalidRequestError as exc:
            self.segment.write_response(INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            log.exception("layer call failed")
            self.segment.write_response(INTERNAL, str(exc))

    def _view(self, field: str, offset: int, dtype: np.dtype, rows: int, cols: int) -> np.ndarray:
        """[rows, cols] at offset: a slice of a flat view to the segment's end, made once per
        (offset, dtype) after Segment.array's checks; the length is checked on every call."""
        flat = self._flat.get((offset, dtype))
        if flat is None:
            self.segment.array(field, offset, dtype, (rows, cols))  # this call's own checks and error
            n = (self.segment.size - offset) // dtype.itemsize
            flat = self._flat[(offset, dtype)] = self.segment.array(field, offset, dtype, (n,))
        n = rows * cols
        if n > flat.shape[0]:
            raise InvalidRequestError(f"{field}: {n * dtype.itemsize} bytes at offset {offset} run past the segment")
        return flat[:n].reshape(rows, cols)

    def _compute(self, req: shm.Request) -> None:
        if req.tokens > self.max_tokens:
            raise InvalidRequestError(f"tokens: {req.tokens} is over the session's capacity of {self.max_tokens}")
        self.executor.check(req.layer, req.tokens, req.hidden, req.top_k)
        if req.x_dtype not in shm.X_DTYPES:
            raise InvalidRequestError(f"x_dtype: unknown code {req.x_dtype}")
        t, d, k, xdt = req.tokens, req.hidden, req.top_k, shm.X_DTYPES[req.x_dtype]
        x = self._view("x_offset", req.x_offset, xdt, t, d)
        ids = self._view("ids_offset", req.ids_offset, _I64, t, k)
        weights = self._view("weights_offset", req.weights_offset, _F32, t, k)
        out = self._view("out_offset", req.out_offset, xdt, t, d)
        if xdt == np.float32:
            self.executor.run(req.layer, x, ids, weights, out)
        else:
            out[...] = self.executor.compute(req.layer, x, ids, weights, bf16=True)
