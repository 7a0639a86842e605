"""Does the prefix cache pay? Time to first token of a request whose 512-token prefix an earlier
request computed, against one whose prefix is new, through `make serve`'s stack on the bench
checkpoint (int4 dense linears and experts, 2 threads), in rounds that take turns.

    python -m bench.prefix_cache [--rounds 5] [--prefix 512] [--threads 2] [--out F]

Each round sends a new prefix plus a suffix (cold), then the same prefix with another suffix
(warm), streamed, max_tokens 1; TTFT is the time to the first streamed text. Target (the agent-API
issue): warm TTFT at most 1/5 of cold, cached_tokens at least the block-aligned prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from bench._machine import ForeignLoad, machine_info, progress
from bench.checkpoint import bench_checkpoint
from bench.e2e import TandemStack

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_cache.json"
VOCAB = 500


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * j + j * j) % (VOCAB - 3) + 3 for j in range(n)]


def first_token(port: int, ids: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed text, cached_tokens the last chunk's usage reports)."""
    body = json.dumps({"model": "bench", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    t0, ttft, cached = time.perf_counter(), None, -1
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return ttft, cached


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    progress("starting the stack (int4 dense linears and experts)")
    stack = TandemStack(bench_checkpoint(), "int4", "int4", "float32", a.threads)
    cold, warm, cached, load = [], [], [], ForeignLoad()
    try:
        first_token(stack.port, prompt(10**6, 64))  # the first request's one-off costs
        for r in range(a.rounds):
            prefix = prompt(r, a.prefix)
            time.sleep(0.5)
            t, _ = first_token(stack.port, prefix + prompt(1000 + r, 16))
            cold.append(t)
            time.sleep(0.5)
            t, c = first_token(stack.port, prefix + prompt(2000 + r, 16))
            warm.append(t)
            cached.append(c)
            progress(f"round {r + 1}: cold {cold[-1] * 1e3:.1f} ms, warm {warm[-1] * 1e3:.1f} ms, cached {c}")
    finally:
        stack.close()
    block = 16
    report = {"machine": machine_info(a.threads), "prefix": a.prefix, "rounds": a.rounds,
              "cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
              "speedup": statistics.median(cold) / statistics.median(warm), "cached_tokens": cached,
              "aligned_prefix": a.prefix // block * block, "foreign_cpu_share": load.share(),
              "samples": {"cold": cold, "warm": warm}}
    m = report["machine"]
    print(f"\nCPU: {m.get('cpu', '?')}, {a.threads} threads; other processes took {report['foreign_cpu_share']:.1%} "
          "of the CPUs")
    print(f"time to first token, {a.prefix}-token shared prefix + 16 new tokens (median of {a.rounds}):")
    print(f"  new prefix {report['cold_ttft_s'] * 1e3:8.1f} ms   cached prefix {report['warm_ttft_s'] * 1e3:8.1f} ms   "
          f"x{report['speedup']:.1f} (target >= 5x: {'met' if report['speedup'] >= 5 else 'MISSED'})")
    ok = all(c >= report["aligned_prefix"] for c in cached)
    print(f"  cached_tokens {sorted(set(cached))} (block-aligned prefix {report['aligned_prefix']}: "
          f"{'met' if ok else 'MISSED'})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
