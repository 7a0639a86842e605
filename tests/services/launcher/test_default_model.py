"""The built-in default model is a real Hugging Face checkpoint: transformers reads it and agrees."""

import torch

from services.dense.tokenizer import Tokenizer
from services.launcher.default_model import default_model
from tests.conftest import PROMPT, load_fp32
from tests.reference.hf_oracle import hf_logits


def test_default_model_matches_transformers_and_has_a_chat_template():
    path = default_model()
    tok = Tokenizer(path)
    ids = tok.encode(PROMPT)
    model, _ = load_fp32(path)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    ref = hf_logits(path, ids)
    assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert tok.chat_template and tok.eos_token_ids == (1,)


def test_default_model_is_made_once():
    assert default_model() == default_model()
