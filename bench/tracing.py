"""What does tracing cost? Decode tokens/s with tracing on (default sampling: every request traced,
spans exported over OTLP to a receiver this script runs) against tracing off, in one run, rounds
alternating. The dense engine runs here; the routed experts in a co-located expert server child
(int4, shared memory) that exports its spans to the same receiver.

    python -m bench.tracing [--quick] [--threads 2] [--streams 1,4]

Target on this machine: tracing on is at least 0.97x tracing off.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench._machine import ForeignLoad, machine_info
from bench.checkpoint import bench_checkpoint, packed_store
from bench.serving import prompt, run
from bench.transport import ServerProcess
from services.common import telemetry
from services.dense import tracing
from services.dense.engine import Engine, EngineConfig
from services.dense.loader import load_model, open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from services.dense.request import Request
from services.dense.runtime import DenseRuntime
from services.dense.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "tracing.json"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts spans and drops them."""

    def __init__(self):
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def start_receiver() -> tuple[grpc.Server, Receiver, int]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, receiver, port


def decode_rate(engine: Engine, streams: int, tokens: int, traced: bool) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [Request(f"{'on' if traced else 'off'}{i}", prompt(i, 16), params) for i in range(streams)]
    if traced:
        for r in reqs:
            tracing.start_request(None, r)
            assert r.span is not None, "tracing is not recording"
    times = run(engine, reqs)
    start = max(t[0] for t in times.values())
    end = max(t[-1] for t in times.values())
    return sum(sum(1 for x in t if x > start) for t in times.values()) / (end - start)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", default="1,4")
    a = p.parse_args(argv)
    rounds, tokens = (1, 8) if a.quick else (3, 32)
    server, receiver, port = start_receiver()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    telemetry.setup("bench-dense", telemetry.TracingConfig(otlp=True))
    path = bench_checkpoint()
    store, _ = packed_store(path, "int4", a.threads)
    _, model_cfg = open_checkpoint(path)
    load = ForeignLoad()
    rows = []
    with ServerProcess.expert(path, "int4", a.threads, extra=("--store", str(store))) as experts_proc:
        experts = RemoteExperts(model_cfg, RemoteConfig(addresses=(experts_proc.address,), transport="shm"))
        model, _ = load_model(path, DenseRuntime("bfloat16", "cpu"), experts)
        engine = Engine(model, EngineConfig(kv_blocks=256, block_size=16, max_batch_tokens=512))
        run(engine, [Request("warm", prompt(0, 16), SamplingParams(temperature=0, max_tokens=4))])
        for streams in (int(s) for s in a.streams.split(",")):
            off, on = [], []
            for _ in range(rounds):
                off.append(decode_rate(engine, streams, tokens, traced=False))
                on.append(decode_rate(engine, streams, tokens, traced=True))
            best_off, best_on = max(off), max(on)
            rows.append({"streams": streams, "off_tok_s": best_off, "on_tok_s": best_on, "ratio": best_on / best_off,
                         "rounds_off": off, "rounds_on": on})
        experts.close()
    telemetry.shutdown()
    server.stop(1)
    report = {"machine": {**machine_info(a.threads), "foreign_load": load.share()}, "rows": rows,
              "spans_received": receiver.spans,
              "target_097": {"value": min(r["ratio"] for r in rows), "met": min(r["ratio"] for r in rows) >= 0.97}}
    print(f"\nother load {report['machine']['foreign_load']:.0%}; spans received by the OTLP receiver: {receiver.spans}")
    print(f"{'streams':>8} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7}")
    for r in rows:
        print(f"{r['streams']:>8} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>9.1f} {r['ratio']:>7.3f}")
    t = report["target_097"]
    print(f"target: tracing on >= 0.97x off: {t['value']:.3f} {'MET' if t['met'] else 'MISSED'}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1))
    print(f"JSON: {RESULTS}")


if __name__ == "__main__":
    main()
