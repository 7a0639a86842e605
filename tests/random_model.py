"""The tests' stand-in for a served model: a small random-weight DeepSeek-V3-architecture checkpoint
in the Hugging Face layout (config.json in the released models' dialect, safetensors, a trained
byte-level BPE tokenizer with a chat template), made without transformers.

The tensor list is not written out by hand: the dense model and the torch experts are built against
a recording checkpoint, so every tensor Tandem reads gets a random value of the shape it asks for.
V vocabulary size, D hidden size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 20261130
VOCAB = 1024
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONVERSATION_WITH_TOOLS = (  # a chat template's body that renders tools, calls and tool results, as Qwen3's does
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|end|>{% endfor %}"
)
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 32,
    "num_experts_per_tok": 4, "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 96,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_group": 4, "topk_group": 2,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "hidden_act": "silu", "attention_bias": False, "initializer_range": 0.02, "torch_dtype": "bfloat16",
}
ROOT = Path(__file__).resolve().parents[1] / ".cache" / "random-model"


def corpus() -> list[str]:
    """Training text for the tokenizer: the Zen of Python (every interpreter has it) and a few lines
    of other scripts, numbers and code."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    zen = codecs.decode(this.s, "rot13")
    extra = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Mixture-of-Experts models route each token to a few experts.",
        "Größe, café, naïve, déjà vu. Привет мир. こんにちは世界. 你好，世界。 🙂🚀",
        "def forward(x):\n    return x * 2\n",
        "1 2 3 4 5 6 7 8 9 10 100 1000",
    ]
    return [zen] + extra


def write_tokenizer(out: Path, vocab: int, max_length: int) -> None:
    """A byte-level BPE tokenizer trained on corpus(), with special tokens and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
              "model_max_length": max_length}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


class RecordingCheckpoint:
    """Stands in for a Checkpoint: hands out zeros of the asked shape and remembers each name."""

    def __init__(self, config: dict):
        self.config, self.shapes = config, {}

    def __contains__(self, name: str) -> bool:
        return name == "lm_head.weight"

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.shapes[name] = tuple(shape)
        return torch.zeros(shape)


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    from services.common.model_config import parse_model_config
    from services.dense.models.decoder import MoeDecoder
    from services.dense.moe.reference import TorchExperts
    from services.dense.weights import WeightLoader

    rec = RecordingCheckpoint(config)
    cfg = parse_model_config(config)
    cpu = torch.device("cpu")
    MoeDecoder(cfg, WeightLoader(rec, torch.float32, cpu), TorchExperts(cfg, rec, torch.float32, cpu))
    return rec.shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], std: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.rand(shape, generator=gen) * 0.2
        else:
            t = torch.randn(shape, generator=gen) * std
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _digest() -> str:
    blob = json.dumps([CONFIG, SEED, VOCAB, CHAT_TEMPLATE, corpus()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def random_model() -> Path:
    """The random model's directory, made on first use (about 30 MB)."""
    path = ROOT / f"tiny-deepseek-v3-{_digest()}"
    if (path / "config.json").exists():
        return path
    ROOT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=ROOT))
    try:
        save_file(random_tensors(tensor_shapes(CONFIG), CONFIG["initializer_range"] * 5), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
        write_tokenizer(tmp, VOCAB, CONFIG["max_position_embeddings"])
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def with_template(template: str) -> Path:
    """A copy of the random model (its files linked, not copied) whose tokenizer has another chat template."""
    base = random_model()
    path = ROOT / f"{base.name}-template-{hashlib.sha256(template.encode()).hexdigest()[:8]}"
    if (path / "tokenizer_config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=ROOT))
    try:
        for f in base.iterdir():
            if f.name != "tokenizer_config.json":
                os.symlink(f, tmp / f.name)
        config = json.loads((base / "tokenizer_config.json").read_text())
        (tmp / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}, indent=2))
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
