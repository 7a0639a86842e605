"""`tandem serve` end to end: three real processes on free ports, the same greedy text through the
gateway as the in-process reference, and Ctrl-C stopping everything."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from gateway.chat_template import render
from services.dense.generate import generate
from services.dense.loader import open_checkpoint
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from services.launcher.default_model import default_model
from tests.conftest import load_fp32
from tests.expert_server.servers import ROOT

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

MESSAGES = [{"role": "user", "content": "Tell me about experts."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_text(path, fmt: str, max_tokens: int) -> str:
    from services.dense.moe.native import NativeExperts

    tok = Tokenizer(path)
    prompt = tok.encode(render(tok.chat_template, MESSAGES, "<|bos|>", "<|eos|>"), add_special_tokens=False)
    ckpt, cfg = open_checkpoint(path)
    model, _ = load_fp32(path, NativeExperts(cfg, ckpt, fmt, threads=2))
    return generate(model, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), tok.eos_token_ids, tok).text


def test_tandem_serve_answers_like_the_in_process_reference_and_stops_cleanly():
    path, port = default_model(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher", "serve", "--port", str(port),
                             "--format", "int8", "--dtype", "float32", "--threads", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "tandem: ready at" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300), "".join(lines[-30:])
        assert any("curl http://127.0.0.1:%d/v1/chat/completions" % port in x for x in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "tandem-default"
        reply = client.chat.completions.create(model="tandem-default", messages=MESSAGES, max_tokens=20, temperature=0)
        assert reply.choices[0].message.content == reference_text(path, "int8", 20)
        pids = [int(m.group(1)) for x in lines for m in [re.search(r"pid (\d+)", x)] if m]
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    assert code == 0, "".join(lines[-30:])
    assert any("expert stopped (code 0)" in x for x in lines) and any("dense stopped (code 0)" in x for x in lines)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
