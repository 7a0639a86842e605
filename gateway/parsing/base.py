"""What every output parser shares: the parse of a whole output so far, the calls it holds, and the
hold-back rule that makes parsing a growing text safe to stream.

A parser is a pure function of (text so far, final): the content and reasoning it returns only
grow as the text grows, and a call appears only once it is complete and valid, so streaming the
differences between successive parses gives exactly the non-streamed answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""  # a format's own call id (Kimi-K2's functions.NAME:IDX), else one is made


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text may be the start of a marker (so are not released yet)."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:n]):
                longest = n
                break
    return longest


def json_arguments(value) -> str | None:
    """A call's arguments as JSON text of an object, from a dict or a JSON string; None if neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_id(call: Call) -> str:
    return call.id or f"call_{uuid.uuid4().hex[:24]}"
