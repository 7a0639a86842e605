"""The in-process native backend runs whole models: greedy tokens equal the torch reference's."""

import pytest
import torch

from services.common.expert_weights import load_expert_stacks
from services.dense.generate import generate
from services.dense.loader import open_checkpoint
from services.dense.moe.reference import TorchExperts
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import checkpoint
from tests.conftest import load_fp32

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native


class Bf16RoundedReference(TorchExperts):
    """The torch reference fed the same bf16-rounded expert weights the native bf16 format holds."""

    def __init__(self, cfg, checkpoint):
        super().__init__(cfg, checkpoint, torch.float32, torch.device("cpu"))
        for layer in self.stacks:
            s = load_expert_stacks(checkpoint, cfg, layer)  # weights rounded as bf16 packs them, biases kept in fp32
            self.stacks[layer] = (s.w13.bfloat16().float(), s.w2.bfloat16().float(), s.b13, s.b2)


def test_native_bf16_greedy_generation_matches_the_reference(family_checkpoint, prompt_ids):
    from services.dense.moe.native import NativeExperts

    _, path = family_checkpoint
    checkpoint, cfg = open_checkpoint(path)
    eos = Tokenizer(path).eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=32)
    native, _ = load_fp32(path, NativeExperts(cfg, checkpoint, "bf16", threads=2))
    reference, _ = load_fp32(path, Bf16RoundedReference(cfg, checkpoint))
    ours = generate(native, prompt_ids, params, eos).tokens
    assert ours == generate(reference, prompt_ids, params, eos).tokens
    assert len(ours) > 1


def test_quantized_formats_run_a_model_with_error_growing_as_bits_shrink():
    from services.dense.moe.native import NativeExperts

    path = checkpoint("deepseek_v3")
    checkpoint_, cfg = open_checkpoint(path)
    exact, _ = load_fp32(path)
    tokens = torch.arange(10, 40)
    ref = exact.forward(tokens, exact.new_cache(len(tokens)))
    errors, agreement = {}, {}
    for fmt in ("bf16", "int8", "int4"):
        model, _ = load_fp32(path, NativeExperts(cfg, checkpoint_, fmt, threads=2))
        logits = model.forward(tokens, model.new_cache(len(tokens)))
        errors[fmt] = ((logits - ref).norm() / ref.norm()).item()
        agreement[fmt] = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert errors["bf16"] < 0.01 < errors["int8"] < errors["int4"] < 0.5, errors
    assert agreement["bf16"] == 1.0 and agreement["int8"] >= 0.9, agreement
