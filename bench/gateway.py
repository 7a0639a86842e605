"""How much CPU does the gateway spend per streamed token, on its event loop and HTTP parser against
asyncio's loop and h11 (uvicorn's pure-Python set)? One run:

  The gateway (`python -m gateway`) and the same app under uvicorn with loop="asyncio", http="h11",
  side by side on one fake dense service that streams a canned token every --pace-ms (no model, so
  the gateway's own work is all that is measured), in rounds that take turns. Each round streams
  --tokens tokens of one /v1/completions request, as bench/e2e.py's stack rows do (usage on every
  chunk), and counts the gateway process's CPU time (all its threads, the scheduler's count).

    python -m bench.gateway [--rounds 6] [--tokens 1000] [--pace-ms 2]

On a 2-core machine every CPU-millisecond the gateway spends on a token is taken from the decode
step's cores: the printed share is of the bench model's int4 step through the stack (about 10 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from services.common.grpc_defaults import apply as apply_grpc_defaults

apply_grpc_defaults()

import grpc  # noqa: E402 (after the defaults: gRPC core reads them when it starts)

from bench._machine import ForeignLoad, machine_info  # noqa: E402
from bench._stream import streamed_rate  # noqa: E402
from tandem.v1 import dense_pb2 as pb  # noqa: E402
from tandem.v1 import dense_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gateway.json"
ROOT = Path(__file__).resolve().parent.parent
STEP_MS = 10.0  # the bench model's int4 decode step through the stack, for the share printed
BASELINE = ("import sys, uvicorn; from gateway.app import build_app; from gateway.config import GatewayConfig; "
            "uvicorn.run(build_app(GatewayConfig(dense=sys.argv[1], port=int(sys.argv[2]))), host='127.0.0.1', "
            "port=int(sys.argv[2]), log_level='warning', loop='asyncio', http='h11')")


@dataclass(frozen=True)
class BenchConfig:
    rounds: int
    tokens: int
    pace_s: float


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--pace-ms", type=float, default=2.0, help="the fake dense service's time between tokens")
    a = p.parse_args(argv)
    return BenchConfig(a.rounds, a.tokens, a.pace_ms / 1e3)


class FakeDense(pb_grpc.DenseServiceServicer):
    """Streams max_tokens canned tokens, one every pace_s, with the usage a real stream carries."""

    def __init__(self, pace_s: float):
        self.pace_s = pace_s

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(name="bench", family="qwen3_moe", context_length=1 << 20, vocab_size=512)

    def Generate(self, request, context):
        n, prompt = request.stopping.max_tokens, len(request.token_ids.ids)
        for i in range(n):
            time.sleep(self.pace_s)
            yield pb.GenerateResponse(token_ids=[7], text=" tok", finish_reason=pb.LENGTH if i == n - 1 else 0,
                                      usage=pb.Usage(prompt_tokens=prompt, completion_tokens=i + 1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ms(pid: int) -> float:
    """CPU milliseconds the process's threads have run so far (the scheduler's count, in ns)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e6


def wait_up(port: int, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no gateway on port {port} within {deadline_s:g} s")


def gateways(dense: str) -> dict[str, tuple[int, subprocess.Popen]]:
    ours, base = free_port(), free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": ROOT}
    return {
        "gateway (uvloop, httptools)": (ours, subprocess.Popen(
            [sys.executable, "-m", "gateway", "--dense", dense, "--port", str(ours)], **quiet)),
        "asyncio, h11": (base, subprocess.Popen([sys.executable, "-c", BASELINE, dense, str(base)], **quiet)),
    }


def measure(cfg: BenchConfig) -> dict[str, list[float]]:
    dense_port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_DenseServiceServicer_to_server(FakeDense(cfg.pace_s), server)
    server.add_insecure_port(f"127.0.0.1:{dense_port}")
    server.start()
    running = gateways(f"127.0.0.1:{dense_port}")
    body = {"model": "bench", "prompt": [3, 4, 5], "temperature": 0, "ignore_eos": True}
    out: dict[str, list[float]] = {name: [] for name in running}
    try:
        for port, _ in running.values():
            wait_up(port)
            streamed_rate(port, {**body, "max_tokens": 20}, 19)
        for r in range(cfg.rounds):
            order = list(running) if r % 2 == 0 else list(running)[::-1]
            for name in order:
                port, proc = running[name]
                before = cpu_ms(proc.pid)
                streamed_rate(port, {**body, "max_tokens": cfg.tokens}, cfg.tokens - 1)
                out[name].append((cpu_ms(proc.pid) - before) / cfg.tokens)
    finally:
        for _, proc in running.values():
            proc.terminate()
            proc.wait(30)
        server.stop(0)
    return out


def main(argv=None) -> None:
    cfg = parse_args(argv)
    load = ForeignLoad()
    per_token = measure(cfg)
    (ours, mine), (base, theirs) = per_token.items()
    report = {"machine": {**machine_info(1), "foreign_load": load.share()}, "config": cfg.__dict__,
              "cpu_ms_per_token": {name: statistics.median(v) for name, v in per_token.items()},
              "rounds": per_token,
              "ours_over_baseline": statistics.median([a / b for a, b in zip(mine, theirs)])}
    print_report(report, ours, base)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {RESULTS}")


def print_report(report: dict, ours: str, base: str) -> None:
    m, c = report["machine"], report["config"]
    print(f"\n{m['cpu']}, other load {m['foreign_load']:.0%}"
          f"{' (above 5%: run again on a quiet machine)' if m['foreign_load'] > 0.05 else ''}")
    print(f"gateway CPU per streamed token ({c['tokens']} tokens a round, a token every {c['pace_s'] * 1e3:g} ms, "
          f"medians of {c['rounds']} rounds taking turns; share: of a {STEP_MS:g} ms decode step)")
    for name, ms in report["cpu_ms_per_token"].items():
        print(f"   {name:28s} {ms:.3f} ms  ({ms / STEP_MS:.1%})")
    print(f"   {ours} / {base}: {report['ours_over_baseline']:.3f} (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
