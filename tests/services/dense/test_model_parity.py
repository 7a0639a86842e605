"""Our dense path against transformers on every family's tiny checkpoint (float32)."""

import pytest
import torch

from services.dense.generate import generate
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import checkpoint
from tests.conftest import load_fp32
from tests.reference.hf_oracle import hf_greedy, hf_logits

TOL = 1e-4


def test_logits_match_transformers_at_every_position(family_checkpoint, prompt_ids):
    _, path = family_checkpoint
    model, _ = load_fp32(path)
    ours = model.forward(torch.tensor(prompt_ids), model.new_cache(len(prompt_ids)))
    ref = hf_logits(path, prompt_ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


def test_greedy_continuation_matches_transformers_generate(family_checkpoint, prompt_ids):
    _, path = family_checkpoint
    model, _ = load_fp32(path)
    eos = Tokenizer(path).eos_token_ids
    ours = generate(model, prompt_ids, SamplingParams(temperature=0, max_tokens=32), eos)
    assert ours.tokens == hf_greedy(path, prompt_ids, 32)


def test_kv_cache_decode_matches_full_recompute(family_checkpoint, prompt_ids):
    _, path = family_checkpoint
    model, _ = load_fp32(path)
    tokens = torch.tensor(prompt_ids)
    full = model.forward(tokens, model.new_cache(len(tokens)))
    cache = model.new_cache(len(tokens))
    split = len(tokens) // 2
    stepped = [model.forward(tokens[:split], cache)]  # prefill half, then one token at a time
    stepped += [model.forward(tokens[i : i + 1], cache) for i in range(split, len(tokens))]
    assert (torch.cat(stepped) - full).abs().max().item() <= TOL


def test_bfloat16_dense_path_is_as_close_to_float32_as_transformers_bf16(family_checkpoint, prompt_ids):
    """bf16 rounding moves logits; ours must move no more than transformers' own bf16 run does."""
    from transformers import AutoModelForCausalLM

    from services.dense.loader import load_model
    from services.dense.runtime import DenseRuntime

    _, path = family_checkpoint
    model, _ = load_model(path, DenseRuntime(dtype="bfloat16", device="cpu"))
    assert model.embed.dtype == torch.bfloat16
    ours = model.forward(torch.tensor(prompt_ids), model.new_cache(len(prompt_ids)))
    exact = hf_logits(path, prompt_ids)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        theirs = hf_bf16(torch.tensor([prompt_ids])).logits[0].float()

    def rel(x):
        return ((x - exact).norm() / exact.norm()).item()

    assert rel(ours) <= 1.5 * rel(theirs) + 1e-3


@pytest.mark.parametrize("weights", ["float", pytest.param("bf16", marks=pytest.mark.native)])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_qnull", "deepseek_v2"])
def test_absorbed_mla_equals_the_expanded_form_at_every_position(name, weights, monkeypatch):
    """Absorbed MLA (decode's path) against the expanded keys and values, over 300 positions: in
    torch (float linears), and in the native attention call (packed linears, whose pool it runs on)."""
    from services.dense.layers import attention
    from services.dense.loader import load_model
    from services.dense.runtime import DenseRuntime

    model, _ = load_model(checkpoint(name), DenseRuntime(dtype="float32", device="cpu", weights=weights, threads=2))
    tokens = torch.randint(3, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    runs = {}
    for absorb in (0, 10**6):
        monkeypatch.setattr(attention, "ABSORB_MAX_TOKENS", absorb)
        runs[absorb] = model.forward(tokens, model.new_cache(len(tokens)))
    assert (runs[0] - runs[10**6]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_grouped_query_attention_of_a_few_tokens_equals_torchs(tokens, window):
    """Decode's attention over the cached heads as they are against torch's own (which repeats
    every key and value per query head), causal and in a sliding window."""
    from services.dense.layers.attention import _attend_grouped

    gen = torch.Generator().manual_seed(tokens)
    s, h, hkv, d = 40, 8, 2, 16
    q, k, v = torch.randn(tokens, h, d, generator=gen), torch.randn(s, hkv, d, generator=gen), torch.randn(s, hkv, d, generator=gen)
    positions = torch.arange(s - tokens, s)
    keys = torch.arange(s)
    mask = keys[None, :] <= positions[:, None]
    if window:
        mask &= keys[None, :] > positions[:, None] - window
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.25, enable_gqa=True)
    assert (_attend_grouped(q, k, v, mask, 0.25) - theirs.transpose(0, 1).reshape(tokens, -1)).abs().max() <= 1e-5
