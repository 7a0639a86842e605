"""Server-sent events as OpenAI clients read them: `data: <json>` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from gateway.errors import ApiError

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def frame(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def guarded(events: AsyncIterator[dict], on_error: Callable[[ApiError], None] | None = None
                  ) -> AsyncIterator[str]:
    """Frames events; an error after the stream started becomes an error frame, then [DONE]."""
    try:
        async for event in events:
            yield frame(event)
    except ApiError as exc:
        log.info("stream ended by an error: %s", exc.message)
        yield frame(exc.body())
    yield DONE
