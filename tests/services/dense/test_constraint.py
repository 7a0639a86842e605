"""The dense side of structured output: the grammar's mask on the logits, the end of the grammar,
a reasoning section left free, bad grammars refused."""

import llguidance
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.dense.constraint import Grammars
from services.dense.request import Request
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import checkpoint

PATH = checkpoint("qwen3_moe")
VOCAB = 640  # the model's logits may be wider than the tokenizer (padding rows)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(PATH)


def run(tok, grammar: str, after: str = "", steps: int = 60, seed: int = 0, temperature: float = 1.0):
    """Samples from random logits through a Request (its sampler and detokenizer); returns (text, reason)."""
    constraint = Grammars(tok.path, tok.eos_token_ids).constraint(grammar, after)
    request = Request("r", [3, 4], SamplingParams(temperature=temperature, seed=seed, max_tokens=steps),
                      tok.eos_token_ids, tok, constraint=constraint)
    gen = torch.Generator().manual_seed(seed)
    text = ""
    for _ in range(steps):
        out = request.accept(torch.randn(VOCAB, generator=gen) * 3)
        assert max(request.generated) < tok.vocab_size
        text += out.text
        if out.finished:
            return text, out.finish_reason
    return text, None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_keeps_output_in_the_grammar_and_ends_it(tok, temperature):
    grammar = llguidance.LLMatcher.grammar_from_regex(r"(ab|cd){2,4}!")
    for seed in range(5):
        text, reason = run(tok, grammar, seed=seed, temperature=temperature)
        assert reason == "stop"
        assert len(text) >= 5 and text.endswith("!") and set(text[:-1]) <= set("abcd")


def test_a_reasoning_section_is_free_and_the_grammar_starts_after_it(tok):
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}")
    constraint = Grammars(tok.path, tok.eos_token_ids).constraint(grammar, after="</think>")
    request = Request("r", [3], SamplingParams(temperature=0, max_tokens=40), tok.eos_token_ids, tok,
                      constraint=constraint)
    thinking = tok.encode("hmm, let me see.</think>", add_special_tokens=False)
    reasoning = ""
    for t in thinking:  # force the reasoning tokens: unconstrained, the mask must let them all through
        logits = torch.full((VOCAB,), -5.0)
        logits[t] = 5.0
        out = request.accept(logits)
        assert out.finish_reason is None
        reasoning += out.text
    assert constraint.active and reasoning == "hmm, let me see.</think>"
    text = ""
    for _ in range(5):
        out = request.accept(torch.randn(VOCAB))
        text += out.text
        if out.finished:
            break
    assert out.finish_reason == "stop" and text.isdigit() and len(text) == 3


def test_a_bad_grammar_is_an_invalid_request(tok):
    with pytest.raises(InvalidRequestError, match="constraint.grammar"):
        Grammars(tok.path, tok.eos_token_ids).constraint("start: undefined_rule")
