"""SSE framing: orjson's bytes, and json.dumps's ASCII escapes for what orjson refuses."""

import json

from gateway.sse import DONE, frame


def test_a_frame_is_one_data_line_of_the_event_as_json():
    event = {"id": "cmpl-1", "choices": [{"index": 0, "text": "é 😀\n", "logprobs": None, "finish_reason": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "ratio": 0.1}}
    out = frame(event)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n") and out.count(b"\n") == 2
    assert json.loads(out[6:]) == event
    assert "é 😀".encode() in out  # UTF-8 as it is, not \u escapes
    assert DONE == b"data: [DONE]\n\n"


def test_what_orjson_refuses_is_still_framed_as_valid_json():
    for event in ({"text": "\ud800 lone"}, {"n": 2**70}):
        out = frame(event)
        assert out.startswith(b"data: ") and out.endswith(b"\n\n") and out.count(b"\n") == 2
        assert json.loads(out[6:]) == event
