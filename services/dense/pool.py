"""The process's tandem_native thread pools, one per (threads, spin): the dense linears and the
in-process experts share one, so their work takes turns on the cores instead of oversubscribing
them. Idle threads spin DECODE_SPIN_US before sleeping: a decode step issues its native calls (two
or three linears and one expert call per layer) a fraction of a millisecond apart, and a helper that
slept in between would cost a wake-up on every call (about 15% of a decode step on 2 cores). Where
an expert server on the same cores computes a layer call, park_pools ends the spins as the call is
awaited, so the server has the cores. While native calls run close together torch must not keep
worker threads of its own spinning on the same cores: see torch_threads."""

from __future__ import annotations

import contextlib

import torch

DECODE_SPIN_US = 1000
_POOLS: dict[tuple[int, int], object] = {}  # (threads, spin_us) -> tandem_native.ThreadPool


def shared_pool(threads: int, spin_us: int = DECODE_SPIN_US):
    """One pool per key however it is called: two pools would spin against each other."""
    key = (threads, spin_us)
    if key not in _POOLS:
        import tandem_native

        _POOLS[key] = tandem_native.ThreadPool(threads, spin_us)
    return _POOLS[key]


def all_pools() -> list:
    return list(_POOLS.values())


def park_pools() -> None:
    """Ends the idle spins of this process's pools at once: called where the cores go to another
    process (a co-located expert server's layer call) until the next native call here."""
    for pool in _POOLS.values():
        pool.park()


def unpark_pools() -> None:
    """Wakes this process's parked pools to spin for the next native call: called as the cores come
    back (a co-located server answered), so the helpers' wake-up overlaps the Python before that call."""
    for pool in _POOLS.values():
        pool.unpark()


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
