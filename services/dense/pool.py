"""The process's tandem_native thread pools, one per thread count: the dense linears and the
in-process experts share one, so their work takes turns on the cores instead of oversubscribing them
(a dense linear issued while an expert job runs waits for it)."""

from __future__ import annotations

import functools


@functools.cache
def shared_pool(threads: int):
    import tandem_native

    return tandem_native.ThreadPool(threads)
