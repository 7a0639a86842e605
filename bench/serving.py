"""How does the engine's continuous batching scale, and what does chunked prefill buy? One run:

  streams   aggregate decode tokens/s with 1, 4 and 16 concurrent streams on the bench checkpoint
            (bench/checkpoint.py: qwen3_moe, hidden 2048, 64 experts, top-8, 6 layers), routed
            experts in a co-located expert server child (int4, shared memory, from the packed store).
            Decode only: counted from the step where every stream has its first token.
  prefill   a 512-token prompt arriving while 8 streams decode: its time to first token, and the
            longest gap between two tokens of the decoding streams meanwhile, with chunked prefill
            (--chunk tokens per step) and without (the whole prompt in one step).

    python -m bench.serving [--quick] [--threads 2] [--dense-dtype float32|bfloat16] [--chunk 64]

Target on this machine: 16 streams give at least 4x the aggregate tokens/s of 1 stream.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench._machine import ForeignLoad, machine_info
from bench.checkpoint import bench_checkpoint, packed_store
from bench.transport import ServerProcess
from services.dense.engine import Engine, EngineConfig
from services.dense.loader import load_model, open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from services.dense.request import Request
from services.dense.runtime import DenseRuntime
from services.dense.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "serving.json"


@dataclass(frozen=True)
class BenchConfig:
    quick: bool
    threads: int
    dense_dtype: str
    chunk: int
    decode_tokens: int


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dense-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32: what `tandem serve` runs on a CPU")
    p.add_argument("--chunk", type=int, default=64, help="prefill tokens per step with chunking on")
    a = p.parse_args(argv)
    return BenchConfig(a.quick, a.threads, a.dense_dtype, a.chunk, 8 if a.quick else 32)


def prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 500 + 3 for j in range(n)]


def run(engine: Engine, requests: list[Request], late: tuple[int, Request] | None = None) -> dict:
    """Steps until every request is done; returns when each request got each token."""
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r)
    step = 0
    everyone = list(requests)
    while engine.has_work() or (late and late[1] not in everyone):
        if late and step == late[0] and late[1] not in everyone:
            engine.submit(late[1])
            everyone.append(late[1])
            times[late[1].request_id] = []
            times["late_submitted"] = [time.perf_counter()]
        engine.step()
        step += 1
        now = time.perf_counter()
        for r in everyone:
            while not r.outputs.empty():
                out = r.outputs.get()
                assert out.error is None, out.error
                times[r.request_id] += [now] * len(out.token_ids)
    return times


def streams_row(engine: Engine, n: int, tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [Request(f"s{i}", prompt(i, 16), params) for i in range(n)]
    times = run(engine, reqs)
    start = max(t[0] for t in times.values())  # every stream decoding from here
    end = max(t[-1] for t in times.values())
    counted = sum(sum(1 for x in t if x > start) for t in times.values())
    return {"streams": n, "decode_tokens": counted, "seconds": end - start, "tokens_per_s": counted / (end - start)}


def prefill_row(engine_of, chunked: bool, cfg: BenchConfig) -> dict:
    engine = engine_of(cfg.chunk if chunked else 1024)
    decode = SamplingParams(temperature=0, max_tokens=cfg.decode_tokens + 8, ignore_eos=True)
    reqs = [Request(f"d{i}", prompt(i, 16), decode) for i in range(8)]
    late = Request("long", prompt(99, 512), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    times = run(engine, reqs, (4, late))
    submitted = times["late_submitted"][0]
    first = times["long"][0]
    gaps = [b - a for r in reqs for a, b in zip(times[r.request_id], times[r.request_id][1:])
            if b > submitted and a < first + 1e-9]
    return {"chunked": chunked, "tokens_per_step": cfg.chunk if chunked else 1024, "ttft_s": first - submitted,
            "max_decode_gap_s": max(gaps) if gaps else 0.0}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    path = bench_checkpoint()
    store, _ = packed_store(path, "int4", cfg.threads)
    _, model_cfg = open_checkpoint(path)
    load = ForeignLoad()
    with ServerProcess.expert(path, "int4", cfg.threads, extra=("--store", str(store))) as server:
        experts = RemoteExperts(model_cfg, RemoteConfig(addresses=(server.address,), transport="shm"))
        model, _ = load_model(path, DenseRuntime(cfg.dense_dtype, "cpu"), experts)

        def engine_of(budget: int) -> Engine:
            return Engine(model, EngineConfig(kv_blocks=512, block_size=16, max_batch_tokens=budget))

        run(engine_of(64), [Request("warm", prompt(0, 16), SamplingParams(temperature=0, max_tokens=4))])
        rows = [streams_row(engine_of(512), n, cfg.decode_tokens) for n in (1, 4, 16)]
        prefill = [prefill_row(engine_of, chunked, cfg) for chunked in (True, False)]
        experts.close()
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["x_one_stream"] = r["tokens_per_s"] / base
    report = {"machine": {**machine_info(cfg.threads), "foreign_load": load.share()}, "config": cfg.__dict__,
              "streams": rows, "prefill": prefill,
              "target_16_streams_4x": {"value": rows[-1]["x_one_stream"], "met": rows[-1]["x_one_stream"] >= 4}}
    print_report(report)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {RESULTS}")


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"\n{m.get('cpu', '?')}, {m.get('threads')} threads, other load {m['foreign_load']:.0%}; "
          f"dense {report['config']['dense_dtype']}, experts int4 over shared memory")
    print(f"\n{'streams':>8} {'decode tok':>11} {'seconds':>8} {'tok/s':>8} {'x 1 stream':>11}")
    for r in report["streams"]:
        print(f"{r['streams']:>8} {r['decode_tokens']:>11} {r['seconds']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['x_one_stream']:>10.2f}x")
    t = report["target_16_streams_4x"]
    print(f"target: 16 streams >= 4x one stream: {t['value']:.2f}x {'MET' if t['met'] else 'MISSED'}")
    print(f"\n512-token prompt arriving while 8 streams decode:\n{'prefill':>22} {'TTFT s':>8} {'max decode gap s':>17}")
    for r in report["prefill"]:
        name = f"chunked ({r['tokens_per_step']}/step)" if r["chunked"] else "whole prompt, 1 step"
        print(f"{name:>22} {r['ttft_s']:>8.3f} {r['max_decode_gap_s']:>17.3f}")


if __name__ == "__main__":
    main()
