"""The dense path's native small steps (rope, a few tokens' attention, exact float linears) against
the torch code they replace, and their argument checks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tandem_native")

import tandem_native  # noqa: E402

from services.dense.layers import attention, norm, rope  # noqa: E402
from services.dense.pool import shared_pool  # noqa: E402
from services.dense.weights import ExactLinear, Linear  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def torch_rotary(monkeypatch, rotary, x, cos, sin):
    with monkeypatch.context() as m:
        m.setattr(rope, "_native", None)
        return rotary.apply(x, cos, sin)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rot_dim", [(128, 128), (64, 32), (96, 64)])
def test_native_rope_gives_torchs_bits_on_views_and_in_place(monkeypatch, gen, interleaved, head_dim, rot_dim):
    from services.common.model_config import RopeConfig

    rotary = rope.Rotary(RopeConfig(kind="default", theta=10000.0, dim=rot_dim, interleaved=interleaved), torch.device("cpu"))
    t, heads = 5, 6
    fused = torch.randn(t, (heads + 2) * head_dim, generator=gen)  # a projection's output, q heads then others
    x = fused[:, :heads * head_dim].view(t, heads, head_dim)  # a strided view, as GQAttention's q
    cos, sin = rotary.cos_sin(torch.arange(7, 7 + t), 7 + t, torch.float32)
    want = torch_rotary(monkeypatch, rotary, x, cos, sin)
    assert torch.equal(rotary.apply(x, cos, sin), want)
    rest = fused[:, heads * head_dim:].clone()
    assert rotary.apply(x, cos, sin, out=x) is x
    assert torch.equal(x, want) and torch.equal(fused[:, heads * head_dim:], rest)


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_per_head_norm_in_the_rope_call_gives_the_norm_then_rope_bits(monkeypatch, gen, interleaved):
    """Qwen3's q and k norms ride in the rotation's call: the same bits as rms_norm then rope, native
    or torch, on a strided view turned in place."""
    from services.common.model_config import RopeConfig

    rotary = rope.Rotary(RopeConfig(kind="default", theta=10000.0, dim=64, interleaved=interleaved), torch.device("cpu"))
    t, heads, head_dim = 4, 3, 96
    weight = torch.rand(head_dim, generator=gen) + 0.5
    fused = torch.randn(t, (heads + 1) * head_dim, generator=gen) * 3
    x = fused[:, :heads * head_dim].view(t, heads, head_dim)
    cos, sin = rotary.cos_sin(torch.arange(t), t, torch.float32)
    want = torch_rotary(monkeypatch, rotary, norm.rms_norm(x, weight, 1e-6), cos, sin)
    with monkeypatch.context() as m:
        m.setattr(rope, "_native", None)
        assert (rotary.apply(x, cos, sin, norm=weight, eps=1e-6) - want).abs().max() <= 1e-6
    assert torch.equal(rotary.apply(x, cos, sin, out=x, norm=weight, eps=1e-6), want)


def test_the_fused_residual_add_and_norm_gives_the_add_then_norm_bits(monkeypatch, gen):
    h, delta = torch.randn(5, 80, generator=gen), torch.randn(5, 80, generator=gen)
    weight = torch.rand(80, generator=gen)
    want_h = h + delta
    want = norm.rms_norm(want_h, weight, 1e-5)
    got_h, got = norm.add_rms_norm(h.clone(), delta, weight, 1e-5)
    assert torch.equal(got_h, want_h) and torch.equal(got, want)
    with monkeypatch.context() as m:  # torch's path: a new h, the caller's left as it was
        m.setattr(norm, "_native", None)
        before = h.clone()
        got_h, got = norm.add_rms_norm(h, delta, weight, 1e-5)
        assert torch.equal(h, before) and torch.equal(got_h, want_h)
        assert (got - want).abs().max() <= 1e-5
    first_h, first = norm.add_rms_norm(h, None, weight, 1e-5)
    assert first_h is h and torch.equal(first, norm.rms_norm(h, weight, 1e-5))


def grouped_masks(t, s, gen):
    causal = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    window = causal & (torch.arange(s)[None, :] > torch.arange(s - t, s)[:, None] - 5)
    scattered = (torch.rand(t, s, generator=gen) < 0.5) | causal.flip(1)  # every row sees something
    return causal, window, scattered


@pytest.mark.parametrize("heads,kv_heads,t,s,head_stride", [(16, 4, 1, 40, 64), (8, 8, 3, 17, 64), (6, 2, 16, 300, 64),
                                                             (8, 1, 1, 33, 64), (4, 2, 2, 20, 72), (8, 2, 40, 60, 64)])
def test_native_attention_matches_torchs(gen, heads, kv_heads, t, s, head_stride):
    """Query heads side by side in a projection's output (or head_stride apart); one key/value head's
    group split across the threads where there are fewer groups than threads."""
    pool = shared_pool(2)
    fused = torch.randn(t, (heads + 1) * head_stride, generator=gen)
    q = fused[:, :heads * head_stride].view(t, heads, head_stride)[..., :64]
    k, v = torch.randn(s, kv_heads, 64, generator=gen), torch.randn(s, kv_heads, 48, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    for mask in grouped_masks(t, s, gen):
        want = attention._attend_grouped(q, k, v, mask, 0.125)
        got = attention._attend(q, k, v, mask, 0.125, pool)
        assert got.shape == want.shape == (t, heads * 48)
        assert (got - want).abs().max().item() <= 1e-5
        want = attention._attend_with_sinks(q, k, v, mask, 0.125, sinks)  # no pool: torch's
        got = attention._attend_with_sinks(q, k, v, mask, 0.125, sinks, pool)
        assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("t,s", [(1, 300), (3, 40)])
def test_native_attention_with_a_second_key_part_equals_the_keys_joined(gen, t, s):
    """Absorbed MLA's call: one key/value head (the latent) for all the query heads, and the rotary
    keys as a second part of each key; the same as the parts joined into one key."""
    pool, heads = shared_pool(2), 16
    q, q2 = torch.randn(t, heads, 64, generator=gen), torch.randn(t, heads, 16, generator=gen)
    latent, k2 = torch.randn(s, 1, 64, generator=gen), torch.randn(s, 1, 16, generator=gen)
    for mask in grouped_masks(t, s, gen):
        want = attention._attend_grouped(torch.cat((q, q2), -1), torch.cat((latent, k2), -1), latent, mask, 0.1)
        got = attention._native_attend(q, latent, latent, mask, 0.1, None, pool, q2, k2)
        assert got.shape == want.shape == (t, heads * 64)
        assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("t,s", [(1, 300), (3, 40)])
def test_native_absorbed_attention_folds_each_heads_query_and_output_matrices(gen, t, s):
    """Absorbed MLA in one call: each head's query is its nope part times its [N, C] matrix, its output
    its [V, C] matrix times its weighted latents; against the same in torch."""
    pool, heads = shared_pool(2), 16
    fused = torch.randn(t, heads, 24 + 16, generator=gen)  # the projection's nope and rotary parts side by side
    q_nope, q2 = fused[..., :24], fused[..., 24:]
    w_q, w_o = torch.randn(heads, 24, 64, generator=gen), torch.randn(heads, 20, 64, generator=gen)
    latent, k2 = torch.randn(s, 1, 64, generator=gen), torch.randn(s, 1, 16, generator=gen)
    for mask in grouped_masks(t, s, gen):
        q = torch.einsum("thn,hnc->thc", q_nope, w_q)
        weighed = attention._attend_grouped(torch.cat((q, q2), -1), torch.cat((latent, k2), -1), latent, mask, 0.1)
        want = torch.einsum("thc,hvc->thv", weighed.view(t, heads, 64), w_o).reshape(t, -1)
        got = attention._native_attend(q_nope, latent, latent, mask, 0.1, None, pool, q2, k2, w_q, w_o)
        assert got.shape == want.shape == (t, heads * 20)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_native_attention_gives_a_head_the_same_bits_whichever_heads_share_its_task(gen):
    """A group's heads go to one task or are split across tasks by the pool's size and the token count."""
    q, k, v = torch.randn(3, 8, 64, generator=gen), torch.randn(50, 1, 64, generator=gen), torch.randn(50, 1, 64, generator=gen)
    mask = torch.ones(3, 50, dtype=torch.bool)
    outs = [attention._attend(q[:n], k, v, mask[:n], 0.125, pool) for n in (1, 3)
            for pool in (tandem_native.ThreadPool(1), tandem_native.ThreadPool(4))]
    assert all(torch.equal(o[:1], outs[0]) for o in outs)


def test_a_prompt_token_gets_the_same_attention_bits_in_whichever_chunk_it_arrives(gen):
    """Chunked prefill: a 40-token prompt at once, or as 24 + 3 + 13 tokens (chunks on both sides of
    the decode-sized limit) over the cache filled so far, gives each token the same bits."""
    s = 40
    q, k, v = torch.randn(s, 8, 64, generator=gen), torch.randn(s, 2, 64, generator=gen), torch.randn(s, 2, 48, generator=gen)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    whole = attention._attend(q, k, v, causal, 0.125, shared_pool(2))
    for a, b in ((0, 24), (24, 27), (27, 40)):
        chunk = attention._attend(q[a:b], k[:b], v[:b], causal[a:b, :b], 0.125, shared_pool(2))
        assert torch.equal(chunk, whole[a:b])


def test_attention_stays_in_torch_where_native_does_not_apply(gen):
    """bfloat16 or no pool: torch's path, whose result is the same function."""
    pool, s = shared_pool(2), 40
    q, k, v = (torch.randn(1, 4, 32, generator=gen), torch.randn(s, 2, 32, generator=gen), torch.randn(s, 2, 32, generator=gen))
    mask = torch.ones(1, s, dtype=torch.bool)
    assert attention._native_attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.1, None, pool) is None
    assert attention._native_attend(q, k, v, mask, 0.1, None, None) is None


def test_an_exact_linear_gives_each_row_the_same_bits_in_any_batch(gen):
    pool = shared_pool(2)
    w, b = torch.randn(70, 300, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(37, 300, generator=gen)
    exact, reference = ExactLinear(w, b, pool), Linear(w.double(), b.double())
    batch = exact(x)
    assert batch.dtype == torch.float32 and batch.shape == (37, 70)
    assert (batch.double() - reference(x.double())).abs().max().item() <= 1e-4
    for rows in (slice(0, 1), slice(5, 9), slice(20, 37)):
        assert torch.equal(exact(x[rows]), batch[rows])
    assert torch.equal(ExactLinear(w, None, pool)(x) + b, batch)  # the bias added last, once


def test_the_native_ops_refuse_bad_arguments():
    pool = shared_pool(1)
    f32 = lambda *shape: torch.zeros(shape).numpy()  # noqa: E731
    mask = torch.ones(1, 4, dtype=torch.bool).numpy()
    with pytest.raises(ValueError, match="k heads|key heads"):
        tandem_native.attend(f32(1, 6, 8), f32(4, 4, 8), f32(4, 4, 8), mask, 1.0, None, f32(1, 48), pool)
    with pytest.raises(ValueError, match="mask"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask[:, :3], 1.0, None, f32(1, 32), pool)
    with pytest.raises(ValueError, match="sinks"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, f32(3), f32(1, 32), pool)
    with pytest.raises(ValueError, match="out"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 31), pool)
    with pytest.raises(ValueError, match="both or neither"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 32), pool, f32(1, 4, 2))
    with pytest.raises(ValueError, match="q2"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 32), pool, f32(1, 3, 2),
                             f32(4, 2, 2))
    with pytest.raises(ValueError, match="k2"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 32), pool, f32(1, 4, 2),
                             f32(4, 2, 3))
    with pytest.raises(ValueError, match="q_up"):
        tandem_native.attend(f32(1, 4, 6), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 32), pool, None, None,
                             f32(4, 5, 8))
    with pytest.raises(ValueError, match="v_up"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 12), pool, None, None,
                             None, f32(4, 3, 7))
    with pytest.raises(ValueError, match="out"):
        tandem_native.attend(f32(1, 4, 8), f32(4, 2, 8), f32(4, 2, 8), mask, 1.0, None, f32(1, 32), pool, None, None,
                             None, f32(4, 3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        tandem_native.rope(f32(2, 3, 8)[:, :, ::2], f32(2, 2), f32(2, 2), False, f32(2, 3, 4))
    with pytest.raises(ValueError, match="angles"):
        tandem_native.rope(f32(2, 3, 8), f32(2, 5), f32(2, 5), False, f32(2, 3, 8))
    with pytest.raises(ValueError, match="norm"):
        tandem_native.rope(f32(2, 3, 8), f32(2, 4), f32(2, 4), False, f32(2, 3, 8), f32(4), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        tandem_native.add_rms_norm(f32(2, 8), f32(2, 7), f32(8), 1e-6, f32(2, 8))
    with pytest.raises(ValueError, match="eps"):
        tandem_native.add_rms_norm(f32(2, 8), f32(2, 8), f32(8), -1.0, f32(2, 8))
    with pytest.raises(ValueError, match="weight"):
        tandem_native.linear_f32(f32(2, 8), f32(3, 9), None, f32(2, 3), pool)
    with pytest.raises(ValueError, match="bias"):
        tandem_native.linear_f32(f32(2, 8), f32(3, 8), f32(4), f32(2, 3), pool)


@pytest.mark.parametrize("normalize,scale", [(True, 1.0), (False, 2.5)])
def test_native_softmax_topk_routes_as_torch(monkeypatch, gen, normalize, scale):
    from services.common.model_config import RouterConfig
    from services.dense.moe import router

    cfg = RouterConfig(method="softmax_topk", top_k=8, norm_topk_prob=normalize, routed_scaling_factor=scale,
                       num_experts=64)
    logits = torch.randn(9, 64, generator=gen) * 3
    logits[4, 10] = logits[4, 3] = 20.0  # a tie at the top goes to the lower id first
    ids, weights = router.route(cfg, logits)
    with monkeypatch.context() as m:
        m.setattr(router, "_native", None)
        want_ids, want_weights = router.route(cfg, logits)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert torch.allclose(weights.gather(1, ids.argsort(-1)), want_weights.gather(1, want_ids.argsort(-1)),
                          rtol=1e-5, atol=1e-7)
    assert ids[4, :2].tolist() == [3, 10]


def test_native_routing_refuses_a_bad_k():
    logits = torch.zeros(2, 4).numpy()
    with pytest.raises(ValueError, match="k"):
        tandem_native.route_softmax_topk(logits, 5, True, 1.0, torch.zeros(2, 5, dtype=torch.int64).numpy(),
                                         torch.zeros(2, 5).numpy())


@pytest.mark.parametrize("isa", tandem_native.supported_isas())
@pytest.mark.parametrize("cols", [131, 300, 301])  # no multiple of 8 or 16: 3, 4 and 5 columns past the last 8
def test_every_variants_exact_linear_agrees_with_generic_and_with_itself_in_any_batch(gen, isa, cols):
    pool = shared_pool(2)
    x, w = torch.randn(13, cols, generator=gen), torch.randn(37, cols, generator=gen)
    out = lambda rows, variant: _linear_f32(x[rows], w, pool, variant)  # noqa: E731
    whole = out(slice(None), isa)
    assert (whole - out(slice(None), "generic")).abs().max().item() <= 1e-4
    for rows in (slice(0, 1), slice(3, 6), slice(4, 13)):
        assert torch.equal(out(rows, isa), whole[rows])


def _linear_f32(x, w, pool, isa):
    y = torch.empty(x.shape[0], w.shape[0])
    tandem_native.linear_f32(x.contiguous().numpy(), w.numpy(), None, y.numpy(), pool, isa)
    return y
