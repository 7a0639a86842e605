"""The tool-call formats whose calls are delimited blocks in the text: Hermes/Qwen3, DeepSeek-V3/R1
(and V3.1), Kimi-K2 and GLM-4.5. Each knows its block markers, how to decode one block, and the
Lark grammar (llguidance's dialect, with %json for the arguments) that forces valid calls.

Output text of the shapes (one call each):
  hermes    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  deepseek  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
            (V3.1: <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>)
  kimi_k2   <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
  glm45     <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
"""

from __future__ import annotations

import json
import re

from gateway.parsing.base import Call, Parsed, held_back, json_arguments

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def schema_json(schema: dict) -> str:
    """A schema for an inline %json, with the compact JSON options."""
    return json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}, ensure_ascii=False)


def parameters(tool: dict) -> dict:
    params = tool.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


class BlockFormat:
    """Calls are text between `begin` and `end`; `section` markers around a group of them are dropped."""

    name = ""
    begin = end = ""
    section: tuple[str, ...] = ()
    separator = ""  # between calls, in the grammar

    def __init__(self, template: str = ""):
        self.template = template

    def parse(self, text: str, final: bool, tools: list[dict]) -> Parsed:
        out, pieces, i = Parsed(), [], 0
        while True:
            j = text.find(self.begin, i)
            if j < 0:
                tail = text[i:]
                pieces.append(tail if final else tail[:len(tail) - held_back(tail, (self.begin,) + self.section)])
                break
            pieces.append(text[i:j])
            k = text.find(self.end, j + len(self.begin))
            if k < 0:  # unfinished: held back, or at the end kept as text
                pieces.append(text[j:] if final else "")
                break
            calls = self.decode(text[j + len(self.begin):k], tools)
            if calls is None:
                pieces.append(text[j:k + len(self.end)])
            else:
                out.calls += calls
            i = k + len(self.end)
        content = "".join(pieces)
        for marker in self.section:
            content = content.replace(marker, "")
        out.content = content.strip()
        return out

    def decode(self, block: str, tools: list[dict]) -> list[Call] | None:
        raise NotImplementedError

    def grammar(self, tools: list[dict], one: bool) -> str:
        """Lark: one call (or several) of the given tools, nothing else."""
        rules = [f"call_{i}: {self.call_rule(t)}" for i, t in enumerate(tools)]
        call = " | ".join(f"call_{i}" for i in range(len(tools)))
        many = "call" if one else f"call ({lit(self.separator)} call)*" if self.separator else "call+"
        return "\n".join([f"start: {self.wrap(many)}", f"call: {call}", *rules])

    def wrap(self, calls: str) -> str:
        return calls

    def call_rule(self, tool: dict) -> str:
        raise NotImplementedError


class Hermes(BlockFormat):
    name, begin, end, separator = "hermes", "<tool_call>", "</tool_call>", "\n"

    def decode(self, block, tools):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = json_arguments(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else [Call(obj["name"], args)]

    def call_rule(self, tool):
        schema = {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": parameters(tool)},
                  "required": ["name", "arguments"], "additionalProperties": False}
        return f'{lit(self.begin + chr(10))} %json {schema_json(schema)} {lit(chr(10) + self.end)}'


class DeepSeek(BlockFormat):
    name, begin, end = "deepseek", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    section = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"
    FENCED = re.compile(r"^\s*(\S+?)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)

    def decode(self, block, tools):
        left, sep, right = block.partition(self.SEP)
        if not sep:
            return None
        if left.strip() == "function":  # V3 / R1: type, then the name and fenced JSON
            m = self.FENCED.match(right)
            if not m:
                return None
            name, args = m[1], json_arguments(m[2])
        else:  # V3.1: the name, then the JSON
            name, args = left.strip(), json_arguments(right.strip())
        return None if args is None or not name else [Call(name, args)]

    def wrap(self, calls):
        return f"{lit(self.section[0])} {calls} {lit(self.section[1])}"

    def call_rule(self, tool):
        params = schema_json(parameters(tool))
        if "```json" in self.template or not self.template:
            head = f"{self.begin}function{self.SEP}{tool['name']}\n```json\n"
            return f"{lit(head)} %json {params} {lit(chr(10) + '```' + self.end)}"
        return f"{lit(self.begin + tool['name'] + self.SEP)} %json {params} {lit(self.end)}"


class KimiK2(BlockFormat):
    name, begin, end = "kimi_k2", "<|tool_call_begin|>", "<|tool_call_end|>"
    section = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    ARGS = "<|tool_call_argument_begin|>"
    ID = re.compile(r"^(?:functions\.)?([\w.\-]+):(\d+)$")

    def decode(self, block, tools):
        head, sep, body = block.partition(self.ARGS)
        m = self.ID.match(head.strip())
        args = json_arguments(body.strip()) if sep else None
        return None if m is None or args is None else [Call(m[1], args, id=head.strip())]

    def wrap(self, calls):
        return f"{lit(self.section[0])} {calls} {lit(self.section[1])}"

    def call_rule(self, tool):
        return (f'{lit(self.begin + "functions." + tool["name"] + ":")} /[0-9]{{1,2}}/ {lit(self.ARGS)} '
                f'%json {schema_json(parameters(tool))} {lit(self.end)}')


class Glm45(BlockFormat):
    name, begin, end, separator = "glm45", "<tool_call>", "</tool_call>", "\n"
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def decode(self, block, tools):
        name = block.split("<arg_key>", 1)[0].strip()
        if not name or "<" in name:
            return None
        props = next((parameters(t).get("properties", {}) for t in tools if t["name"] == name), {})
        rest = block[len(block.split("<arg_key>", 1)[0]):]
        if self.PAIR.sub("", rest).strip():
            return None
        args = {}
        for key, value in self.PAIR.findall(rest):
            args[key.strip()] = self._value(value, props.get(key.strip(), {}))
        return [Call(name, json.dumps(args, ensure_ascii=False))]

    @staticmethod
    def _value(text: str, schema: dict):
        """Strings are written raw, everything else as JSON (as GLM-4.5's template writes them)."""
        if schema.get("type") == "string":
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def call_rule(self, tool):
        params = parameters(tool)
        props = params.get("properties", {})
        parts = [lit(f"{self.begin}{tool['name']}\n")]
        for key in params.get("required", []):
            parts += [lit(f"<arg_key>{key}</arg_key>\n<arg_value>"), self._value_rule(props.get(key, {})),
                      lit("</arg_value>\n")]
        return " ".join(parts + [lit(self.end)])

    @staticmethod
    def _value_rule(schema: dict) -> str:
        if schema.get("type") != "string":
            return f"%json {schema_json(schema or {})}"
        if "enum" in schema:
            return "(" + " | ".join(lit(str(v)) for v in schema["enum"]) + ")"
        if "pattern" in schema:
            return "/" + schema["pattern"].lstrip("^").rstrip("$").replace("/", "\\/") + "/"
        return f"/[^<\\n]{{{schema.get('minLength', 0)},{schema.get('maxLength', 256)}}}/"


FORMATS = {f.name: f for f in (Hermes, DeepSeek, KimiK2, Glm45)}
