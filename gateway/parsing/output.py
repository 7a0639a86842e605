"""One model's output parser, chosen from its chat template (or named by a flag): reasoning split
first, then tool calls in the answer; and its streaming form, which releases the differences
between successive parses (so a stream rebuilds exactly the non-streamed answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import ApiError
from gateway.parsing import reasoning
from gateway.parsing.base import Call, Parsed
from gateway.parsing.harmony import Harmony
from gateway.parsing.tool_formats import FORMATS

TOOL_PARSERS = ("auto", "hermes", "deepseek", "kimi_k2", "glm45", "harmony")
REASONING_PARSERS = ("auto", "think", "none")


def tool_format(template: str, name: str = "auto"):
    """The tool-call format: named, or recognised by the markers the template writes."""
    if name == "auto":
        name = ("harmony" if "<|channel|>" in template else
                "deepseek" if "<｜tool▁calls▁begin｜>" in template else
                "kimi_k2" if "<|tool_call_begin|>" in template or "<|tool_calls_section_begin|>" in template else
                "glm45" if "<arg_key>" in template else "hermes")
    return Harmony(template) if name == "harmony" else FORMATS[name](template)


@dataclass
class OutputParser:
    """Splits one choice's output; tools=None: no tool calls are looked for."""

    format: object
    think: bool  # a <think> reasoning section is split off
    inside: bool = False  # the prompt leaves the model inside the reasoning
    tools: list[dict] | None = None

    @classmethod
    def build(cls, template: str, prompt: str, tools: list[dict] | None, tool_parser: str = "auto",
              reasoning_parser: str = "auto") -> OutputParser:
        fmt = tool_format(template, tool_parser)
        think = (reasoning_parser == "think" or reasoning_parser == "auto" and reasoning.OPEN in template
                 and not getattr(fmt, "reasoning", False))
        return cls(fmt, think, think and reasoning.starts_inside(prompt), tools)

    @property
    def active(self) -> bool:
        return self.think or self.tools is not None or getattr(self.format, "reasoning", False)

    @property
    def needs_special_tokens(self) -> bool:
        """Its markers may be special tokens, which the dense service must then stream as text."""
        return self.tools is not None or getattr(self.format, "reasoning", False)

    def constraint_after(self, prompt: str, for_tools: bool) -> str:
        """Where a grammar takes over: after the reasoning, when the output starts with one (a prompt
        that closes the reasoning itself, thinking switched off, has none); in harmony, a tool grammar
        writes its own header and any other one fills the final channel."""
        if getattr(self.format, "reasoning", False):
            return "" if for_tools else self.format.FINAL
        if self.think and (self.inside or not prompt.rstrip().endswith(reasoning.CLOSE)):
            return reasoning.CLOSE
        return ""

    def parse(self, text: str, final: bool) -> Parsed:
        if getattr(self.format, "reasoning", False):
            out = self.format.parse(text, final, self.tools or [])
            return out if self.tools is not None else Parsed(_join(out), out.reasoning)
        thought, answer, _ = reasoning.split(text, final, self.inside) if self.think else ("", text, True)
        if self.tools is None:
            return Parsed(answer.strip() if self.think else answer, thought)
        out = self.format.parse(answer, final, self.tools)
        out.reasoning = thought
        return out

    def grammar(self, tools: list[dict], one: bool) -> str:
        return self.format.grammar(tools, one)


def _join(out: Parsed) -> str:
    """Harmony output read without tools: calls stay text."""
    return out.content


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[Call] = field(default_factory=list)


class Incremental:
    """Feeds a growing text to a parser; each feed says what is new."""

    def __init__(self, parser: OutputParser):
        self.parser, self.text, self.sent = parser, "", Parsed()

    def feed(self, piece: str, final: bool = False) -> Delta:
        self.text += piece
        now = self.parser.parse(self.text, final)
        delta = Delta(_grown(self.sent.content, now.content), _grown(self.sent.reasoning, now.reasoning),
                      now.calls[len(self.sent.calls):])
        self.sent = now
        return delta


def _grown(before: str, now: str) -> str:
    """The text `now` adds to `before` (parsers only ever extend what they released)."""
    if not now.startswith(before):
        raise ApiError(500, "the output parser took back text it had released")
    return now[len(before):]
