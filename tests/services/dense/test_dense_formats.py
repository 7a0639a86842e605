"""Dense linears in packed formats (--dense-format), computed by the native kernels: every family
against the float reference, stored codes imported as they are, batched == alone."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.common.checkpoint import Checkpoint, resolve_model
from services.common.model_config import parse_model_config
from services.dense.generate import generate
from services.dense.loader import load_model, open_checkpoint
from services.dense.models.decoder import MoeDecoder
from services.dense.moe.reference import TorchExperts
from services.dense.runtime import DenseRuntime
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from services.dense.weights import Linear, PackedLinear, WeightLoader
from tests.conftest import load_fp32
from tests.gguf_files import gguf_model, gguf_reference
from tests.services.dense.test_engine import SHAPES, assert_batched_equals_alone, native

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

TOKENS = torch.arange(10, 50)


def packed_model(path, fmt, experts=None):
    return load_model(path, DenseRuntime("float32", "cpu", fmt, threads=2), experts)[0]


class Bf16RoundedLoader(WeightLoader):
    """The float32 reference fed the bf16-rounded linears the bf16 dense format holds."""

    def linears(self, prefixes, outs, in_features, bias=False, fmt=None):
        lin = super().linears(prefixes, outs, in_features, bias, fmt)
        return Linear(lin.weight.bfloat16().float(), lin.bias)


def rounded_reference(path):
    checkpoint, cfg = open_checkpoint(path)
    experts = TorchExperts(cfg, checkpoint, torch.float32, torch.device("cpu"))
    return MoeDecoder(cfg, Bf16RoundedLoader(checkpoint, torch.float32, torch.device("cpu")), experts)


def logits(model):
    return model.forward(TOKENS, model.new_cache(len(TOKENS)))


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_bf16_dense_weights_give_the_float_reference_on_bf16_rounded_weights(family_checkpoint, prompt_ids):
    """bf16 dense linears take float32 activations: what is left is the weights' rounding, which
    the reference fed the same rounded weights shares (greedy tokens identical, logits within 1e-4)."""
    _, path = family_checkpoint
    ours, reference = packed_model(path, "bf16"), rounded_reference(path)
    assert relative(logits(ours), logits(reference)) <= 1e-4
    eos = Tokenizer(path).eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=32)
    assert generate(ours, prompt_ids, params, eos).tokens == generate(reference, prompt_ids, params, eos).tokens


def test_int8_dense_weights_stay_near_the_float_reference(family_checkpoint):
    """int8 weights with 8-bit activations: each linear is within 1% of its float product (see
    tests/native/test_linear.py), which the tiny random models amplify (a router choice flipped
    moves a whole token); bounds from the spread over every family (worst: 0.15 error, 0.85 of
    positions keep their argmax)."""
    _, path = family_checkpoint
    exact = logits(load_fp32(path)[0])
    ours = {fmt: logits(packed_model(path, fmt)) for fmt in ("bf16", "int8")}
    assert relative(ours["int8"], exact) <= 0.2
    assert (ours["int8"].argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.85


def test_dense_error_grows_as_bits_shrink():
    """Summed over every family (one tiny model's error swings with its router flips)."""
    from tests.checkpoints import FAMILY_CHECKPOINTS, checkpoint

    errors = dict.fromkeys(("bf16", "int8", "int4"), 0.0)
    for name in FAMILY_CHECKPOINTS:
        exact = logits(load_fp32(checkpoint(name))[0])
        for fmt in errors:
            errors[fmt] += relative(logits(packed_model(checkpoint(name), fmt)), exact) / len(FAMILY_CHECKPOINTS)
    assert errors["bf16"] < errors["int8"] < errors["int4"] < 0.5, errors


def test_every_dense_linear_is_packed_and_only_kv_b_stays_a_tensor(family_checkpoint):
    _, path = family_checkpoint
    model = packed_model(path, "int8")
    layer = model.layers[0]
    assert isinstance(model.lm_head, PackedLinear)
    attention = layer.attention
    if model.cfg.attention.kind == "mla":
        assert isinstance(attention.x_proj, PackedLinear) and isinstance(attention.kv_b_proj, Linear)
    else:
        assert all(isinstance(p, PackedLinear) for p in getattr(attention.qkv_proj, "parts", (attention.qkv_proj,)))
    assert isinstance(attention.o_proj, PackedLinear)


def test_a_4_bit_request_keeps_lm_head_in_int8_and_keys_and_values_too_with_8_experts_as_llama_cpp_does():
    """llama.cpp's 4-bit types keep output.weight in 6 or 8 bits, and give attn_k and attn_v Q8_0 in
    models of exactly 8 experts (llama-quant.cpp): mixtral's tiny checkpoint has 8, qwen3_moe's 16."""
    from tests.checkpoints import checkpoint

    model = packed_model(checkpoint("mixtral"), "int4")
    q, kv = model.layers[0].attention.qkv_proj.parts
    assert (q.packed.format, kv.packed.format, model.lm_head.packed.format) == ("int4", "int8", "int8")
    assert model.layers[0].attention.o_proj.packed.format == "int4"
    model = packed_model(checkpoint("qwen3_moe"), "int4")
    assert (model.layers[0].attention.qkv_proj.packed.format, model.lm_head.packed.format) == ("int4", "int8")


def test_an_int8_request_keeps_lm_head_keys_and_values_in_bf16():
    from tests.checkpoints import checkpoint

    model = packed_model(checkpoint("qwen3_moe"), "int8")
    q, kv = model.layers[0].attention.qkv_proj.parts
    assert (q.packed.format, kv.packed.format, model.lm_head.packed.format) == ("int8", "bf16", "bf16")
    assert model.layers[0].attention.o_proj.packed.format == "int8"


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_greedy_batched_equals_alone_for_every_dense_format(family_checkpoint, fmt):
    _, path = family_checkpoint
    model = packed_model(path, fmt, native(path, "int8"))
    assert_batched_equals_alone(model, path, [SamplingParams(temperature=0, max_tokens=m) for _, m in SHAPES])


@pytest.mark.parametrize("qtype, fmt, stored", [("Q8_0", "int8", "int8"), ("Q4_0", "int4", "int4"),
                                                ("Q4_1", "int4", "int4_asym")])
def test_stored_gguf_codes_import_into_dense_linears_bit_exact(qtype, fmt, stored):
    """A Q8_0 / Q4_0 / Q4_1 GGUF's attention and lm_head tensors keep their codes (Q4_1 as int4_asym
    under an int4 request): each packed linear's weights equal gguf-py's dequantization exactly."""
    path = resolve_model(gguf_model("qwen3_moe", qtype))
    ref = load_file(gguf_reference("qwen3_moe", qtype) / "model.safetensors")
    model = packed_model(path, fmt)
    attention = model.layers[0].attention
    parts = getattr(attention.qkv_proj, "parts", (attention.qkv_proj,))
    assert {p.packed.format for p in parts} == {stored}
    prefix = "model.layers.0.self_attn"
    want = torch.cat([ref[f"{prefix}.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
    assert np.array_equal(np.concatenate([p.packed.dequantize() for p in parts]), want.numpy())
    assert np.array_equal(attention.o_proj.packed.dequantize(), ref[f"{prefix}.o_proj.weight"].numpy())
    assert np.array_equal(model.lm_head.packed.dequantize(), ref["lm_head.weight"].numpy())


def test_packed_dense_weights_refuse_a_gpu_and_unknown_formats():
    from services.common.errors import ConfigError

    with pytest.raises(ConfigError, match="--dense-format"):
        DenseRuntime("float32", "cpu", "int3")
    with pytest.raises(ConfigError, match="--threads"):
        DenseRuntime("float32", "cpu", "int8", threads=0)


@pytest.mark.parametrize("dtype, prefill_threads", [("float32", 1), ("bfloat16", 2)])
def test_packed_steps_run_torch_on_one_thread_and_give_the_count_back(dtype, prefill_threads):
    """With packed linears a decode step's torch ops run on one thread (no torch worker spinning
    against the native pool's), and a prompt chunk's too where attention is native (float32); in
    bfloat16 torch attends to a prompt chunk on the process's threads. The process's own setting
    is back after each step."""
    from tests.checkpoints import checkpoint

    model = load_model(checkpoint("qwen3_moe"), DenseRuntime(dtype, "cpu", "int8", threads=2))[0]
    seen = []
    inner = model._forward_batch

    def spy(*args):
        seen.append(torch.get_num_threads())
        return inner(*args)

    model._forward_batch = spy
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = model.new_cache(40)
        model.forward(TOKENS[:30], cache)
        model.forward(TOKENS[30:31], cache)
        assert seen == [prefill_threads, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_dense_linears_and_the_in_process_experts_share_one_pool():
    """One pool however it is asked for: two would keep helpers spinning against each other."""
    from tests.checkpoints import checkpoint

    path = checkpoint("qwen3_moe")
    experts = native(path, "int8")
    model = packed_model(path, "int8", experts)
    assert model.lm_head.pool is experts.pool


def test_the_native_rms_norm_equals_torchs():
    from services.dense.layers.norm import rms_norm

    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 2048), (3, 16, 128), (5, 72)):
        x, w = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
        theirs = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert (rms_norm(x, w, 1e-6) - theirs).abs().max().item() <= 1e-5


class RecordingPool:
    def __init__(self):
        self.warmed = []

    def warm(self, address, nbytes):
        self.warmed.append((address, nbytes))


def decode_logits(model, steps):
    cache = model.new_cache(64)
    out = [model.forward(TOKENS[:20], cache, last_only=True)]
    for _ in range(steps):
        out.append(model.forward(out[-1].argmax(-1), cache, last_only=True))
    return torch.cat(out)


def test_a_decode_step_warms_each_packed_linear_as_the_one_before_it_returns(family_checkpoint):
    """The warm chain learns a decode step's order of packed linears from the first step; from then
    on each call asks the pool to read the next one's weights ahead (capped), prefill-sized calls
    never do, and the logits are the same bits as with the read-ahead left to a real pool. The
    layers are called piece by piece here (a native layer call runs its linears inside it, where the
    chain does not see them), and give the bits of the native layer calls."""
    from services.dense.weights import WARM_MAX_BYTES

    _, path = family_checkpoint
    warmed_for_real = decode_logits(packed_model(path, "int8"), 3)
    model = packed_model(path, "int8")
    for layer in model.layers:
        layer.native = None
    chain, called = model.lm_head.chain, []
    after = chain.after
    chain.after = lambda linear: (called.append(linear), after(linear))
    chain.pool = RecordingPool()
    model.forward(TOKENS[:20], model.new_cache(64))
    assert called == [] and chain.pool.warmed == []
    assert torch.equal(decode_logits(model, 3), warmed_for_real)
    assert called[0] is model.lm_head  # the prompt's last row
    called = called[1:]
    per_step = len(called) // 3
    step = called[:per_step]
    assert per_step >= 3 and called == step * 3 and step[-1] is model.lm_head
    upcoming = step[1:] + step[:1]  # each call's next: the step's later linears, then the next step's first
    want = [(a, min(n, WARM_MAX_BYTES)) for linear in upcoming for a, n in linear.ranges()]
    assert chain.pool.warmed[-2 * len(want):] == want * 2
