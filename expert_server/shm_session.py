"""The server side of a co-located session: a thread that answers doorbells in a mapped segment.

Each call is read, checked (errors name the descriptor's field), computed and answered inside
tandem_native.ShmServer, without the GIL; this thread only loops, marks the session's activity and
records a traced call's span after the answer has gone. The gRPC OpenSession stream supervises it:
when the stream ends (the client closed it, died, or the server drains), the thread finishes the
call in hand, stops, unmaps, and removes the segment's name if the client had not yet.
"""

from __future__ import annotations

import logging
import threading

from expert_server.drain import StreamActivity
from expert_server.executor import ExpertExecutor
from expert_server.tracing import CallTracer
from services.common import shm_layout as shm

log = logging.getLogger(__name__)
OK, INVALID_ARGUMENT = 0, 3
# A serve_next answers the calls that come within this long of its first without Python between them:
# after an answer this thread waits for the next call at once, not after a pass through the loop
# below, which ran while the caller computed its next layer and took a core from it. The activity
# marks (what a drain watches) stay this fresh.
HOLD_S = 0.05


class ShmSession:
    def __init__(self, segment: shm.Segment, executor: ExpertExecutor, max_tokens: int, spin_us: float,
                 activity: StreamActivity):
        import tandem_native

        self.segment, self.executor, self.activity = segment, executor, activity
        self._native = tandem_native.ShmServer(segment.mm, executor.native, max_tokens, spin_us)
        self._stop = threading.Event()
        self.calls = CallTracer(max(executor.layers))
        self._stopping = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"shm-{segment.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops after the call in hand (if any), then unmaps and unlinks; safe to call twice."""
        with self._stopping:  # the RPC's end callback and its handler may both get here
            if self.segment.mm.closed:
                return
            self._stop.set()
            self._native.wake()
            if self._thread.is_alive() and self._thread is not threading.current_thread():
                self._thread.join()
            self._native.release()
            self.segment.unlink()
            self.segment.close()

    def _serve(self) -> None:
        while True:
            answered = self._native.serve_next(0.5, HOLD_S)
            if answered is not None:
                status, layer, tokens, start_ns, end_ns, traceparent, each = answered
                self.activity.mark()
                if status == OK and traceparent:
                    self.calls.record(traceparent, each, layer, tokens, start_ns, end_ns)
                elif status not in (OK, INVALID_ARGUMENT):
                    log.error("layer %d call failed with status %d", layer, status)
            elif self._stop.is_set():  # a call published before the stop is still answered (drain)
                return
