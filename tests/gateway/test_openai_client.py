"""The gateway through the official openai client: what an OpenAI user does, answered as OpenAI does."""

import httpx
import pytest
import torch

from gateway.chat_template import render
from services.dense.generate import generate
from services.dense.loader import open_checkpoint
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import checkpoint
from tests.conftest import load_fp32
from tests.gateway.servers import dense, gateway

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def stack():
    running = dense(PATH)
    with gateway(running.port) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        yield client, model, running
    running.stop(1)


def test_models_lists_the_served_model(stack):
    client, model, _ = stack
    assert model == PATH.name


def test_chat_greedy_text_equals_the_in_process_reference(stack):
    from services.dense.moe.native import NativeExperts

    client, model, _ = stack
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    tok = Tokenizer(PATH)
    prompt = tok.encode(render(tok.chat_template, MESSAGES, "<|bos|>", "<|eos|>"), add_special_tokens=False)
    ckpt, cfg = open_checkpoint(PATH)
    local, _ = load_fp32(PATH, NativeExperts(cfg, ckpt, "int8", threads=2))
    expected = generate(local, prompt, SamplingParams(temperature=0, max_tokens=16), tok.eos_token_ids, tok)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(expected.tokens)


def test_chat_template_renders_as_transformers_does():
    from transformers import AutoTokenizer

    tok = Tokenizer(PATH)
    ours = render(tok.chat_template, MESSAGES, "<|bos|>", "<|eos|>", add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(PATH).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_chat_streaming_role_first_finish_last_usage_then_done(stack):
    client, model, _ = stack
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content


def test_completions_with_text_and_token_ids_streaming_or_not(stack):
    client, model, _ = stack
    whole = client.completions.create(model=model, prompt="The quick brown", max_tokens=8, temperature=0)
    ids = Tokenizer(PATH).encode("The quick brown")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The quick brown", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert whole.choices[0].text == by_ids.choices[0].text == streamed
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8


def test_n_choices_and_seeds(stack):
    client, model, _ = stack
    kw = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, n=3)
    first = client.chat.completions.create(seed=11, **kw)
    again = client.chat.completions.create(seed=11, **kw)
    other = client.chat.completions.create(seed=12, **kw)
    texts = [c.message.content for c in first.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices]
    assert first.usage.completion_tokens == 36


def test_stop_strings_cut_the_text(stack):
    client, model, _ = stack
    text = client.completions.create(model=model, prompt="The quick brown", max_tokens=16, temperature=0).choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=model, prompt="The quick brown", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_logprobs_in_chat_and_completions(stack):
    client, model, _ = stack
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top one
    comp = client.completions.create(model=model, prompt="The quick", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_extra_body_parameters_reach_the_sampler(stack):
    client, model, _ = stack
    base = client.completions.create(model=model, prompt="The quick", max_tokens=12, temperature=0)
    tok = Tokenizer(PATH)
    first = tok.encode(base.choices[0].text, add_special_tokens=False)[0]
    barred = client.completions.create(model=model, prompt="The quick", max_tokens=12, temperature=0,
                                       extra_body={"stop_token_ids": [first], "min_tokens": 12, "top_k": 1,
                                                   "repetition_penalty": 1.0, "ignore_eos": True})
    assert barred.choices[0].finish_reason == "length" and barred.usage.completion_tokens == 12
    assert not torch.equal(torch.tensor(tok.encode(barred.choices[0].text, add_special_tokens=False)[:1]),
                           torch.tensor([first]))


def first_token(client, model, **kw) -> str:
    reply = client.completions.create(model=model, prompt="The quick", max_tokens=1, temperature=0, logprobs=0, **kw)
    return reply.choices[0].logprobs.tokens[0]


def test_logit_bias_minus_100_bans_and_plus_100_forces_at_temperature_0(stack):
    client, model, running = stack
    tok = Tokenizer(PATH)
    vocab = running.engine.model.cfg.vocab_size
    natural = first_token(client, model)
    same = [i for i in range(vocab) if tok.token_text(i) == natural]
    assert same
    banned = first_token(client, model, logit_bias={str(i): -100 for i in same})
    assert banned != natural
    forced_id = next(i for i in range(vocab) if tok.token_text(i).isalpha() and tok.token_text(i) != natural)
    forced = client.completions.create(model=model, prompt="The quick", max_tokens=3, temperature=0,
                                       logit_bias={str(forced_id): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [tok.token_text(forced_id)] * 3
    clamped = client.completions.create(model=model, prompt="The quick", max_tokens=3, temperature=0,
                                        logit_bias={str(forced_id): 1e6}, logprobs=0)
    assert clamped.choices[0].logprobs.tokens == forced.choices[0].logprobs.tokens
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                          logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == tok.decode([forced_id] * 2)


def test_logit_bias_outside_the_vocabulary_or_not_an_id_is_a_400(stack):
    client, model, running = stack
    vocab = running.engine.model.cfg.vocab_size
    for bias, words in (({str(vocab): 5}, "vocabulary"), ({"fox": 5}, "token ids")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt="hi", max_tokens=2, logit_bias=bias)
        assert "logit_bias" in str(err.value) and words in str(err.value)


def test_echo_returns_the_prompt_first_streamed_or_not(stack):
    client, model, _ = stack
    plain = client.completions.create(model=model, prompt="The quick brown", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=model, prompt="The quick brown", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "The quick brown" + plain.choices[0].text
    chunks = [c for c in client.completions.create(model=model, prompt="The quick brown", max_tokens=6, temperature=0,
                                                   echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == "The quick brown"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = Tokenizer(PATH).encode("The quick brown")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == Tokenizer(PATH).decode(ids, skip_special_tokens=False) + plain.choices[0].text


def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_major(stack):
    client, model, _ = stack
    prompts = ["The quick brown", "A fox", "Once upon"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    both = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 30
    ids = [Tokenizer(PATH).encode(p) for p in prompts]
    streamed = {}
    for c in client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0, stream=True):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [a.choices[0].text for a in alone]


def test_continuous_usage_stats_count_up_on_every_chunk(stack):
    client, model, _ = stack
    for create, kw in ((client.completions.create, {"prompt": "The quick"}),
                       (client.chat.completions.create, {"messages": MESSAGES})):
        chunks = list(create(model=model, max_tokens=6, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 6


def test_chat_without_max_tokens_runs_until_eos_or_the_context_ends(stack):
    client, model, running = stack
    context = running.engine.model.cfg.max_position_embeddings
    reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == context
    free = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0)
    assert free.usage.completion_tokens > 16
    assert free.choices[0].finish_reason == "stop" or free.usage.total_tokens == context


def metric(client, name: str) -> float:
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def test_a_shared_prefix_reports_its_cached_tokens_and_the_metrics_count_them(stack):
    client, model, running = stack
    block = running.engine.pool.block_size
    prefix = [(7 * i * i + 11 * i) % 500 + 3 for i in range(150)]
    hits, queries = metric(client, "tandem:prefix_cache_hits_total"), metric(client, "tandem:prefix_cache_queries_total")
    first = client.completions.create(model=model, prompt=prefix + [5, 6], max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=prefix + [7, 8, 9], max_tokens=4, temperature=0)
    streamed = list(client.completions.create(model=model, prompt=prefix + [7, 8, 9], max_tokens=4, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    aligned = 150 // block * block  # the full blocks the two prompts share
    assert second.usage.prompt_tokens_details.cached_tokens == aligned
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 152 // block * block
    assert metric(client, "tandem:prefix_cache_hits_total") - hits == aligned + 152 // block * block
    assert metric(client, "tandem:prefix_cache_queries_total") - queries == 152 + 153 + 153
    assert 0 < metric(client, "tandem:prefix_cache_hit_rate") <= 1
    assert metric(client, "tandem:num_preemptions_total") == 0
