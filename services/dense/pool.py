"""The process's tandem_native thread pools, one per (threads, spin): the dense linears and the
in-process experts share one, so their work takes turns on the cores instead of oversubscribing
them. Idle threads spin DECODE_SPIN_US before sleeping: a decode step issues its native calls (two
or three linears and one expert call per layer) a fraction of a millisecond apart, and a helper that
slept in between would cost a wake-up on every call (about 15% of a decode step on 2 cores). Where
an expert server on the same cores computes between our calls, a short spin (SHARED_SPIN_US) leaves
it the cores. While native calls run close together torch must not keep worker threads of its own
spinning on the same cores: see torch_threads."""

from __future__ import annotations

import contextlib
import functools

import torch

DECODE_SPIN_US = 1000
SHARED_SPIN_US = 50


def shared_pool(threads: int, spin_us: int = DECODE_SPIN_US):
    return _pool(threads, spin_us)  # one key however it is called: two pools would spin against each other


@functools.cache
def _pool(threads: int, spin_us: int):
    import tandem_native

    return tandem_native.ThreadPool(threads, spin_us)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n for the block, then restored (a few microseconds each way)."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)
