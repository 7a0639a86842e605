"""`tandem serve` heals itself: a child killed under a stream (SIGKILL) ends that stream with an
error frame, /health answers 503 and then 200 again once the launcher has restarted the child on
its port, new requests succeed, and nothing is left over at the end; past --max-restarts the
launcher stops, non-zero, naming the child."""

import os
import re
import signal
import time

import httpx
import pytest

from services.common.shm_layout import NAME_PREFIX, SHM_DIR
from tests.random_model import random_model
from tests.services.launcher.launch import serve

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

PATH = random_model()
ARGS = ("--model", str(PATH), "--format", "int8", "--dtype", "float32", "--threads", "2")
MESSAGES = [{"role": "user", "content": "Tell me about experts."}]


def pids(run, name: str) -> list[int]:
    return [int(m.group(1)) for x in list(run.lines) for m in [re.search(rf"tandem: {name} started \(pid (\d+)\)", x)]
            if m]


def health(run) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{run.port}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def waited(check, timeout: float) -> float:
    """Seconds until check() held (polled every 50 ms); fails after timeout."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def killed_under_a_stream(run, pid: int) -> list[str]:
    """Starts a long stream, kills pid after its first token, returns the stream's remaining lines."""
    body = {"model": PATH.name, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{run.port}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if '"content"' in line and '"content":""' not in line.replace(" ", ""):
                break
        os.kill(pid, signal.SIGKILL)
        return list(lines)


def ours_in_shm() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)}


@pytest.mark.parametrize("name", ["expert", "dense"])
def test_a_killed_child_is_restarted_on_its_port_and_the_stack_heals(name):
    segments = ours_in_shm()
    with serve(*ARGS) as run:
        client = openai.OpenAI(base_url=run.url, api_key="none", max_retries=0)
        before = client.chat.completions.create(model=PATH.name, messages=MESSAGES, max_tokens=8, temperature=0)
        victim = pids(run, name)[-1]
        rest = killed_under_a_stream(run, victim)
        assert any(x.startswith("data:") and '"error"' in x for x in rest), rest[-3:]
        waited(lambda: health(run) == 503, 30)
        healed = waited(lambda: health(run) == 200, 60)
        assert healed < 60
        after = client.chat.completions.create(model=PATH.name, messages=MESSAGES, max_tokens=8, temperature=0)
        assert after.choices[0].message.content == before.choices[0].message.content
        assert any(f"tandem: {name} exited with code -9; restarting it" in x for x in run.lines)
        assert pids(run, name)[-1] != victim
        every = pids(run, "expert") + pids(run, "dense") + pids(run, "gateway")
    assert run.code == 0, "".join(run.lines[-30:])
    for pid in every:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert ours_in_shm() <= segments


def test_past_the_restart_limit_the_launcher_stops_non_zero_naming_the_child():
    segments = ours_in_shm()
    with serve(*ARGS, "--max-restarts", "1") as run:
        os.kill(pids(run, "expert")[-1], signal.SIGKILL)
        waited(lambda: any("tandem: expert is back" in x for x in run.lines), 120)
        os.kill(pids(run, "expert")[-1], signal.SIGKILL)
        assert run.proc.wait(120) != 0
        every = pids(run, "expert") + pids(run, "dense") + pids(run, "gateway")
    assert any("expert exited with code -9 after 1 restarts" in x and "stopping" in x for x in run.lines)
    for pid in every:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert ours_in_shm() <= segments
