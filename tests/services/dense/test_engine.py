"""Continuous batching gives every request what it gets alone; the KV budget holds; blocks come back."""

import pytest
import torch

from services.common.errors import InvalidRequestError, ResourceExhaustedError
from services.dense.engine import Engine, EngineConfig
from services.dense.generate import generate
from services.dense.loader import open_checkpoint
from services.dense.request import Request
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from services.dense.weights import linear
from tests.checkpoints import checkpoint
from tests.conftest import PROMPT, load_fp32

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

# (prompt length, max_tokens): different lengths, so sequences join and leave at different steps
SHAPES = [(5, 10), (27, 16), (13, 6), (40, 12)]


def prompts(path) -> list[list[int]]:
    ids = Tokenizer(path).encode(PROMPT * 2)
    return [ids[i:i + n] for i, (n, _) in enumerate(SHAPES)]


def run_batched(model, requests, max_batch_tokens=24, kv_blocks=64):
    """Runs requests together (all submitted before the first step); returns each one's tokens."""
    engine = Engine(model, EngineConfig(kv_blocks=kv_blocks, block_size=8, max_batch_tokens=max_batch_tokens))
    for r in requests:
        engine.submit(r)
    while engine.has_work():
        engine.step()
    assert engine.blocks_in_use == 0
    out = []
    for r in requests:
        tokens = []
        while not r.outputs.empty():
            o = r.outputs.get()
            assert o.error is None, o.error
            tokens += o.token_ids
        out.append(tokens)
    return out


def native(path, fmt="int8"):
    from services.dense.moe.native import NativeExperts

    ckpt, cfg = open_checkpoint(path)
    return NativeExperts(cfg, ckpt, fmt, threads=2)


def assert_batched_equals_alone(model, path, params_list):
    eos = Tokenizer(path).eos_token_ids
    ps = prompts(path)
    alone = [generate(model, p, params, eos).tokens for p, params in zip(ps, params_list)]
    batched = run_batched(model, [Request(f"r{i}", p, params, eos) for i, (p, params) in
                                  enumerate(zip(ps, params_list))])
    assert batched == alone


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_greedy_batched_equals_alone_with_the_local_backend(family_checkpoint, fmt):
    _, path = family_checkpoint
    model, _ = load_fp32(path, native(path, fmt))
    assert_batched_equals_alone(model, path, [SamplingParams(temperature=0, max_tokens=m) for _, m in SHAPES])


def test_greedy_batched_equals_alone_with_the_remote_backend(family_checkpoint):
    from services.dense.moe.remote import RemoteConfig, RemoteExperts
    from tests.expert_server.servers import in_process

    _, path = family_checkpoint
    _, cfg = open_checkpoint(path)
    with in_process(path, "int8") as server:
        remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"127.0.0.1:{server.port}",), transport="shm"))
        model, _ = load_fp32(path, remote)
        assert_batched_equals_alone(model, path, [SamplingParams(temperature=0, max_tokens=m) for _, m in SHAPES])
        remote.close()


def test_seeded_sampling_is_the_same_alone_and_batched():
    path = checkpoint("qwen2_moe")
    model, _ = load_fp32(path, native(path))
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.02, seed=7, max_tokens=16, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=6, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, seed=99, max_tokens=12),
    ]
    assert_batched_equals_alone(model, path, params)


def test_prompt_chunks_do_not_change_the_result():
    """A long prompt prefilled in pieces of 7 tokens gives the same tokens as in one piece."""
    path = checkpoint("deepseek_v3")
    model, _ = load_fp32(path, native(path, "bf16"))
    p = prompts(path)[3]
    params = SamplingParams(temperature=0, max_tokens=8)
    whole = run_batched(model, [Request("a", p, params)], max_batch_tokens=64)
    pieces = run_batched(model, [Request("a", p, params)], max_batch_tokens=7)
    assert pieces == whole


def test_every_request_of_a_step_goes_to_the_experts_in_one_call():
    from tests.services.dense.test_expert_backend import CountingExperts

    path = checkpoint("mixtral")
    counting = CountingExperts(path)
    model, _ = load_fp32(path, counting)
    params = SamplingParams(temperature=0, max_tokens=3)
    run_batched(model, [Request(f"r{i}", [10 + i] * 4, params) for i in range(3)], max_batch_tokens=64)
    steps = len(counting.calls) // model.cfg.num_layers
    assert [c[1][0] for c in counting.calls[::model.cfg.num_layers]] == [12, 3, 3][:steps]


def test_kv_budget_queues_requests_then_refuses_past_the_queue_limit():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    engine = Engine(model, EngineConfig(kv_blocks=4, block_size=8, max_queue=1))
    params = SamplingParams(temperature=0, max_tokens=24)
    first = engine.submit(Request("a", [5] * 8, params))  # 32 tokens: the whole cache
    second = engine.submit(Request("b", [6] * 8, params))  # waits in the queue
    engine.step()
    assert engine.running == [first] and list(engine.waiting) == [second] and engine.blocks_in_use > 0
    with pytest.raises(ResourceExhaustedError, match="queued"):
        engine.submit(Request("c", [7] * 8, params))
    with pytest.raises(ResourceExhaustedError, match="whole KV cache"):
        engine.submit(Request("d", [7] * 30, SamplingParams(max_tokens=10)))
    while engine.has_work():
        engine.step()
    assert engine.blocks_in_use == 0
    assert first.outputs.qsize() and second.outputs.qsize()


def test_context_overflow_names_both_numbers():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    limit = model.cfg.max_position_embeddings
    engine = Engine(model, EngineConfig(kv_blocks=1000, block_size=8))
    with pytest.raises(InvalidRequestError, match=f"prompt \\(10 tokens\\) \\+ max_tokens \\({limit}\\).*{limit}"):
        engine.submit(Request("a", [3] * 10, SamplingParams(max_tokens=limit)))


def test_cancelled_request_leaves_at_the_next_step_and_frees_its_blocks():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    engine = Engine(model, EngineConfig(kv_blocks=32, block_size=8))
    keep = engine.submit(Request("keep", [4] * 9, SamplingParams(temperature=0, max_tokens=20)))
    drop = engine.submit(Request("drop", [5] * 9, SamplingParams(temperature=0, max_tokens=20)))
    for _ in range(3):
        engine.step()
    engine.abort(drop)
    engine.step()
    assert drop not in engine.running and drop.cache is None
    while engine.has_work():
        engine.step()
    assert engine.blocks_in_use == 0
    outs = [keep.outputs.get() for _ in range(keep.outputs.qsize())]
    assert sum(len(o.token_ids) for o in outs) == 20 and outs[-1].finish_reason == "length"
    last = [drop.outputs.get() for _ in range(drop.outputs.qsize())][-1]
    assert last.finish_reason == "abort"


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 9, 31])
def test_cpu_linear_rows_do_not_depend_on_the_batch(m):
    g = torch.Generator().manual_seed(m)
    w, x = torch.randn(96, 64, generator=g), torch.randn(40, 64, generator=g)
    full = linear(x, w)
    for start in (0, 3, 40 - m):
        assert torch.equal(linear(x[start:start + m], w), full[start:start + m])


def test_a_sequence_reads_the_same_entries_from_one_run_of_blocks_or_scattered_ones():
    """Blocks side by side are read as a view, scattered ones gathered: the same entries either way."""
    from services.dense.kv_cache import BlockPool, PagedSequence

    _, cfg = open_checkpoint(checkpoint("qwen3_moe"))
    alone, shared = (BlockPool(cfg, 16, 4, torch.float32, torch.device("cpu")) for _ in range(2))
    run, scattered, other = PagedSequence(alone), PagedSequence(shared), PagedSequence(shared)
    shape = alone.layers[0][0].shape[1:]
    for t in (6, 1, 3, 1, 5):
        for seq in (run, other, scattered):  # `other` takes blocks between scattered's
            seq.begin(t)
        new = [torch.randn(t, *shape) for _ in range(2)]
        read = [seq.layers[0].update(*new) for seq in (run, scattered, other)]
        for seq in (run, scattered, other):
            seq.commit(t)
        for a, b in zip(read[0], read[1]):
            assert torch.equal(a, b) and a.shape[0] == run.length
    assert run.base is not None and scattered.base is None
    for seq in (run, scattered, other):
        seq.free()
    assert alone.used_blocks == shared.used_blocks == 0


def test_requests_without_max_tokens_run_to_eos_or_the_context_end_preempted_under_kv_pressure_as_alone():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    tok = Tokenizer(path)
    context, eos = model.cfg.max_position_embeddings, tok.eos_token_ids
    ids = tok.encode(PROMPT * 8)
    ps = [ids[i:i + 100 + 13 * i % 50] for i in range(16)]
    params = SamplingParams(temperature=0)  # no max_tokens
    alone = [generate(model, p, params, eos).tokens for p in ps]
    assert all(len(p) + len(t) == context or t[-1] in eos for p, t in zip(ps, alone))
    engine = Engine(model, EngineConfig(kv_blocks=3 * context // 16, block_size=8, max_batch_tokens=64))
    requests = [engine.submit(Request(f"r{i}", p, params, eos)) for i, p in enumerate(ps)]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.running))
    assert engine.blocks_in_use == 0 and engine.preemptions > 0 and peak >= 2
    outs = [[r.outputs.get() for _ in range(r.outputs.qsize())] for r in requests]
    assert all(o.error is None for out in outs for o in out)
    assert [[t for o in out for t in o.token_ids] for out in outs] == alone
    assert [out[-1].finish_reason for out in outs] == ["stop" if t[-1] in eos else "length" for t in alone]
    assert any(r.preempted for r in requests)


def test_a_request_alone_never_outgrows_a_cache_smaller_than_the_context():
    path = checkpoint("qwen3_moe")
    model, _ = load_fp32(path)
    engine = Engine(model, EngineConfig(kv_blocks=6, block_size=8))
    request = engine.submit(Request("a", [5] * 10, SamplingParams(temperature=0, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    outs = [request.outputs.get() for _ in range(request.outputs.qsize())]
    assert sum(len(o.token_ids) for o in outs) == 48 - 10 and outs[-1].finish_reason == "length"


def test_the_running_loop_holds_the_cpu_wake_request_while_it_has_work_and_drops_it_when_idle(tmp_path, monkeypatch):
    from services.common import cpu_wake
    from tests.services.common.test_cpu_wake import open_on
    from tests.waiting import wait_for

    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    monkeypatch.setattr(cpu_wake, "DEVICE", str(device))
    model, _ = load_fp32(checkpoint("qwen3_moe"))
    held_in_steps = []
    for keep in (True, False):
        engine = Engine(model, EngineConfig(kv_blocks=16, block_size=8, keep_cpus_awake=keep))
        step = engine.step
        engine.step = lambda: (held_in_steps.append((keep, open_on(device))), step())
        engine.start()
        try:
            request = engine.submit(Request("a", [5] * 6, SamplingParams(temperature=0, max_tokens=4)))
            while not request.outputs.get(timeout=30).finished:
                pass
            assert wait_for(lambda: not open_on(device), timeout=10), "still held with no work"
        finally:
            engine.stop()
    assert {held for keep, held in held_in_steps if keep} == {True}
    assert {held for keep, held in held_in_steps if not keep} == {False}
