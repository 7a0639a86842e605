"""Each tool-call and reasoning format on golden model outputs: the calls and text parsed whole equal
those rebuilt from a stream fed one character and one token at a time; malformed output stays text;
the grammars that force calls compile and only admit calls that parse back to valid arguments."""

import json
import re

import llguidance
import pytest

from gateway.parsing.output import Incremental, OutputParser, tool_format

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                           "required": ["zone"]}}
TOOLS = [WEATHER, TIME]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_time", {"zone": "Asia/Tokyo"})

DS_TEMPLATE = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'}}<think>"

# (format, template, rendered prompt tail, output, content, reasoning, calls)
GOLDEN = [
    ("hermes", "<tool_call>", "", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>',
     "Let me check.", "", [PARIS, TOKYO]),
    ("hermes", "<tool_call><think>", "", '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": '
     '"get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>', "", "The user wants weather.", [PARIS]),
    ("deepseek", DS_TEMPLATE, "<think>\n", "I should call the tool.\n</think>\n\nSure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
     "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 3}\n```<｜tool▁call▁end｜>\n"
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": \"Asia/Tokyo\"}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "Sure.", "I should call the tool.", [PARIS, TOKYO]),
    ("deepseek", "<｜tool▁calls▁begin｜>", "", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     "{\"zone\": \"Asia/Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "", [TOKYO]),
    ("kimi_k2", "<|tool_call_begin|>", "", "I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     "<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|><|tool_call_begin|>"
     "functions.get_time:1<|tool_call_argument_begin|>{\"zone\": \"Asia/Tokyo\"}<|tool_call_end|>"
     "<|tool_calls_section_end|>", "I'll look.", "", [PARIS, TOKYO]),
    ("glm45", "<arg_key><think>", "", "<think>Weather needed.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city"
     "</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "Checking.", "Weather needed.", [PARIS]),
    ("harmony", "<|channel|>", "", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 3}",
     "", "Need the weather.", [PARIS]),
    ("harmony", "<|channel|>", "", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny.", "It is sunny.", "Easy.", []),
]
MALFORMED = [
    ("hermes", "<tool_call>", "Oops <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>"),
    ("hermes", "<tool_call>", "Unclosed <tool_call>\n{\"name\": \"get_time\""),
    ("deepseek", DS_TEMPLATE, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\nno fence"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("kimi_k2", "<|tool_call_begin|>", "<|tool_call_begin|>get_time<|tool_call_argument_begin|>[1]<|tool_call_end|>"),
    ("glm45", "<arg_key>", "<tool_call>get_time\n<arg_key>zone</arg_key>junk</tool_call>"),
]
SPECIAL = re.compile(r"(<[｜|][^>]*[｜|]>|</?\w+>|\s+|\w+|.)")


def tokens(text: str) -> list[str]:
    """A stand-in for the model's tokens: special markers whole, then words, spaces and characters."""
    return SPECIAL.findall(text)


def parser(fmt, template, prompt, tools=TOOLS):
    return OutputParser.build(template, prompt, tools, tool_parser=fmt)


def streamed(p: OutputParser, pieces: list[str]):
    inc, content, reasoning, calls = Incremental(p), "", "", []
    for i, piece in enumerate(pieces):
        d = inc.feed(piece, final=i == len(pieces) - 1)
        content, reasoning, calls = content + d.content, reasoning + d.reasoning, calls + d.calls
    return content, reasoning, calls


def as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt, template, prompt, output, content, thought, calls", GOLDEN)
def test_golden_outputs_parse_the_same_whole_and_streamed(fmt, template, prompt, output, content, thought, calls):
    p = parser(fmt, template, prompt)
    assert tool_format(template).name == fmt
    whole = p.parse(output, final=True)
    assert (whole.content, whole.reasoning, as_pairs(whole.calls)) == (content, thought, calls)
    for pieces in ([*output], tokens(output)):
        c, r, streamed_calls = streamed(p, pieces)
        assert (c, r, as_pairs(streamed_calls)) == (content, thought, calls)


@pytest.mark.parametrize("fmt, template, output", MALFORMED)
def test_malformed_calls_stay_text(fmt, template, output):
    p = parser(fmt, template, "")
    whole = p.parse(output, final=True)
    assert whole.calls == [] and whole.content
    for marker in ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"):
        output = output.replace(marker, "")
    assert whole.content == output.strip()
    for pieces in ([*output], tokens(output)):
        assert streamed(p, pieces)[0] == whole.content


def test_kimi_keeps_its_own_call_ids():
    p = parser("kimi_k2", "<|tool_call_begin|>", "")
    calls = p.parse(GOLDEN[4][3], final=True).calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


def test_reasoning_without_tools_and_r1_without_an_opening_tag():
    p = OutputParser.build("<think>", "<｜Assistant｜><think>\n", None)
    out = p.parse("Hmm, 2+2.\n</think>\n\nFour.", final=True)
    assert (out.reasoning, out.content) == ("Hmm, 2+2.", "Four.")
    assert streamed(p, [*"Hmm, 2+2.\n</think>\n\nFour."])[:2] == ("Four.", "Hmm, 2+2.")
    q = OutputParser.build("<think>", "<|im_start|>assistant\n", None)
    assert q.parse("<think>a</think>b", final=True).content == "b"
    assert q.parse("no thinking here", final=True).content == "no thinking here"


@pytest.mark.parametrize("fmt, template", [("hermes", "<tool_call>"), ("deepseek", DS_TEMPLATE),
                                           ("deepseek", "<｜tool▁calls▁begin｜>"), ("kimi_k2", "<|tool_call_begin|>"),
                                           ("glm45", "<arg_key>"), ("harmony", "<|channel|>")])
def test_the_forcing_grammar_admits_exactly_a_call(fmt, template):
    p = parser(fmt, template, "")
    one = p.grammar(TOOLS, one=True)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(one)) == ""
    sample = _sample_call(fmt, template)
    assert as_pairs(p.parse(sample, final=True).calls) == [PARIS]
    assert _accepts(one, sample)
    assert not _accepts(one, sample.replace('"days": 3', '"days": "three"').replace("<arg_value>3<", "<arg_value>x<"))
    assert not _accepts(one, sample.replace("get_weather", "get_wether"))
    if fmt != "harmony":  # harmony calls one tool a turn
        assert not _accepts(one, _two_calls(fmt, sample))
        assert _accepts(p.grammar(TOOLS, one=False), _two_calls(fmt, sample))


def _sample_call(fmt, template) -> str:
    """The text the forcing grammar should produce for PARIS."""
    args = '{"city": "Paris", "days": 3}'
    return {
        ("hermes", "<tool_call>"): f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
        ("deepseek", DS_TEMPLATE): "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                                   f"{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ("deepseek", "<｜tool▁calls▁begin｜>"): "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                                             f"{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ("kimi_k2", "<|tool_call_begin|>"): "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                                          f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>",
        ("glm45", "<arg_key>"): "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                                "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        ("harmony", "<|channel|>"): f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{args}"
                                    "<|call|>",
    }[(fmt, template)]


def _two_calls(fmt, sample: str) -> str:
    """Two calls in one turn, as the format writes them."""
    for marker in ("<｜tool▁calls▁begin｜>", "<|tool_calls_section_begin|>"):
        if sample.startswith(marker):
            end = "<｜tool▁calls▁end｜>" if "｜" in marker else "<|tool_calls_section_end|>"
            inner = sample[len(marker):-len(end)]
            return marker + inner + inner + end
    return sample + "\n" + sample


def _accepts(lark: str, text: str) -> bool:
    """Whether the grammar takes text whole (fed byte by byte through a byte-level tokenizer)."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


class _Bytes:
    """A tokenizer of the 256 bytes plus an EOS, for llguidance."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s if isinstance(s, bytes) else s.encode())
