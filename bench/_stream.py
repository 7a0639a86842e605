"""Decode speed as a client of the stack sees it: greedy tokens streamed over HTTP per second."""

from __future__ import annotations

import json
import time
import urllib.request


def streamed_rate(port: int, body: dict, n: int) -> float:
    """Tokens/s after the first of a streamed /v1/completions request (body without its stream
    fields), counted by the usage each chunk carries: a token whose text is held back (a piece of a
    UTF-8 character, a possible stop string) sends no chunk of its own, so chunks undercount."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    stamps = []  # (time, tokens so far)
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    stamps.append((time.perf_counter(), chunk["usage"]["completion_tokens"]))
    if len(stamps) < 2 or stamps[-1][1] < n // 2:
        raise RuntimeError(f"the stack streamed {stamps[-1][1] if stamps else 0} tokens, expected about {n + 1}")
    return (stamps[-1][1] - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])
