"""gpt-oss's harmony format: the output is a sequence of messages, each a header and a body,

  <|channel|>analysis<|message|>thinking...<|end|>
  <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
  <|start|>assistant<|channel|>final<|message|>the answer<|return|>

analysis is reasoning, final is content, commentary addressed to=functions.NAME is a call (its body
the arguments), commentary to nobody is content (a preamble). The recipient may stand in the role
header (`<|start|>assistant to=functions.f<|channel|>...`). <|call|> and <|return|> are stop tokens,
so the last body may end with the text.
"""

from __future__ import annotations

import re

from gateway.parsing.base import Call, Parsed, held_back, json_arguments
from gateway.parsing.tool_formats import lit, parameters, schema_json

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START, CHANNEL)
RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")


class Harmony:
    name = "harmony"
    reasoning = True  # it splits reasoning itself
    FINAL = f"{CHANNEL}final{MESSAGE}"  # a response_format grammar applies from here

    def __init__(self, template: str = ""):
        self.template = template

    def parse(self, text: str, final: bool, tools: list[dict]) -> Parsed:
        out, reasoning, content, i = Parsed(), [], [], 0
        while True:
            c = text.find(CHANNEL, i)
            m = text.find(MESSAGE, c + len(CHANNEL)) if c >= 0 else -1
            if m < 0:
                break  # no complete header yet: nothing of it is released
            header = text[i:m]
            body_start = m + len(MESSAGE)
            end, closed = self._body_end(text, body_start)
            body = text[body_start:end]
            if not closed and not final:
                body = body[:len(body) - held_back(body, ENDS)]
            channel = text[c + len(CHANNEL):m].split()[0] if text[c + len(CHANNEL):m].split() else ""
            recipient = RECIPIENT.search(header)
            if recipient:
                if closed or final:
                    args = json_arguments(body.strip())
                    if args is None:
                        content.append(body)
                    else:
                        out.calls.append(Call(recipient[1], args))
            elif channel == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
            if not closed:
                break
            i = end if text.startswith((START, CHANNEL), end) else text.index(">", end) + 1  # past <|end|> and the like
        if final and i == 0 and not out.calls and not reasoning and not content:
            content.append(text)  # no harmony messages at all: plain text
        out.reasoning, out.content = "".join(reasoning).strip(), "".join(content).strip()
        return out

    @staticmethod
    def _body_end(text: str, start: int) -> tuple[int, bool]:
        """Where a body ends, and whether a marker ends it (else it runs to the end of the text)."""
        found = [j for j in (text.find(e, start) for e in ENDS) if j >= 0]
        return (min(found), True) if found else (len(text), False)

    def grammar(self, tools: list[dict], one: bool) -> str:
        """One call (harmony calls one tool at a time; <|call|> then ends the turn)."""
        rules = []
        for i, tool in enumerate(tools):
            head = f"{CHANNEL}commentary to=functions.{tool['name']} <|constrain|>json{MESSAGE}"
            rules.append(f"call_{i}: {lit(head)} %json {schema_json(parameters(tool))} {lit('<|call|>')}")
        return "\n".join(["start: call", "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules])
