"""A decode step's layer in one native call (services/dense/models/native_layer.py): the bits of the
pieces called one by one, over a sequence's own cache and the service's paged cache, and clear
errors for bad arguments."""

import pytest
import torch

from services.dense.kv_cache import BlockPool, PagedSequence
from services.dense.models.decoder import Chunk
from services.dense.models.native_layer import NativeLayer, _packed
from services.dense.moe.block import MoeBlock
from services.dense.pool import shared_pool
from tests.services.dense.test_dense_formats import TOKENS, packed_model

tandem_native = pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native


class Counting:
    """Wraps a layer's NativeLayer, counting the calls it took on (not None)."""

    def __init__(self, native):
        self.native, self.taken = native, 0

    def __call__(self, *args):
        out = self.native(*args)
        self.taken += out is not None
        return out


def set_native(model, natives):
    for layer, native in zip(model.layers, natives):
        layer.native = native


def greedy(model, caches, steps):
    """Prompts of different lengths, then greedy steps, all sequences in each step -> logits stacked."""
    chunks = [Chunk(TOKENS[:n], cache) for n, cache in zip((20, 7, 13)[:len(caches)], caches)]
    out = [model.forward_batch(chunks, [sum(len(c.tokens) for c in chunks[:i + 1]) - 1 for i in range(len(chunks))])]
    for _ in range(steps):
        chunks = [Chunk(row.argmax(-1, keepdim=True), c.cache) for row, c in zip(out[-1], chunks)]
        out.append(model.forward_batch(chunks, list(range(len(chunks)))))
    return torch.stack(out)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_a_decode_step_in_one_native_call_a_layer_gives_the_bits_of_the_pieces(family_checkpoint, fmt):
    name, path = family_checkpoint
    model = packed_model(path, fmt)
    natives = [layer.native for layer in model.layers]
    mla, whole_norm = model.cfg.attention.kind == "mla", model.cfg.attention.qk_norm == "all"
    if mla or whole_norm:  # absorbed MLA and a norm over the whole projection stay piece by piece
        assert natives == [None] * len(natives)
        return
    assert all(isinstance(n, NativeLayer) for n in natives)
    router = model.cfg.moe.router
    routes = [router.top_k if isinstance(layer.mlp, MoeBlock) and router.method == "softmax_topk" else 0
              for layer in model.layers]
    assert [n.top_k for n in natives] == routes  # the call routes too where the router is softmax then top-k
    counting = [Counting(n) for n in natives]
    set_native(model, counting)
    fused = greedy(model, [model.new_cache(64), model.new_cache(64)], 4)
    assert all(c.taken == 4 for c in counting)  # the decode steps, not the prompt step
    set_native(model, [None] * len(natives))
    assert torch.equal(fused, greedy(model, [model.new_cache(64), model.new_cache(64)], 4))


def test_the_paged_cache_takes_the_native_call_whether_a_sequence_is_one_run_of_blocks_or_not():
    """Two sequences in the service's paged cache: the first's blocks stop being one run when the
    second takes the block after them (at step 5), and the native call goes on through its block
    table, with the bits of the pieces (which gather the cache by it) all along."""
    from tests.checkpoints import checkpoint

    model = packed_model(checkpoint("qwen3_moe"), "int8")
    natives = [Counting(layer.native) for layer in model.layers]

    def run(native):
        set_native(model, native)
        pool = BlockPool(model.cfg, 16, 8, torch.float32, torch.device("cpu"))
        first, second = PagedSequence(pool), PagedSequence(pool)
        logits = greedy(model, [first, second], 6)
        return logits, first.base, second.base

    fused, first_base, second_base = run(natives)
    assert first_base is None and second_base is not None
    assert natives[0].taken == 6
    assert torch.equal(fused, run([None] * len(natives))[0])


def test_a_native_layer_refuses_bad_arguments():
    from tests.checkpoints import checkpoint

    model = packed_model(checkpoint("qwen3_moe"), "int8")
    layer = model.layers[0].native
    pool, d = shared_pool(1), model.cfg.hidden_size
    a = model.cfg.attention
    h, x = torch.zeros(1, d), torch.zeros(1, d)
    cos = torch.zeros(1, a.head_dim // 2)  # and sin
    k = v = torch.zeros(8, a.num_kv_heads, a.head_dim)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logits = torch.zeros(1, layer.experts)
    ids, weights = torch.zeros(1, layer.top_k, dtype=torch.int64), torch.zeros(1, layer.top_k)

    def call(h=h, cos=cos, seqs=None, logits=logits, ids=ids):
        seqs = [(0, 1, k.numpy(), v.numpy(), 0, 2, mask.numpy(), None)] if seqs is None else seqs
        layer.native.forward(h.numpy(), None, cos.numpy(), cos.numpy(), seqs, x.numpy(),
                             None if logits is None else logits.numpy(), None if ids is None else ids.numpy(),
                             weights.numpy(), pool)

    call()  # the arguments below differ from these in one place each
    with pytest.raises(ValueError, match="h"):
        call(h=torch.zeros(1, d + 1))
    with pytest.raises(ValueError, match="angles"):
        call(cos=torch.zeros(1, a.head_dim))
    with pytest.raises(ValueError, match="logits"):
        call(logits=None)
    with pytest.raises(ValueError, match="ids"):
        call(ids=None)
    with pytest.raises(ValueError, match="ids"):
        call(ids=torch.zeros(1, layer.top_k + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache rows"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 6, 2, mask.numpy(), None)])
    with pytest.raises(ValueError, match="mask"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 0, 3, mask.numpy(), None)])
    with pytest.raises(ValueError, match="slots"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 0, 2, mask.numpy(), torch.tensor([3, 8, 1]).numpy())])
    with pytest.raises(ValueError, match="slots"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 0, 2, mask.numpy(), torch.tensor([3]).numpy())])
    with pytest.raises(ValueError, match="slots"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 0, 2, mask.numpy(), torch.tensor([3, 4, 5], dtype=torch.int32).numpy())])
    with pytest.raises(ValueError, match="8|slots"):
        call(seqs=[(0, 1, k.numpy(), v.numpy(), 0, 2, mask.numpy())])
    with pytest.raises(ValueError, match="cover"):
        call(seqs=[])
    with pytest.raises(ValueError, match="k"):
        call(seqs=[(0, 1, torch.zeros(8, a.num_kv_heads + 1, a.head_dim).numpy(), v.numpy(), 0, 2, mask.numpy(), None)])
    with pytest.raises(ValueError, match="qkv"):
        tandem_native.DecodeLayer(torch.ones(d).numpy(), torch.ones(d).numpy(), 1e-6, [], [], a.num_heads,
                                  a.num_kv_heads, a.head_dim, None, None, False, 1.0, None, None, None, [])
    attention = model.layers[0].attention
    qkv, o = _packed(attention.qkv_proj), _packed(attention.o_proj)
    with pytest.raises(ValueError, match="top_k"):
        tandem_native.DecodeLayer(torch.ones(d).numpy(), torch.ones(d).numpy(), 1e-6, list(qkv), list(o),
                                  a.num_heads, a.num_kv_heads, a.head_dim, None, None, False, 1.0, None,
                                  torch.zeros(4, d).numpy(), None, [*qkv, *o], 5)
