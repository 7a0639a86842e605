"""The native call path (native/src/expert_session.cpp): the Executor's checks and results, and a
shared-memory round trip between ShmClient and ShmServer over a real segment, in one process.
T tokens, D hidden size, K experts per token, E experts."""

import resource
import threading
import time

import numpy as np
import pytest
import torch

from services.common import shm_layout as shm
from tests.child import run_python
from tests.reference.moe import random_layer
from tests.waiting import wait_for

tn = pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

E, D, I, K, CAP = 8, 64, 32, 2, 4
LAYER = 3


@pytest.fixture(scope="module")
def pool():
    return tn.ThreadPool(2)


@pytest.fixture(scope="module")
def layers(pool):
    return {LAYER: tn.MoeLayer(tn.pack_experts(*random_layer(np.random.default_rng(0), E, D, I), "int8", 32, pool))}


@pytest.fixture(scope="module")
def executor(layers, pool):
    return tn.Executor(layers, pool, D, E, CAP)


def call(t, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, D), dtype=np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int64)
    return x, ids, rng.random((t, K), dtype=np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_layout_numbers_agree_with_the_python_side():
    native = tn.shm_layout()
    assert native == {
        "HEADER_BYTES": shm.HEADER_BYTES, "REQUEST_SEQ": shm.REQUEST_SEQ, "REQUEST_AT": shm._REQUEST_AT,
        "RESPONSE_SEQ": shm.RESPONSE_SEQ, "RESPONSE_AT": shm._RESPONSE_AT, "MESSAGE_AT": shm._MESSAGE_AT,
        "MESSAGE_BYTES": shm.MESSAGE_BYTES, "TRACE_AT": shm._TRACE_AT, "LAYOUT_VERSION": shm.LAYOUT_VERSION,
        "TRACE_EACH": shm.TRACE_EACH, "X_DTYPE_CODES": shm.X_DTYPE_CODES,
        "REQUEST_SLEEPERS": shm.REQUEST_SLEEPERS, "RESPONSE_SLEEPERS": shm.RESPONSE_SLEEPERS, "PREWAKE": shm.PREWAKE,
    }
    assert shm._HEADER.size <= shm.PREWAKE < shm.REQUEST_SEQ  # after the header's fields, on their line
    assert shm._REQUEST_AT + shm._REQUEST.size <= shm.REQUEST_SLEEPERS < shm.RESPONSE_SEQ  # one line each
    assert shm._RESPONSE_AT + shm._RESPONSE.size <= shm.RESPONSE_SLEEPERS < shm._MESSAGE_AT


def test_executor_runs_the_kernels_in_float32_and_bfloat16(executor, layers, pool):
    x, ids, w = call(3)
    expected = np.empty_like(x)
    tn.moe_forward(layers[LAYER], x, ids, w, expected, pool)
    out = np.empty_like(x)
    executor.run(LAYER, x, ids, w, out)
    assert np.array_equal(out, expected)
    xb = bf16_bits(x)
    rounded = torch.from_numpy(xb.view(np.int16)).view(torch.bfloat16).float().numpy()
    tn.moe_forward(layers[LAYER], rounded, ids, w, expected, pool)
    outb = np.empty_like(xb)
    executor.run(LAYER, xb, ids, w, outb)
    assert np.array_equal(outb, bf16_bits(expected))


@pytest.mark.parametrize("args, field", [
    ((LAYER + 1, 1, D, K), "layer"),
    ((LAYER, 1, D + 1, K), "hidden"),
    ((LAYER, 0, D, K), "tokens"),
    ((LAYER, CAP + 1, D, K), "tokens"),
    ((LAYER, 1, D, E + 1), "top_k"),
])
def test_executor_check_names_the_field(executor, args, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        executor.check(*args)


def test_executor_refuses_bad_arrays_and_ids(executor):
    x, ids, w = call(2)
    out = np.empty_like(x)
    bad = ids.copy()
    bad[1, 0] = E
    for arrays, field in [((x.astype(np.float64), ids, w, out), "x"), ((x, bad, w, out), "ids"),
                          ((x, ids, w[:1], out), "weights"), ((x, ids, w, out[:1]), "out"),
                          ((x, ids, w, bf16_bits(x)), "out"), ((x, ids, w, x), "out")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            executor.run(LAYER, *arrays)


def test_echo_executor_returns_x(layers, pool):
    echo = tn.Executor(layers, pool, D, E, CAP, echo=True)
    x, ids, w = call(2)
    out = np.empty_like(x)
    echo.run(LAYER, x, ids, w, out)
    assert np.array_equal(out, x)


class Session:
    """Both ends of one segment in this process: the server end answers on a thread."""

    def __init__(self, executor, spin_us=50.0):
        self.slots = shm.Slots.plan(CAP, D, K)
        self.segment = shm.Segment.create(self.slots.end, CAP)
        s = self.slots
        self.client = tn.ShmClient(self.segment.mm, s.x, s.ids, s.weights, s.out, CAP, D, K)
        self.server = tn.ShmServer(self.segment.mm, executor, CAP, spin_us)
        self.answers, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            answered = self.server.serve_next(0.2)
            if answered is not None:
                self.answers.append(answered)

    def close(self):
        self.stop.set()
        self.server.wake()
        self.thread.join()
        self.server.release()
        self.client.release()
        self.segment.close()


@pytest.fixture
def session(executor):
    s = Session(executor)
    yield s
    s.close()


def test_a_call_through_the_segment_equals_the_executor(session, executor):
    x, ids, w = call(3, seed=1)
    expected = np.empty_like(x)
    executor.run(LAYER, x, ids, w, expected)
    seq = session.client.submit(LAYER, x, ids, w, "00-" + "1" * 32 + "-" + "2" * 16 + "-01", True)
    assert session.client.wait(seq, 50.0, 10.0)
    out = np.empty_like(x)
    status, message, compute_s = session.client.result(out)
    assert (status, message) == (0, "") and compute_s > 0
    assert np.array_equal(out, expected)
    # the server thread records its answer after ringing the client, so the client may see it first
    assert wait_for(lambda: len(session.answers) == 1, timeout=5.0)
    assert session.answers[-1][:3] == (0, LAYER, 3) and session.answers[-1][5:] == ("00-" + "1" * 32 + "-" + "2" * 16
                                                                                    + "-01", True)
    xb = bf16_bits(x)
    seq = session.client.submit(LAYER, xb, ids, w)
    assert session.client.wait(seq, 50.0, 10.0)
    outb = np.empty_like(xb)
    assert session.client.result(outb)[0] == 0
    expected_b = np.empty_like(xb)
    executor.run(LAYER, xb, ids, w, expected_b)
    assert np.array_equal(outb, expected_b)


def test_serve_next_answers_the_calls_within_its_hold_and_returns_a_traced_one_at_once(executor):
    """With hold_s, one serve_next answers the calls that follow its first within that time without
    returning (the last one's details come back); a traced call comes back at once, for its span."""
    s = served_by_the_test(executor)
    x, ids, w = call(2, seed=6)
    trace = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
    answered = []
    try:
        server = threading.Thread(target=lambda: answered.append(s.server.serve_next(5.0, 5.0)))
        server.start()
        for layer, status in ((LAYER, 0), (LAYER + 1, 3), (LAYER, 0)):  # a client's mistake is answered in the hold
            seq = s.client.submit(layer, x, ids, w)
            assert s.client.wait(seq, 0.0, 5.0) and s.client.result()[0] == status
        assert server.is_alive()  # still holding for more calls
        seq = s.client.submit(LAYER, x, ids, w, trace, False)
        assert s.client.wait(seq, 0.0, 5.0) and s.client.result()[0] == 0
        server.join(5.0)
        assert not server.is_alive() and answered[0][:3] == (0, LAYER, 2) and answered[0][5] == trace
        started = time.perf_counter()
        assert s.server.serve_next(0.05, 5.0) is None  # no call: the timeout, not the hold, ends it
        assert time.perf_counter() - started < 1.0
        with pytest.raises(ValueError, match="hold_s"):
            s.server.serve_next(0.05, -1.0)
    finally:
        s.server.release()
        s.client.release()
        s.segment.close()


def test_expert_ids_are_checked_on_the_servers_copy(session):
    x, ids, w = call(2)
    ids[0, 1] = -1
    seq = session.client.submit(LAYER, x, ids, w)
    assert session.client.wait(seq, 50.0, 10.0)
    status, message, _ = session.client.result()
    assert status == 3 and message.startswith("ids: expert id -1")


@pytest.mark.parametrize("change, field", [
    (lambda a: (a[0].astype(np.float64),) + a[1:], "x"),
    (lambda a: (np.zeros((1, D + 1), np.float32),) + a[1:], "x"),
    (lambda a: (np.zeros((CAP + 1, D), np.float32),) + a[1:], "x"),
    (lambda a: (a[0], a[1].astype(np.int32), a[2]), "ids"),
    (lambda a: (a[0], np.zeros((2, K + 1), np.int64), a[2]), "ids"),
    (lambda a: (a[0], a[1], a[2][:, :1]), "weights"),
])
def test_client_submit_checks_its_arguments(session, change, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        session.client.submit(LAYER, *change(call(2)))


def test_a_wake_ends_a_wait_and_release_makes_calls_fail_cleanly(executor):
    s = Session(executor)
    x, ids, w = call(1)
    s.stop.set()
    s.server.wake()
    s.thread.join()
    seq = s.client.submit(LAYER, x, ids, w)  # nobody answers now
    threading.Timer(0.1, s.client.wake).start()
    assert not s.client.wait(seq, 0.0, 10.0)
    s.server.release()
    s.client.release()
    with pytest.raises(RuntimeError, match="released"):
        s.client.submit(LAYER, x, ids, w)
    s.segment.close()
    assert s.segment.mm.closed


def cpu_seconds_over(seconds: float) -> float:
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def polling_pool_and_call(executor, seed):
    """A session the test serves, a pool whose helpers poll 100 ms after a call (so that their spin
    shows in the CPU time), a call's arrays and the executor's answer to it."""
    s = served_by_the_test(executor)
    x, ids, w = call(2, seed=seed)
    expected = np.empty_like(x)
    executor.run(LAYER, x, ids, w, expected)
    return s, tn.ThreadPool(2, 100000), (x, ids, w), expected


def test_the_answer_wakes_the_waiting_sides_pools(executor, layers):
    """A wait given pools parks their helpers on the answer's doorbell: they sleep while the server
    computes and are woken by its ring, spinning for the caller's next call (a pool that polls
    100 ms after a call, so its spin shows in the CPU time); a wait that times out leaves the pool
    working as before."""
    s, mine, (x, ids, w), expected = polling_pool_and_call(executor, seed=3)
    try:
        for _ in range(2):
            tn.moe_forward(layers[LAYER], x, ids, w, np.empty_like(x), mine)  # its helper polls now
            seq = s.client.submit(LAYER, x, ids, w)
            answered = []
            waiter = threading.Thread(target=lambda: answered.append(s.client.wait(seq, 0.0, 10.0, [mine])))
            waiter.start()
            time.sleep(0.02)
            assert cpu_seconds_over(0.05) < 0.01  # parked on the bell, not polling
            assert s.server.serve_next(5.0)[0] == 0
            waiter.join()
            assert answered == [True] and cpu_seconds_over(0.05) > 0.03  # the ring woke the helper
            out = np.empty_like(x)
            assert s.client.result(out)[0] == 0 and np.array_equal(out, expected)
            time.sleep(0.1)
        seq = s.client.submit(LAYER, x, ids, w)
        assert not s.client.wait(seq, 0.0, 0.05, [mine])  # nobody answers: the helper is left on the bell
        out = np.empty_like(x)
        started = time.perf_counter()
        tn.moe_forward(layers[LAYER], x, ids, w, out, mine)  # the call takes it off the bell
        assert time.perf_counter() - started < 5.0
        assert s.server.serve_next(5.0)[0] == 0 and s.client.wait(seq, 0.0, 5.0)
    finally:
        s.server.release()
        s.client.release()
        s.segment.close()


_SHARE_OF_A_SHARED_CORE = """
import threading, time, numpy as np, tandem_native as tn
from services.common import shm_layout as shm
from tests.child import busy_share, pin_to_one_cpu
from tests.reference.moe import random_layer
pin_to_one_cpu()
E, D, I, K, CAP = 8, 64, 32, 2, 4
pool = tn.ThreadPool(1)
executor = tn.Executor({3: tn.MoeLayer(tn.pack_experts(*random_layer(np.random.default_rng(0), E, D, I), "int8", 32, pool))},
                       pool, D, E, CAP)
slots = shm.Slots.plan(CAP, D, K)
segment = shm.Segment.create(slots.end, CAP)
server = tn.ShmServer(segment.mm, executor, CAP, 100000.0)  # polls 100 ms for a call
shares = []
for _ in range(3):
    waiting = threading.Thread(target=server.serve_next, args=(0.2, 0.0))
    waiting.start()
    time.sleep(0.001)
    shares.append(busy_share())
    waiting.join()
server.release()
segment.close()
print(min(shares))
"""


def test_a_thread_polling_a_doorbell_gives_its_core_to_a_thread_that_needs_it():
    """A server polling the request word on the one core it shares with a busy thread yields it, as
    the pool's pollers do: the busy thread gets nearly all of the core, not the half that the
    scheduler would give it against a thread that kept polling."""
    proc = run_python(_SHARE_OF_A_SHARED_CORE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout) > 0.75


def served_by_the_test(executor):
    """A Session whose calls the test answers with serve_next itself."""
    s = Session(executor)
    s.stop.set()
    s.server.wake()
    s.thread.join()
    return s


def test_expect_wakes_the_servers_helpers_parked_between_calls(layers):
    """After answering, the server's helpers wait on the segment's prewake word (a pool that polls
    100 ms for work, so its spin shows in the CPU time): asleep until the client's expect(), then
    spinning for the call it announces, which is answered as any."""
    polling = tn.Executor(layers, tn.ThreadPool(2, 100000), D, E, CAP)
    s = served_by_the_test(polling)
    x, ids, w = call(2, seed=4)
    expected = np.empty_like(x)
    polling.run(LAYER, x, ids, w, expected)
    try:
        for _ in range(2):
            time.sleep(0.15)  # the run's own spin is over
            seq = s.client.submit(LAYER, x, ids, w)
            assert s.server.serve_next(5.0)[0] == 0 and s.client.wait(seq, 0.0, 5.0)
            assert cpu_seconds_over(0.05) < 0.01  # parked on the prewake word, not polling
            s.client.expect()
            assert cpu_seconds_over(0.05) > 0.03  # woken: polling for the call
        seq = s.client.submit(LAYER, x, ids, w)
        out = np.empty_like(x)
        assert s.server.serve_next(5.0)[0] == 0 and s.client.finish(seq, 0.0, 5.0, out)[0] == 0
        assert np.array_equal(out, expected)
    finally:
        s.server.release()
        s.client.release()
        s.segment.close()


def test_expect_parks_the_callers_pools_until_the_answer(executor, layers):
    """expect(pools) puts their polling helpers on the answer's doorbell before the call is even
    submitted (routing runs on one thread, their cores are the server's meanwhile); the answer's ring
    wakes them, and the wait that follows finds the answer."""
    s = served_by_the_test(executor)
    mine = tn.ThreadPool(2, 100000)
    x, ids, w = call(2, seed=5)
    try:
        tn.moe_forward(layers[LAYER], x, ids, w, np.empty_like(x), mine)  # its helper polls now
        s.client.expect([mine])
        time.sleep(0.01)
        assert cpu_seconds_over(0.05) < 0.01  # parked on the bell, not polling
        seq = s.client.submit(LAYER, x, ids, w)
        assert s.server.serve_next(5.0)[0] == 0
        assert cpu_seconds_over(0.05) > 0.03  # the ring woke the helper
        assert s.client.wait(seq, 0.0, 5.0, [mine])
    finally:
        s.server.release()
        s.client.release()
        s.segment.close()


def test_call_submits_and_waits_in_one_with_the_callers_pools_parked(executor, layers):
    """call() is submit() then finish(): the answer in out, the pools' helpers asleep on the answer's
    doorbell while the server computes and woken by its ring; a mistake raises before anything is
    published; past timeout_s it returns (seq, None) and the call is still the one finish() waits for."""
    s, mine, (x, ids, w), expected = polling_pool_and_call(executor, seed=10)
    try:
        tn.moe_forward(layers[LAYER], x, ids, w, np.empty_like(x), mine)  # its helper polls now
        out, answered = np.empty_like(x), []
        caller = threading.Thread(target=lambda: answered.append(s.client.call(LAYER, x, ids, w, out, 0.0, 10.0, [mine])))
        caller.start()
        time.sleep(0.02)
        assert cpu_seconds_over(0.05) < 0.01  # the caller and the helper asleep, not polling
        assert s.server.serve_next(5.0)[:3] == (0, LAYER, 2)
        caller.join()
        (seq, (status, message, compute_s)), = answered
        assert (status, message) == (0, "") and compute_s > 0 and np.array_equal(out, expected)
        assert cpu_seconds_over(0.05) > 0.03  # the ring woke the helper
        with pytest.raises(ValueError, match="^ids: "):
            s.client.call(LAYER, x, ids.astype(np.int32), w, out, 0.0, 0.05)
        with pytest.raises(ValueError, match="spin_us"):
            s.client.call(LAYER, x, ids, w, out, -1.0, 0.05)
        late, answer = s.client.call(LAYER, x, ids, w, out, 0.0, 0.05)  # nobody serves yet
        assert (late, answer) == (seq + 1, None)  # the refused calls published nothing
        assert s.server.serve_next(5.0)[0] == 0
        out[:] = 0
        assert s.client.finish(late, 0.0, 5.0, out)[0] == 0 and np.array_equal(out, expected)
        bits = bf16_bits(x)
        server = threading.Thread(target=s.server.serve_next, args=(5.0,))
        server.start()
        outb = np.empty_like(bits)
        _, answer = s.client.call(LAYER, torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
                                  torch.from_numpy(ids), torch.from_numpy(w), outb, 0.0, 5.0)
        server.join()
        expected_b = np.empty_like(bits)
        executor.run(LAYER, bits, ids, w, expected_b)
        assert answer[0] == 0 and np.array_equal(outb, expected_b)
    finally:
        s.server.release()
        s.client.release()
        s.segment.close()


def test_client_takes_cpu_tensors_as_they_are_and_refuses_others(session, executor):
    x, ids, w = call(2, seed=3)
    expected = np.empty_like(x)
    executor.run(LAYER, x, ids, w, expected)
    seq = session.client.submit(LAYER, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w))
    out = np.empty_like(x)
    assert session.client.finish(seq, 50.0, 10.0, out)[0] == 0
    assert np.array_equal(out, expected)
    subclass = torch.nn.Parameter(torch.from_numpy(x), requires_grad=False)  # a Tensor subclass
    seq = session.client.submit(LAYER, subclass, torch.from_numpy(ids), torch.from_numpy(w))
    assert session.client.finish(seq, 50.0, 10.0, out)[0] == 0 and np.array_equal(out, expected)
    strided = torch.from_numpy(np.ascontiguousarray(x.T)).T
    for args, field in [((strided, torch.from_numpy(ids), torch.from_numpy(w)), "x"),
                        ((torch.from_numpy(x).double(), torch.from_numpy(ids), torch.from_numpy(w)), "x"),
                        ((torch.from_numpy(x), torch.from_numpy(ids).int(), torch.from_numpy(w)), "ids"),
                        ((torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w).half()), "weights"),
                        ((torch.from_numpy(x)[0], torch.from_numpy(ids), torch.from_numpy(w)), "x"),
                        (([[0.0] * D], torch.from_numpy(ids), torch.from_numpy(w)), "x")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            session.client.submit(LAYER, *args)


def test_random_descriptors_get_an_answer_and_never_crash_the_server(session, executor):
    """Descriptors with fields drawn around and across every boundary (in bounds, past the end,
    inside the header, misaligned, huge): each is answered OK or INVALID_ARGUMENT naming a field,
    and a valid call still gets the right result afterwards."""
    import random

    rng = random.Random(7)  # Python ints: offsets up to 2**64 - 8 stay exact
    s, size = session.slots, session.segment.size
    edges = [0, 8, shm.HEADER_BYTES - 4, shm.HEADER_BYTES + 2, s.x, s.ids, s.weights, s.out, size - 4, size, size + 64,
             2**32, 2**63, 2**64 - 8]
    fields = ("layer", "tokens", "hidden", "top_k", "x_dtype", "x_offset", "ids_offset", "weights_offset",
              "out_offset")
    bad = dict(layer=[LAYER + 1, 2**32 - 1], tokens=[0, 1, CAP, CAP + 1], hidden=[D - 1, 0], top_k=[0, 1, E, E + 1],
               x_dtype=[2, 0, 9])
    x, ids, w = call(2, seed=9)
    assert session.client.finish(session.client.submit(LAYER, x, ids, w), 50.0, 10.0)[0] == 0  # valid data in the slots
    for _ in range(400):
        d = dict(layer=LAYER, tokens=2, hidden=D, top_k=K, x_dtype=1, x_offset=s.x, ids_offset=s.ids,
                 weights_offset=s.weights, out_offset=s.out)
        for f in rng.sample(fields, rng.choice([0, 1, 1, 2, 3])):  # a few fields off their valid values
            d[f] = rng.choice(edges if f.endswith("offset") else bad[f])
        seq = session.client.publish(tn.ShmDescriptor(**d))
        assert session.client.wait(seq, 50.0, 10.0)
        status, message, _ = session.client.result()
        assert status == 0 or (status == 3 and message.split(":")[0] in fields + ("ids",)), (d, status, message)
    expected = np.empty_like(x)
    executor.run(LAYER, x, ids, w, expected)
    seq = session.client.submit(LAYER, x, ids, w)
    out = np.empty_like(x)
    assert session.client.finish(seq, 50.0, 10.0, out)[0] == 0 and np.array_equal(out, expected)
