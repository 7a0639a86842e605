"""The worker pool: asynchronous submit/wait, the GIL released, no core spinning when idle."""

import resource
import threading
import time

import numpy as np
import pytest

from tests.child import run_python
from tests.reference.moe import random_layer, random_routing

tn = pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

E, D, I, K = 32, 512, 256, 8


@pytest.fixture(scope="module")
def setup():
    pool = tn.ThreadPool(2)
    layer = tn.MoeLayer(tn.pack_experts(*random_layer(np.random.default_rng(1), E, D, I), "bf16", 32, pool))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, D), dtype=np.float32)
    return pool, layer, x, *random_routing(rng, 256, E, K)


def test_submit_returns_before_the_work_is_done_and_wait_gives_the_same_result(setup):
    pool, layer, x, ids, w = setup
    expected = np.zeros_like(x)
    tn.moe_forward(layer, x, ids, w, expected, pool)
    out = np.full_like(x, np.nan)
    job = tn.moe_submit(layer, x, ids, w, out, pool)
    assert not job.done()  # the caller is free to overlap other work here
    job.wait()
    assert job.done() and np.array_equal(out, expected)


def test_the_gil_is_released_while_computing(setup):
    pool, layer, x, ids, w = setup
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    counter = threading.Thread(target=count)
    counter.start()
    out = np.zeros_like(x)
    start = time.perf_counter()
    for _ in range(5):
        tn.moe_forward(layer, x, ids, w, out, pool)
    elapsed = time.perf_counter() - start
    stop.set()
    counter.join()
    assert elapsed > 0.01 and ticks > 1000  # Python kept running while the kernels did


def test_idle_workers_sleep(setup):
    pool, layer, x, ids, w = setup
    tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.05  # seconds of CPU over half a second idle, all threads together


def test_a_pool_can_be_dropped_and_recreated_many_times(setup):
    _, layer, x, ids, w = setup
    for threads in (1, 2, 3) * 5:
        out = np.zeros((4, D), np.float32)
        tn.moe_forward(layer, x[:4], ids[:4], w[:4], out, tn.ThreadPool(threads))
        assert np.isfinite(out).all()


_BACK_TO_BACK = """
import numpy as np, sys, tandem_native as tn
from tests.reference.moe import random_layer, random_routing
threads, calls = int(sys.argv[1]), int(sys.argv[2])
pool = tn.ThreadPool(threads)
layer = tn.MoeLayer(tn.pack_experts(*random_layer(np.random.default_rng(3), 8, 64, 64), "int8", 32, pool))
rng = np.random.default_rng(4)
x = rng.standard_normal((3, 64), dtype=np.float32)
ids, w = random_routing(rng, 3, 8, 2)
first = np.zeros_like(x)
tn.moe_forward(layer, x, ids, w, first, pool)
out = np.zeros_like(x)
for _ in range(calls):
    tn.moe_forward(layer, x, ids, w, out, pool)
    assert np.array_equal(out, first)
print("ok")
"""


@pytest.mark.parametrize("threads", [2, 4])
def test_back_to_back_tiny_calls_neither_hang_nor_run_a_task_twice(threads):
    """Thousands of parallel_for rounds of a few microseconds each, more threads than cores: a helper
    waking late must not join a round that is over (it once took a task index from the finished
    round's counter and ran it in the next round, leaving the coordinator waiting forever)."""
    proc = run_python(_BACK_TO_BACK, str(threads), "20000")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_a_pool_with_a_longer_spin_still_sleeps_once_it_is_over(setup):
    """A decode pool's helpers poll 1 ms for the next call, then sleep like any other's."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 1000)
    tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    time.sleep(0.05)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 0.05


def cpu_seconds_over(seconds: float) -> float:
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def test_a_parked_pool_stops_spinning_at_once(setup):
    """park() (a layer call handed to a co-located expert server) ends a long spin there and then;
    the next call runs as before. Unparked, the same pool spins through the whole wait."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 100000)  # 100 ms of polling after each call
    expected = np.zeros_like(x)
    tn.moe_forward(layer, x, ids, w, expected, pool)
    assert cpu_seconds_over(0.05) > 0.03  # the helper polls
    time.sleep(0.1)
    for _ in range(2):
        out = np.zeros_like(x)
        tn.moe_forward(layer, x, ids, w, out, pool)
        pool.park()
        assert cpu_seconds_over(0.05) < 0.01 and np.array_equal(out, expected)
    pool.park()  # parking an idle pool again, or before any call, is harmless
    tn.ThreadPool(2, 100000).park()


def test_unpark_wakes_a_parked_pool_to_spin_for_the_next_call(setup):
    """unpark() (a co-located server's answer came) wakes parked helpers, which poll for the next
    call as after one of their own, then sleep; the next call's result is the same."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 100000)
    expected = np.zeros_like(x)
    tn.moe_forward(layer, x, ids, w, expected, pool)
    pool.park()
    time.sleep(0.01)
    assert cpu_seconds_over(0.05) < 0.01
    pool.unpark()
    assert cpu_seconds_over(0.05) > 0.03  # the helper polls again
    time.sleep(0.1)
    assert cpu_seconds_over(0.05) < 0.01  # and sleeps once its spin is over
    out = np.zeros_like(x)
    tn.moe_forward(layer, x, ids, w, out, pool)
    assert np.array_equal(out, expected)
    tn.ThreadPool(1).unpark()  # no helpers: nothing to wake


def test_a_spin_out_of_range_is_refused():
    for spin in (-1, 100001):
        with pytest.raises(ValueError, match="spin_us"):
            tn.ThreadPool(2, spin)


def test_warming_reads_ahead_without_changing_a_result(setup):
    """ThreadPool.warm (the dense path reading the next linear's weights ahead): the next call's
    result is the same bits, whether the read-ahead finished or the call cut it short."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 1000)
    lin = tn.Linear("int4", 512, 1024, 32)
    lin.pack(np.random.default_rng(3).standard_normal((512, 1024), dtype=np.float32), pool)
    xs = np.random.default_rng(4).standard_normal((1, 1024), dtype=np.float32)
    expected = np.empty((1, 512), np.float32)
    lin.forward(xs, expected, pool)
    for pause in (0.0, 0.002):
        pool.warm(lin.address, lin.nbytes)
        time.sleep(pause)
        out = np.empty_like(expected)
        lin.forward(xs, out, pool)
        assert np.array_equal(out, expected)
    pool.warm(lin.address, 0)  # nothing to read


def test_a_warm_request_never_keeps_a_pool_busy(setup):
    """A request to a sleeping pool is dropped; one to a polling pool ends at the next call (the rest
    is that call's to read) and the pool sleeps after its spin as before."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 1000)
    big = np.ones(64 << 20, np.uint8)  # touched: every page mapped
    tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    time.sleep(0.05)
    pool.warm(big.ctypes.data, big.nbytes)
    assert cpu_seconds_over(0.2) < 0.02
    for _ in range(3):
        tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
        pool.warm(big.ctypes.data, big.nbytes)
        tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    time.sleep(0.05)
    assert cpu_seconds_over(0.3) < 0.03


def test_a_parked_pool_stops_warming_at_once(setup):
    """park() (the cores handed to a co-located expert server) also ends a read-ahead in progress:
    half a gigabyte left to read would otherwise keep a helper busy for tens of milliseconds."""
    _, layer, x, ids, w = setup
    pool = tn.ThreadPool(2, 100000)
    big = np.ones(512 << 20, np.uint8)
    tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    pool.warm(big.ctypes.data, big.nbytes)
    pool.park()
    assert cpu_seconds_over(0.1) < 0.005


_SHARE_OF_A_SHARED_CORE = """
import time, numpy as np, tandem_native as tn
from tests.child import busy_share, pin_to_one_cpu
from tests.reference.moe import random_layer, random_routing
pin_to_one_cpu()
pool = tn.ThreadPool(2, 100000)  # its threads poll 100 ms for the next call
layer = tn.MoeLayer(tn.pack_experts(*random_layer(np.random.default_rng(3), 8, 64, 64), "int8", 32, pool))
rng = np.random.default_rng(4)
x = rng.standard_normal((3, 64), dtype=np.float32)
ids, w = random_routing(rng, 3, 8, 2)
shares = []
for _ in range(3):
    tn.moe_forward(layer, x, ids, w, np.zeros_like(x), pool)
    shares.append(busy_share())
    time.sleep(0.15)
print(min(shares))
"""


def test_polling_threads_give_their_core_to_a_thread_that_needs_it():
    """A pool polling for its next call on the one core it shares with a busy thread (a co-located
    stack's other process or serving threads) yields it: the busy thread gets nearly all of the core,
    not the half or third that the scheduler would give it against threads that kept polling."""
    proc = run_python(_SHARE_OF_A_SHARED_CORE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout) > 0.75
