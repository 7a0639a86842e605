"""Polling for a condition that another thread or process brings about."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 10.0, period: float = 0.02) -> bool:
    """True as soon as predicate() is; False if it is still false after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(period)
    return False
