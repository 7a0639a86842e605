"""A real second host: the expert server in a network namespace of its own, behind a veth pair,
reached by the dense service over inline gRPC with TLS as across machines (on grpc++ and on grpcio). Cutting the link under a
stream ends it within the call's deadline with UNAVAILABLE, /health answers 503 and a new request a
503 (no hang, no other 5xx); bringing the link back heals the stack without a restart, and the
same greedy answer comes back. Needs root (CI runs as root) and iproute2's `ip`; skips otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from services.common.grpc_defaults import native_grpc
from services.dense.app import start
from services.dense.config import DenseConfig
from services.dense.moe.remote import RemoteConfig
from services.dense.runtime import DenseRuntime
from tests.expert_server.servers import Spawned
from tests.gateway.servers import gateway
from tests.random_model import random_model
from tests.waiting import wait_for

pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

DEADLINE_S = 30.0  # each expert call's deadline on the dense side
SUFFIX = f"{os.getpid() % 10000}"
NS, OUTSIDE, INSIDE = f"tandem-expert-{SUFFIX}", f"tdh{SUFFIX}", f"tdx{SUFFIX}"
NET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
HOST_IP, EXPERT_IP = f"{NET}.1", f"{NET}.2"
MESSAGES = [{"role": "user", "content": "Tell me about experts."}]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def why_no_namespace() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (make setup installs it where it runs as root)"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    return None


@pytest.fixture(scope="module")
def link():
    """The expert host's namespace, joined to this one by a veth pair; yields the host-side name."""
    reason = why_no_namespace()
    if reason:
        pytest.skip(reason)
    made = ip("netns", "add", NS)
    if made.returncode != 0:
        pytest.skip(f"ip netns add failed: {made.stderr.strip()}")
    try:
        steps = [("link", "add", OUTSIDE, "type", "veth", "peer", "name", INSIDE),
                 ("link", "set", INSIDE, "netns", NS),
                 ("addr", "add", f"{HOST_IP}/24", "dev", OUTSIDE), ("link", "set", OUTSIDE, "up"),
                 ("-n", NS, "addr", "add", f"{EXPERT_IP}/24", "dev", INSIDE), ("-n", NS, "link", "set", INSIDE, "up"),
                 ("-n", NS, "link", "set", "lo", "up")]
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"ip {' '.join(step)} failed: {done.stderr.strip()}")
        yield OUTSIDE
    finally:
        ip("link", "del", OUTSIDE)
        ip("netns", "del", NS)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={EXPERT_IP}", "-addext", f"subjectAltName=IP:{EXPERT_IP}"],
                   check=True, capture_output=True)
    return key, cert


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def answer(url: str, path: Path) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": path.name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def stream_cut_by(url: str, path: Path, cut) -> tuple[list[dict], float]:
    """A long stream; cut() once its first token came; returns its later frames and the seconds from
    the cut to the stream's end."""
    body = {"model": path.name, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    frames, cut_at = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=DEADLINE_S * 3) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if cut_at is None:
                cut()
                cut_at = time.monotonic()
            else:
                frames.append(json.loads(line[6:]))
    return frames, time.monotonic() - cut_at


@pytest.mark.parametrize("client", ["native", "grpcio"])
def test_a_cut_link_fails_fast_and_heals_without_a_restart(link, certificate, client):
    if client == "native" and not native_grpc():
        pytest.skip("tandem_grpc was not built (grpc++ is not installed here)")
    key, cert = certificate
    path = random_model()
    prefix = ("ip", "netns", "exec", NS)
    with Spawned(path, "int8", prefix=prefix, host=EXPERT_IP,
                 extra=("--tls-cert", str(cert), "--tls-key", str(key))) as expert:
        remote = RemoteConfig(addresses=(expert.address,), transport="grpc", tls_root=cert, timeout_s=DEADLINE_S,
                              grpc_client=client)
        dense = start(DenseConfig(model=path, runtime=DenseRuntime("float32", "cpu"), experts="remote",
                                  threads=2, remote=remote, kv_tokens=4096, listen="127.0.0.1:0"))
        try:
            with gateway(dense.port) as (url, _):
                before = answer(url, path)
                frames, took = stream_cut_by(url, path, lambda: ip("link", "set", link, "down"))
                assert took < DEADLINE_S, f"the stream ended {took:.1f} s after the cut (deadline {DEADLINE_S:g} s)"
                errors = [f["error"] for f in frames if "error" in f]
                assert errors and "UNAVAILABLE" in errors[0]["message"], frames[-3:]
                assert wait_for(lambda: health(url) == 503, timeout=15)
                started = time.monotonic()
                refused = httpx.post(url + "/v1/chat/completions", timeout=DEADLINE_S * 3,
                                     json={"model": path.name, "messages": MESSAGES, "max_tokens": 8})
                assert refused.status_code == 503, refused.text
                assert time.monotonic() - started < DEADLINE_S + 5
                assert ip("link", "set", link, "up").returncode == 0
                assert wait_for(lambda: health(url) == 200, timeout=60, period=0.5)
                assert answer(url, path) == before
                assert expert.proc.poll() is None  # healed, not restarted
        finally:
            dense.stop(0)
