"""`tandem serve` end to end: three real processes on free ports, the same greedy text through the
gateway as the in-process reference, and Ctrl-C stopping everything."""

import os
import re

import pytest

from gateway.chat_template import render
from services.dense.generate import generate
from services.dense.loader import load_model, open_checkpoint
from services.dense.runtime import DenseRuntime
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.random_model import random_model
from tests.services.launcher.launch import serve

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "Tell me about experts."}]


def reference_text(path, fmt: str, max_tokens: int) -> str:
    """In process, with the dense format `tandem serve` picks on this machine (float32 activations)."""
    from services.dense.moe.native import NativeExperts
    from services.launcher.__main__ import machine_defaults

    tok = Tokenizer(path)
    prompt = tok.encode(render(tok.chat_template, MESSAGES, "<|bos|>", "<|eos|>"), add_special_tokens=False)
    ckpt, cfg = open_checkpoint(path)
    runtime = DenseRuntime("float32", "cpu", machine_defaults().dense_format, threads=2)
    model, _ = load_model(path, runtime, NativeExperts(cfg, ckpt, fmt, threads=2))
    return generate(model, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), tok.eos_token_ids, tok).text


def test_tandem_serve_answers_like_the_in_process_reference_and_stops_cleanly():
    path = random_model()
    with serve("--model", str(path), "--format", "int8", "--dtype", "float32", "--threads", "2") as run:
        assert any(f"curl http://127.0.0.1:{run.port}/v1/chat/completions" in x for x in run.lines)
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        assert client.models.list().data[0].id == path.name
        reply = client.chat.completions.create(model=path.name, messages=MESSAGES, max_tokens=20, temperature=0)
        assert reply.choices[0].message.content == reference_text(path, "int8", 20)
        pids = [int(m.group(1)) for x in run.lines for m in [re.search(r"pid (\d+)", x)] if m]
    assert run.code == 0, "".join(run.lines[-30:])
    assert any("expert stopped (code 0)" in x for x in run.lines) and any("dense stopped (code 0)" in x for x in run.lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "gpt_oss"])
def test_tandem_serve_serves_the_newer_families_with_their_chat_template(family):
    from tests.checkpoints import checkpoint

    path = checkpoint(family)
    with serve("--model", str(path), "--format", "bf16", "--dtype", "float32", "--threads", "2") as run:
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=path.name, messages=MESSAGES, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == reference_text(path, "bf16", 12)
    assert run.code == 0, "".join(run.lines[-30:])


def test_tandem_serve_serves_a_gguf_alone_under_its_file_name():
    from services.common.checkpoint import resolve_model
    from tests.gguf_files import gguf_model

    path = gguf_model("deepseek_v3", "Q4_1")
    with serve("--model", str(path), "--format", "int4_asym", "--dtype", "float32", "--threads", "2") as run:
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        assert client.models.list().data[0].id == path.stem
        reply = client.chat.completions.create(model=path.stem, messages=MESSAGES, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == reference_text(resolve_model(path), "int4_asym", 12)
    assert run.code == 0, "".join(run.lines[-30:])
