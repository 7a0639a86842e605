import pytest
import torch

from services.common.errors import InvalidRequestError
from services.dense.generate import generate
from services.dense.sampling import Sampler, SamplingParams, _top_p
from tests.checkpoints import checkpoint
from tests.conftest import load_fp32

PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def model():
    return load_fp32(checkpoint("qwen3_moe"))[0]


def test_seeded_sampling_is_reproducible(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=24)
    first = generate(model, PROMPT, params).tokens
    assert generate(model, PROMPT, params).tokens == first
    others = {tuple(generate(model, PROMPT, SamplingParams(temperature=1.0, seed=s, max_tokens=24)).tokens)
              for s in range(8, 12)}
    assert len(others | {tuple(first)}) > 1  # the seed matters


def test_greedy_equals_top_k_one(model):
    greedy = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=12)).tokens
    assert generate(model, PROMPT, SamplingParams(temperature=0.7, top_k=1, seed=3, max_tokens=12)).tokens == greedy


def test_generation_stops_at_eos_or_max_tokens(model):
    greedy = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=12))
    assert len(greedy.tokens) == 12 and greedy.finish_reason == "length"
    eos = greedy.tokens[4]
    stopped = generate(model, PROMPT, SamplingParams(temperature=0, max_tokens=12), eos_ids=(eos,))
    assert stopped.tokens == greedy.tokens[: greedy.tokens.index(eos) + 1]
    assert stopped.finish_reason == "stop"


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    for seed in range(50):
        assert Sampler(SamplingParams(top_k=2, seed=seed))(logits) in (0, 1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _top_p(probs, 0.8).nonzero().flatten().tolist() == [0, 1]
    assert _top_p(probs, 0.81).nonzero().flatten().tolist() == [0, 1, 2]
    assert _top_p(probs, 0.1).nonzero().flatten().tolist() == [0]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_invalid_sampling_parameters_are_rejected(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_context_overflow_names_both_numbers(model):
    limit = model.cfg.max_position_embeddings
    with pytest.raises(InvalidRequestError, match=f"{len(PROMPT)} tokens.*{limit}"):
        generate(model, PROMPT, SamplingParams(max_tokens=limit))


def test_logit_bias_is_added_clamped_to_100_before_sampling_and_not_in_logprobs():
    logits = torch.tensor([0.0, 5.0, 1.0, -2.0])
    params = SamplingParams(temperature=0, logit_bias=((1, -100.0), (3, 7.5)), logprobs=1)
    token, lp = Sampler(params).sample(logits)
    assert token == 3
    assert lp.logprob == pytest.approx(float(logits.log_softmax(-1)[3]))  # the model's own distribution
    clamped = Sampler(SamplingParams(temperature=0, logit_bias=((0, -1e9), (1, -1e9))))
    assert clamped._process(logits.clone()).tolist() == [-100.0, -95.0, 1.0, -2.0]
    seeded = SamplingParams(temperature=1.0, seed=5, logit_bias=((2, 100.0),))
    assert {Sampler(seeded)(logits) for _ in range(8)} == {2}


@pytest.mark.parametrize("bias", [((-1, 1.0),), ((2, float("nan")),), ((2, float("inf")),)])
def test_bad_logit_bias_is_refused_naming_the_field(bias):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_shortcut_picks_what_the_full_path_picks(dtype):
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(97, generator=g).to(dtype) for _ in range(20)]
    steps.append(torch.zeros(97, dtype=dtype))  # a tie everywhere: the first index, as argmax gives
    fast = Sampler(SamplingParams(temperature=0))
    full = Sampler(SamplingParams(temperature=0))
    assert fast._plain_greedy
    full._plain_greedy = False
    assert [fast(x) for x in steps] == [full(x) for x in steps]
    assert fast.generated == full.generated


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.3), dict(presence_penalty=0.5),
                                    dict(frequency_penalty=0.5), dict(logit_bias=((1, 5.0),)),
                                    dict(logprobs=2), dict(min_tokens=3), dict(temperature=0.7)])
def test_anything_that_changes_the_choice_takes_the_full_path(kwargs):
    params = SamplingParams(**{"temperature": 0, **kwargs})
    assert not Sampler(params, barred=(0,))._plain_greedy
