"""What a drain waits on: the calls under way on every stream and session, and when the last one ended.

On SIGTERM the server refuses new streams and sessions but keeps answering the ones it has until all
of them have been quiet for QUIET_S (or the drain time runs out); only then are they ended. A call a
client sent before the signal may still sit in the socket, or the handler that answered the previous
one may not yet have run on after its answer: the quiet period covers both.
"""

from __future__ import annotations

import contextlib
import threading
import time

QUIET_S = 0.5  # no call for this long after SIGTERM: no call is in flight


class CallActivity:
    def __init__(self):
        self._cond = threading.Condition()
        self._streams = self._under_way = 0
        self._last_end = time.monotonic()

    @contextlib.contextmanager
    def stream(self):
        """Held while a stream or session is open: with none open a drain has nothing to wait for."""
        with self._cond:
            self._streams += 1
        try:
            yield
        finally:
            with self._cond:
                self._streams -= 1
                self._cond.notify_all()

    def begin(self) -> None:
        with self._cond:
            self._under_way += 1

    def end(self) -> None:
        with self._cond:
            self._under_way -= 1
            self._mark()

    def mark(self) -> None:
        """A call that was begun and ended elsewhere (a session's, answered in C++). No lock and no
        notify on this path, which runs after every shared-memory call: a drain waiting for the quiet
        time wakes at its end anyway and then sees this call."""
        self._last_end = time.monotonic()

    def _mark(self) -> None:
        self._last_end = time.monotonic()
        self._cond.notify_all()

    def wait_quiet(self, since: float, deadline: float, quiet_s: float = QUIET_S) -> bool:
        """Waits until no call is under way and none ended within quiet_s (counting from since at
        the earliest); False if deadline (time.monotonic()) came first."""
        with self._cond:
            while True:
                now = time.monotonic()
                left = quiet_s - (now - max(self._last_end, since))
                if self._streams == 0 or (self._under_way == 0 and left <= 0):
                    return True
                if now >= deadline:
                    return False
                self._cond.wait(deadline - now if self._under_way else min(left, deadline - now))
