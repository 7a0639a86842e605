"""Server-sent events as OpenAI clients read them: `data: <json>` frames, then `data: [DONE]`.

Frames are bytes from orjson: about 6% less gateway CPU per streamed token than json.dumps, two
gateways side by side on bench/gateway.py's fake dense service. What orjson refuses (a lone
surrogate, an integer past 64 bits) is written by json.dumps with ASCII escapes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

import orjson

from gateway.errors import ApiError

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def dumps(obj) -> bytes:
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return json.dumps(obj).encode()


def frame(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def guarded(events: AsyncIterator[dict], on_error: Callable[[ApiError], None] | None = None
                  ) -> AsyncIterator[bytes]:
    """Frames events; an error after the stream started becomes an error frame, then [DONE]."""
    try:
        async for event in events:
            yield frame(event)
    except ApiError as exc:
        log.info("stream ended by an error: %s", exc.message)
        yield frame(exc.body())
    yield DONE
