"""CallActivity: what SIGTERM's drain waits for before it ends the open streams."""

import threading
import time

from expert_server.drain import CallActivity, StreamActivity


def test_with_no_stream_open_there_is_nothing_to_wait_for():
    start = time.monotonic()
    assert CallActivity().wait_quiet(start, start + 5, quiet_s=2)
    assert time.monotonic() - start < 1


def test_an_open_stream_is_waited_on_until_it_has_been_quiet_for_the_quiet_time():
    activity = CallActivity()
    with activity.watch(StreamActivity()):
        start = time.monotonic()
        assert activity.wait_quiet(start, start + 10, quiet_s=0.3)
        assert 0.3 <= time.monotonic() - start < 3


def test_a_call_under_way_holds_the_drain_until_it_ends_and_the_quiet_time_after_it_passes():
    activity = CallActivity()
    with activity.watch(StreamActivity()) as stream, activity.watch(StreamActivity()):
        stream.begin()
        ended = []

        def finish():
            time.sleep(0.5)
            ended.append(time.monotonic())
            stream.end()

        threading.Thread(target=finish).start()
        start = time.monotonic()
        assert activity.wait_quiet(start, start + 10, quiet_s=0.3)
        assert ended and time.monotonic() - ended[0] >= 0.3


def test_calls_that_keep_coming_run_the_drain_to_its_deadline():
    activity = CallActivity()
    stop = threading.Event()

    with activity.watch(StreamActivity()) as stream:
        def calls():
            while not stop.wait(0.05):
                stream.mark()

        threading.Thread(target=calls).start()
        start = time.monotonic()
        try:
            assert not activity.wait_quiet(start, start + 1.0, quiet_s=0.5)
        finally:
            stop.set()
        assert 1.0 <= time.monotonic() - start < 4


def test_a_stream_that_closes_ends_the_wait():
    activity = CallActivity()
    opened = threading.Event()

    def client():
        with activity.watch(StreamActivity()) as stream:
            stream.begin()
            opened.set()
            time.sleep(0.3)

    threading.Thread(target=client).start()
    opened.wait()
    start = time.monotonic()
    assert activity.wait_quiet(start, start + 10, quiet_s=5)
    assert time.monotonic() - start < 3
