"""One chat request through the three real processes leaves one trace: the gateway's GenAI span,
the dense service's request and step spans, and the expert server's spans, linked parent to child."""

import json
import os
import time

import pytest

from tests.random_model import random_model
from tests.services.launcher.launch import serve

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

MOE_LAYERS = 3  # the random model: 4 layers, the first one dense


def serve_and_chat(tmp_path, each_call: bool) -> list[dict]:
    env = {**os.environ, "TANDEM_TRACE_FILE": str(tmp_path / "{service}.jsonl"),
           "TANDEM_TRACE_EXPERT_CALLS": "1" if each_call else "0"}
    path = random_model()
    with serve("--model", str(path), "--format", "int8", "--threads", "2", env=env) as run:
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        client.chat.completions.create(model=path.name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0)
        time.sleep(1.0)
    spans = []
    for path in tmp_path.glob("*.jsonl"):
        spans += [json.loads(line) for line in path.read_text().splitlines()]
    return spans


def by_service(spans):
    out = {}
    for s in spans:
        out.setdefault(s["resource"]["attributes"]["service.name"], []).append(s)
    return out


@pytest.mark.parametrize("each_call", [False, True], ids=["per-step", "per-layer"])
def test_one_trace_spans_all_three_services_with_parent_links(tmp_path, each_call):
    everything = serve_and_chat(tmp_path, each_call)
    (root,) = [s for s in everything if s["name"] == f"chat {random_model().name}"]
    trace_id = root["context"]["trace_id"]
    spans = [s for s in everything if s["context"]["trace_id"] == trace_id]
    services = by_service(spans)
    assert set(services) == {"tandem-gateway", "tandem-dense", "tandem-expert-server"}
    ids = {s["context"]["span_id"]: s for s in spans}
    top = root
    while top["parent_id"] is not None:
        top = ids[top["parent_id"]]
    assert top["name"] == "POST /v1/chat/completions" and top["kind"] == "SpanKind.SERVER"  # the HTTP hop
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == random_model().name
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    for key in ("queue_s", "prefill_s", "decode_s", "time_to_first_token_s"):
        assert a[f"tandem.latency.{key}"] >= 0
    dense = {s["name"]: s for s in services["tandem-dense"]}
    request = dense["generate"]
    assert request["parent_id"] == root["context"]["span_id"]
    for name in ("queue", "prefill", "decode"):
        assert dense[name]["parent_id"] == request["context"]["span_id"]
    steps = [s for s in services["tandem-dense"] if s["name"] == "step"]
    assert len(steps) == 5 and all(s["parent_id"] == request["context"]["span_id"] for s in steps)
    expert = services["tandem-expert-server"]
    if each_call:
        calls = [s for s in services["tandem-dense"] if s["name"] == "expert_call"]
        assert len(calls) == MOE_LAYERS * len(steps)
        assert all(ids[c["parent_id"]]["name"] == "step" for c in calls)
        assert sorted(ids[s["parent_id"]]["name"] for s in expert) == ["expert_call"] * len(calls)
    else:
        assert len(expert) == len(steps) and all(ids[s["parent_id"]]["name"] == "step" for s in expert)
        assert all(s["attributes"]["tandem.calls"] == MOE_LAYERS for s in expert)
        assert all(s["attributes"]["tandem.experts.calls"] == MOE_LAYERS for s in steps)
