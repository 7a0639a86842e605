"""What a drain waits on: the calls under way on every stream and session, and when each stream's last
call ended.

On SIGTERM the server refuses new streams and sessions but keeps answering the ones it has until all
of them have been quiet for QUIET_S (or the drain time runs out); only then are they ended. A call a
client sent before the signal may still sit in the socket, or the handler that answered the previous
one may not yet have run on after its answer: the quiet period covers both. Each stream's marks are
plain attribute stores by its own thread (no lock on the per-call path); the drain polls them.
"""

from __future__ import annotations

import contextlib
import threading
import time

QUIET_S = 0.5  # no call for this long after SIGTERM: no call is in flight
POLL_S = 0.02  # how often a drain looks at the streams


def quiet(busy: bool, last_end: float, now: float, since: float, quiet_s: float) -> bool:
    """No call under way and none ended within quiet_s of now (counting from since at the earliest)."""
    return not busy and now - max(last_end, since) >= quiet_s


class StreamActivity:
    """One stream's or session's calls, marked by the thread that answers them."""

    __slots__ = ("busy", "last_end")

    def __init__(self):
        self.busy, self.last_end = False, time.monotonic()

    def begin(self) -> None:
        self.busy = True

    def end(self) -> None:
        self.last_end = time.monotonic()
        self.busy = False

    mark = end  # a call begun and ended elsewhere (a session's, answered in C++)

    def quiet(self, now: float, since: float, quiet_s: float) -> bool:
        return quiet(self.busy, self.last_end, now, since, quiet_s)


class CallActivity:
    """The open streams and sessions of a server."""

    def __init__(self):
        self._lock = threading.Lock()
        self._streams: set[StreamActivity] = set()

    @contextlib.contextmanager
    def watch(self, stream: StreamActivity):
        """Counts stream in while it is open: with none open a drain has nothing to wait for."""
        with self._lock:
            self._streams.add(stream)
        try:
            yield stream
        finally:
            with self._lock:
                self._streams.discard(stream)

    def wait_quiet(self, since: float, deadline: float, quiet_s: float = QUIET_S) -> bool:
        """Waits until every open stream has no call under way and none ended within quiet_s (counting
        from since at the earliest); False if deadline (time.monotonic()) came first."""
        while True:
            now = time.monotonic()
            with self._lock:
                streams = list(self._streams)
            if all(s.quiet(now, since, quiet_s) for s in streams):
                return True
            if now >= deadline:
                return False
            time.sleep(min(POLL_S, deadline - now))
