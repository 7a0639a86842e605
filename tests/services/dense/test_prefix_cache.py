"""Prefix caching: full KV blocks reused across requests give the same tokens as computing them,
are counted, and give way (least recently used first) before any request is refused."""

import pytest
import torch

from services.dense.engine import Engine, EngineConfig
from services.dense.request import Request
from services.dense.sampling import SamplingParams
from tests.checkpoints import checkpoint
from tests.conftest import load_fp32

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_ids(n: int = 600) -> list[int]:
    """Token ids with no repeats that line up: two prompts share a prefix only where a test says."""
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "gpt_oss"])
def family(request):
    path = checkpoint(request.param)
    model, _ = load_fp32(path)
    ids = random_ids()
    prefix = (model.cfg.max_position_embeddings // 2) // BLOCK * BLOCK + 3  # not block-aligned
    return model, ids, prefix


def engine(model, caching=True, blocks=None, **kw):
    return Engine(model, EngineConfig(kv_blocks=blocks or 2 * model.cfg.max_position_embeddings // BLOCK,
                                      block_size=BLOCK, max_batch_tokens=64, prefix_caching=caching, **kw))


def run(e, prompts, params=GREEDY):
    requests = [e.submit(Request(f"r{i}", p, params)) for i, p in enumerate(prompts)]
    while e.has_work():
        e.step()
    outs = [[r.outputs.get() for _ in range(r.outputs.qsize())] for r in requests]
    assert all(o.error is None for out in outs for o in out)
    return [[t for o in out for t in o.token_ids] for out in outs], [out[-1].cached_tokens for out in outs]


def test_a_shared_prefix_is_reused_block_aligned_and_gives_the_same_tokens(family):
    model, ids, prefix = family
    first, second = ids[:prefix + 5], ids[:prefix] + ids[prefix + 40:prefix + 49]
    off = [run(engine(model, caching=False), [p])[0][0] for p in (first, second)]
    e = engine(model)
    assert run(e, [first]) == ([off[0]], [0])
    tokens, cached = run(e, [second])
    assert tokens == [off[1]] and cached == [prefix // BLOCK * BLOCK]
    assert e.pool.hits == prefix // BLOCK * BLOCK and e.pool.queries == len(first) + len(second)
    again, cached = run(e, [first])  # the whole prompt cached: all but its last block's worth is reused
    assert again == [off[0]] and cached == [(len(first) - 1) // BLOCK * BLOCK]
    assert e.blocks_in_use == 0 and e.pool.cached_blocks > 0


def test_cache_on_and_off_give_the_same_tokens_batched(family):
    model, ids, prefix = family
    prompts = [ids[:prefix] + ids[prefix + 7 * i:prefix + 7 * i + 4 + i] for i in range(4)]
    warm = engine(model)
    run(warm, prompts[:1])
    assert run(warm, prompts)[0] == run(engine(model, caching=False), prompts)[0]
    assert warm.pool.hits >= 3 * (prefix // BLOCK * BLOCK)


def test_cached_blocks_are_evicted_before_any_request_is_refused():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    ids = random_ids()
    e = engine(model, blocks=32, max_queue=0)  # 256 tokens
    small = [ids[i * 50:i * 50 + 40] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8)
    run(e, small, params)
    assert e.blocks_in_use == 0 and e.pool.cached_blocks == 25 and e.pool.free_blocks == 32  # 47 tokens: 5 full blocks each
    tokens, _ = run(e, [ids[300:540]], params)  # 241 tokens: 31 blocks, admitted at once (no queue to wait in)
    assert len(tokens[0]) == 8 and e.blocks_in_use == 0
    assert run(e, small[:1], params)[1] == [0]  # evicted


def test_least_recently_used_blocks_go_first():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    ids = random_ids()
    e = engine(model, blocks=16)
    old, recent = ids[:33], ids[100:133]  # 4 full blocks each, kept after they finish
    params = SamplingParams(temperature=0, max_tokens=1)
    run(e, [old], params)
    run(e, [recent], params)
    run(e, [ids[200:265]], params)  # 9 blocks: the 8 free ones and the oldest cached one
    assert run(e, [recent], params)[1] == [32] and run(e, [old], params)[1] < [32]


def test_preempted_requests_resume_from_their_cached_blocks():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    ids = random_ids()
    prompts = [ids[i:i + 60] for i in range(0, 96, 8)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    tight = engine(model, blocks=40)
    tokens, _ = run(tight, prompts, params)
    assert tight.preemptions > 0 and tight.pool.hits > 0
    assert tokens == run(engine(model, caching=False), prompts, params)[0]


def test_the_flag_switches_it_off_and_it_is_on_by_default():
    from services.dense.__main__ import config

    base = ["--model", str(checkpoint("qwen3_moe"))]
    assert config(base).engine(8).prefix_caching
    assert not config(base + ["--no-prefix-caching"]).engine(8).prefix_caching
