"""What does reaching the routed experts in another process cost, against running them in this one?
Measured in one run, side by side:

  calls     one MoE layer call's round trip with the kernel work taken out, p50 / p99 / mean, for
            T=1 and T=128 tokens of D=7168 (DeepSeek-V3's hidden size), K=8, x in float32 and bf16:
            in-process (NativeExperts.submit/wait as they are, with tandem_native.moe_submit swapped
            for out[...] = x: the backend's own tensor conversions, no kernel), shared memory
            (RemoteExperts transport=shm) and inline gRPC over loopback (transport=grpc: grpc++ at
            both ends where tandem_grpc is built, the server's Compute on its own port), both
            against a `python -m expert_server --echo` child (it returns x unchanged, after the same
            copy); grpcio, the same on grpcio's client and the server's grpcio Compute; and
            grpc-floor, grpcio by itself: the same request's bytes echoed over a bytes-only stream
            by a bench/_grpc_echo.py child, the least a path through grpcio at both ends pays on
            this machine. Thousands of calls each, after warm-up.
  decode    tokens/s decoding greedily on the bench checkpoint (bench/checkpoint.py: qwen3_moe,
            hidden 2048, 64 experts, top-8, 6 layers) with int4 experts: a co-located expert server
            child (shm, --threads 2, from the packed store) against NativeExperts in-process
            (int4, 2 threads); same prompt, tokens asserted identical; rounds alternate.
  startup   an expert server child's start to its "ready" line: packing at load from the
            checkpoint against mapping a `convert`ed store (converted once, cached); the layer
            outputs of both are asserted bit-identical.

    python -m bench.transport [--quick] [--threads 2] [--dense-dtype float32|bfloat16] [--out ...]

Legend: T tokens, K experts per token, E experts in a layer, D hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import _machine
from bench import checkpoint as bench_ckpt
from bench._machine import progress

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
HIDDEN = 7168
TOP_K = 8
GAP_S = 0.002  # the T=1 float32 case again with calls this far apart (the server's spin runs out)
FORMAT = "int4"
SERVER_START_TIMEOUT_S = 900
PROMPT = "Mixture-of-Experts models route each token to a few experts. The quick brown fox"

# target name -> (value it applies to, bound, "max" or "min")
TARGETS = {
    "shm_p50_us_t1": ("shm p50 at T=1, float32", 30.0, "max"),
    "shm_p99_us_t1": ("shm p99 at T=1, float32", 150.0, "max"),
    "grpc_p50_us_t1": ("gRPC p50 at T=1, float32", 400.0, "max"),
    "decode_ratio": ("decode tokens/s, server / in-process", 0.9, "min"),
    "startup_ratio": ("ready time, checkpoint / store", 5.0, "min"),
}

@dataclass(frozen=True)
class BenchConfig:
    quick: bool
    threads: int
    dense_dtype: str
    out: Path
    call_iters: dict  # T -> (warm-up calls, timed calls), per path
    call_rounds: int  # the paths take turns this many times
    gap_calls: int  # calls per path in the case with calls GAP_S apart
    decode_tokens: int
    decode_rounds: int
    pack_starts: int
    store_starts: int
    parts: tuple[str, ...]


PARTS = ("calls", "decode", "startup")


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a fast smoke run: fewer calls, tokens, rounds and starts")
    p.add_argument("--threads", type=int, default=2, help="kernel and torch threads on each side (default 2)")
    p.add_argument("--dense-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="the dense path's dtype in the decode part (default bfloat16: on the 2-core AVX2 bench "
                        "machine a decode step of the bench checkpoint's dense path took 45 ms in bf16, 63 ms in fp32)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "transport.json", help="where the JSON goes")
    a = p.parse_args(argv)
    parts = tuple(x for x in a.parts.split(",") if x)
    if a.threads < 1 or not set(parts) <= set(PARTS):
        p.error(f"--threads must be >= 1 and --parts a subset of {','.join(PARTS)}")
    sizes = QUICK if a.quick else FULL
    return BenchConfig(quick=a.quick, threads=a.threads, dense_dtype=a.dense_dtype, out=a.out, parts=parts, **sizes)


QUICK = dict(call_iters={1: (100, 600), 128: (20, 60)}, call_rounds=2, gap_calls=200, decode_tokens=8,
             decode_rounds=1, pack_starts=1, store_starts=1)  # fmt: skip
FULL = dict(call_iters={1: (1000, 10000), 128: (100, 1000)}, call_rounds=5, gap_calls=1500, decode_tokens=48,
            decode_rounds=3, pack_starts=1, store_starts=3)  # fmt: skip


# ------------------------------------------------------------------ an expert server child


class ServerProcess:
    """A server child (`python -m expert_server`, or another command that prints "ready on port N");
    ready_s is the time from spawning it to that line."""

    @staticmethod
    def expert(model: Path, fmt: str, threads: int, extra: tuple[str, ...] = ()) -> "ServerProcess":
        return ServerProcess([sys.executable, "-m", "expert_server", "--model", str(model), "--format", fmt,
                              "--threads", str(threads), "--listen", "127.0.0.1:0", "--drain-seconds", "2", *extra])

    def __init__(self, cmd: list[str]):
        self.lines: list[str] = []
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        timer = threading.Timer(SERVER_START_TIMEOUT_S, self.proc.kill)
        timer.start()
        try:
            self.port = self._await_port()
        finally:
            timer.cancel()
        self.ready_s = time.perf_counter() - t0
        threading.Thread(target=self._drain, daemon=True).start()

    def _await_port(self) -> int:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "ready on port" in line:
                return int(line.rsplit(" ", 1)[1])
        self.proc.wait()
        tail = "".join(self.lines[-20:])
        raise RuntimeError(f"expert server exited with {self.proc.returncode} before ready:\n{tail}")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def remote(model_cfg, address: str, transport: str, grpc_client: str = "auto"):
    from services.dense.moe.remote import RemoteConfig, RemoteExperts

    return RemoteExperts(model_cfg, RemoteConfig(addresses=(address,), transport=transport, grpc_client=grpc_client))


# ------------------------------------------------------------------ calls: the per-layer round trip


class _EchoKernels:
    """Stands in for the tandem_native module inside a NativeExperts: moe_forward (the CPU path's
    call) and moe_submit (a GPU's, handing back a finished job) do what the echo server does
    (out[...] = x); everything else is the backend's own."""

    class _Done:
        def wait(self) -> None:
            pass

    _DONE = _Done()

    def moe_forward(self, layer, x, ids, weights, out, pool):
        out[...] = x

    def moe_submit(self, layer, x, ids, weights, out, pool):
        self.moe_forward(layer, x, ids, weights, out, pool)
        return self._DONE


def inprocess_echo(layers: list[int]):
    """A NativeExperts whose submit/wait run unchanged around an echo instead of the kernel."""
    from services.dense.moe.native import NativeExperts

    backend = NativeExperts.__new__(NativeExperts)  # skips packing: no weights are needed
    backend._tn, backend.pool, backend.layers = _EchoKernels(), None, dict.fromkeys(layers)
    return backend


class GrpcFloor:
    """The floor under the inline gRPC path: the bytes of this call's ComputeRequest, serialized once,
    sent down a bidirectional stream (the same queue-fed shape as InlineTransport) to
    bench/_grpc_echo.py, which yields them back; forward returns x once the echo came back whole."""

    def __init__(self, address: str, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        import queue

        import grpc

        from bench._grpc_echo import METHOD
        from services.common import wire
        from services.dense.moe.remote import CHANNEL_OPTIONS
        from services.dense.moe.transport import host_array, to_wire
        from tandem.v1 import expert_pb2 as pb

        request = pb.ComputeRequest(layer=layer)
        wire.encode(request.x, *to_wire(x))
        wire.encode(request.ids, host_array(ids, torch.int64), pb.INT64)
        wire.encode(request.weights, host_array(weights, torch.float32), pb.FLOAT32)
        self.payload, self.x = request.SerializeToString(), x
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        echo = self.channel.stream_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)
        self.call = echo(iter(self.queue.get, None))

    def forward(self, layer, x, ids, weights):
        self.queue.put(self.payload)
        if len(next(self.call)) != len(self.payload):
            raise AssertionError("the gRPC echo came back short")
        return self.x

    def close(self) -> None:
        self.queue.put(None)
        self.call.cancel()
        self.channel.close()


def call_inputs(tokens: int, dtype: torch.dtype, experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
    return x, ids, weights


def time_calls(backend, x, ids, weights, warmup: int, iters: int, gap_s: float = 0.0) -> np.ndarray:
    """Seconds of each of `iters` forward calls on layer 0, after `warmup` untimed ones, back to
    back or `gap_s` apart (this thread busy meanwhile, as the dense side is between the layers of a
    decode step, while the server's doorbell spin runs out); the echo is checked to hand x back."""
    for _ in range(warmup):
        out = backend.forward(0, x, ids, weights)
    if not torch.equal(out, x):
        raise AssertionError("the echo did not return x unchanged")
    times = np.empty(iters)
    clock = time.perf_counter
    for i in range(iters):
        if gap_s:
            end = clock() + gap_s
            while clock() < end:
                pass
        t0 = clock()
        backend.forward(0, x, ids, weights)
        times[i] = clock() - t0
    return times


def summary(times: np.ndarray) -> dict:
    us = times * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "max_us": float(us.max()), "calls": len(us)}  # fmt: skip


PATHS = ("in-process", "shm", "grpc", "grpcio", "grpc-floor")
PATH_NOTES = {
    "in-process": "NativeExperts.submit/wait, kernel swapped for out[...]=x",
    "shm": "RemoteExperts transport=shm -> echo server child",
    "grpc": "RemoteExperts transport=grpc (loopback; where tandem_grpc is built grpc++ at both ends: the client, "
            "and the server's Compute on its own port) -> echo server child",
    "grpcio": "the same on grpcio's client (--grpc-client grpcio), to the server's grpcio Compute",
    "grpc-floor": "grpcio alone: the same request's bytes echoed by a bytes-only stream (bench/_grpc_echo.py)",
}


def call_rows(cfg: BenchConfig) -> list[dict]:
    """Every path x T x dtype against one echo server child (--threads 1: its kernel pool has no
    work). The paths take turns: each case's calls are split into rounds, and in every round each
    path opens its backend, warms up, times its share of calls and closes, so a noisy minute on a
    shared machine falls on all paths alike and no idle transport's threads run under another's."""
    from services.dense.loader import open_checkpoint

    model = bench_ckpt.echo_checkpoint()
    _, model_cfg = open_checkpoint(model)
    cases = [(t, dt, 0.0) for t in sorted(cfg.call_iters) for dt in (torch.float32, torch.bfloat16)]
    cases.insert(1, (1, torch.float32, GAP_S))
    rows = []
    with ServerProcess.expert(model, "bf16", threads=1, extra=("--echo",)) as server, \
            ServerProcess([sys.executable, "-m", "bench._grpc_echo"]) as floor_server:
        for tokens, dtype, gap_s in cases:
            warmup, iters = cfg.call_iters[tokens] if not gap_s else (cfg.call_iters[1][0], cfg.gap_calls)
            x, ids, weights = call_inputs(tokens, dtype, model_cfg.moe.num_experts)
            times: dict[str, list[np.ndarray]] = {path: [] for path in PATHS}
            apart = f", {gap_s * 1e3:g} ms apart" if gap_s else ""
            progress(f"calls: T={tokens}, {str(dtype)[6:]}{apart}: {iters} calls per path in {cfg.call_rounds} rounds")
            for _ in range(cfg.call_rounds):
                for path in PATHS:
                    if path == "in-process":
                        backend = inprocess_echo([0])
                    elif path == "grpc-floor":
                        backend = GrpcFloor(floor_server.address, 0, x, ids, weights)
                    elif path == "grpcio":
                        backend = remote(model_cfg, server.address, "grpc", "grpcio")
                    else:
                        backend = remote(model_cfg, server.address, path)
                    try:
                        times[path].append(time_calls(backend, x, ids, weights, max(20, warmup // cfg.call_rounds),
                                                      iters // cfg.call_rounds, gap_s))
                    finally:
                        backend.close()
            for path in PATHS:
                rows.append({"path": path, "tokens": tokens, "dtype": str(dtype)[6:], "gap_ms": gap_s * 1e3,
                             "hidden": HIDDEN, "top_k": TOP_K, "x_bytes": x.nbytes,
                             **summary(np.concatenate(times[path]))})  # fmt: skip
    base = {(r["tokens"], r["dtype"], r["gap_ms"]): r for r in rows if r["path"] == "in-process"}
    for r in rows:
        b = base[(r["tokens"], r["dtype"], r["gap_ms"])]
        r["extra_p50_us"] = r["p50_us"] - b["p50_us"]
        r["x_p50"] = r["p50_us"] / b["p50_us"]
    order = {p: i for i, p in enumerate(PATHS)}
    return sorted(rows, key=lambda r: (r["tokens"], r["dtype"] != "float32", r["gap_ms"], order[r["path"]]))


# ------------------------------------------------------------------ decode: end to end


class TimedExperts:
    """Wraps a backend and adds up the time from each submit to the end of its wait."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def expect(self, layer):
        self.inner.expect(layer)

    def submit(self, layer, x, ids, weights):
        return time.perf_counter(), self.inner.submit(layer, x, ids, weights)

    def wait(self, handle):
        t0, inner = handle
        out = self.inner.wait(inner)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def forward(self, layer, x, ids, weights):
        return self.wait(self.submit(layer, x, ids, weights))

    def server_stats(self) -> dict | None:
        """RemoteExperts' own count since the last take: the seconds the server computed (its
        compute_s) and the rest of each call (transport); None for a backend without one."""
        take = getattr(self.inner, "take_step_stats", None)
        return take() if take else None

    def close(self):
        self.inner.close()


def decode_once(model, experts: TimedExperts, prompt: list[int], n: int) -> dict:
    """Greedy decode of n tokens (no EOS stop, so every run decodes n): the prefill gives the first
    token; tokens/s counts the n - 1 decode steps after it."""
    from services.dense.generate import stream
    from services.dense.sampling import SamplingParams

    tokens, stamps = [], []
    experts.seconds = experts.calls = 0
    t0 = time.perf_counter()
    for token in stream(model, prompt, SamplingParams(temperature=0, max_tokens=n), ()):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == 1:
            prefill_expert_s, experts.seconds, experts.calls = experts.seconds, 0.0, 0
            experts.server_stats()
    steps = np.diff(stamps)
    server = experts.server_stats()  # the decode steps' calls: seconds the server computed, and the rest
    return {"tokens": tokens, "tok_s": (n - 1) / (stamps[-1] - stamps[0]), "prefill_s": stamps[0] - t0,
            "step_ms_p50": float(np.median(steps) * 1e3), "expert_ms_per_token": experts.seconds / (n - 1) * 1e3,
            "expert_calls_per_token": experts.calls / (n - 1), "prefill_expert_s": prefill_expert_s,
            "server_compute_ms_per_token": server["expert_s"] / (n - 1) * 1e3 if server else None,
            "server_transport_ms_per_token": server["transport_s"] / (n - 1) * 1e3 if server else None}  # fmt: skip


def decode_part(cfg: BenchConfig, store: Path) -> dict:
    from services.dense.loader import load_model, open_checkpoint
    from services.dense.moe.native import NativeExperts
    from services.dense.runtime import DenseRuntime
    from services.dense.tokenizer import Tokenizer

    model_dir = bench_ckpt.bench_checkpoint()
    checkpoint, model_cfg = open_checkpoint(model_dir)
    runtime = DenseRuntime(dtype=cfg.dense_dtype, device="cpu")
    prompt = Tokenizer(model_dir).encode(PROMPT)
    progress(f"decode: NativeExperts {FORMAT} (packing {model_cfg.num_layers} layers in-process)")
    t0 = time.perf_counter()
    native = TimedExperts(NativeExperts(model_cfg, checkpoint, FORMAT, cfg.threads))
    native_pack_s = time.perf_counter() - t0
    native_model, _ = load_model(model_dir, runtime, native)
    progress("decode: expert server child from the store, shm")
    with ServerProcess.expert(model_dir, FORMAT, cfg.threads, extra=("--store", str(store))) as server:
        served = TimedExperts(remote(model_cfg, server.address, "shm"))
        served_model, _ = load_model(model_dir, runtime, served)
        runs = {"in-process": [], "server-shm": []}
        pairs = (("in-process", native_model, native), ("server-shm", served_model, served))
        for name, model, experts in pairs:  # warm-up: first touches of pages, caches, threads
            decode_once(model, experts, prompt, 4)
        for r in range(cfg.decode_rounds):
            for name, model, experts in pairs if r % 2 == 0 else pairs[::-1]:
                progress(f"decode: round {r + 1}/{cfg.decode_rounds}, {name}, {cfg.decode_tokens} tokens")
                runs[name].append(decode_once(model, experts, prompt, cfg.decode_tokens))
        served.close()
    native.close()
    reference = runs["in-process"][0]["tokens"]
    same = all(run["tokens"] == reference for v in runs.values() for run in v)
    if not same:
        seen = {name: [run["tokens"] for run in v] for name, v in runs.items()}
        raise AssertionError(f"decoded tokens differ between backends: {seen}")
    best = {name: max(v, key=lambda run: run["tok_s"]) for name, v in runs.items()}
    med = {name: statistics.median(run["tok_s"] for run in v) for name, v in runs.items()}
    return {
        "model": model_dir.name, "format": FORMAT, "dense_dtype": cfg.dense_dtype, "threads": cfg.threads,
        "prompt_tokens": len(prompt), "new_tokens": cfg.decode_tokens, "rounds": cfg.decode_rounds,
        "tokens_identical": same, "tokens": reference, "native_pack_s": native_pack_s,
        "tok_s_median": med, "ratio": med["server-shm"] / med["in-process"],
        "best": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in best.items()},
        "runs": {k: [{kk: vv for kk, vv in run.items() if kk != "tokens"} for run in v] for k, v in runs.items()},
    }  # fmt: skip


# ------------------------------------------------------------------ startup: packing at load vs a store


def layer_outputs(model_cfg, address: str) -> dict[int, torch.Tensor]:
    """Each MoE layer's answer to fixed inputs (T=4, float32), over inline gRPC."""
    backend = remote(model_cfg, address, "grpc")
    try:
        outs = {}
        for layer in range(model_cfg.num_layers):
            g = torch.Generator().manual_seed(100 + layer)
            x = torch.randn(4, model_cfg.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(model_cfg.moe.num_experts, generator=g)[:model_cfg.moe.top_k]
                               for _ in range(4)])  # fmt: skip
            weights = torch.softmax(torch.randn(4, model_cfg.moe.top_k, generator=g), -1)
            outs[layer] = backend.forward(layer, x, ids, weights)
        return outs
    finally:
        backend.close()


def read_through(paths: list[Path]) -> None:
    """Reads files once so every timed start finds them in the page cache (warm, like a restart)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(bytearray(64 << 20)):
                pass


def startup_part(cfg: BenchConfig) -> tuple[dict, Path]:
    from services.dense.loader import open_checkpoint

    model_dir = bench_ckpt.bench_checkpoint()
    _, model_cfg = open_checkpoint(model_dir)
    store, convert_s = bench_ckpt.packed_store(model_dir, FORMAT, cfg.threads)
    read_through(sorted(model_dir.glob("*.safetensors")) + [store])
    starts: dict[str, list[dict]] = {"checkpoint": [], "store": []}
    outputs: dict[str, list] = {"checkpoint": [], "store": []}
    plan = ["checkpoint"] * cfg.pack_starts + ["store"] * cfg.store_starts
    for i, source in enumerate(plan):
        progress(f"startup: expert server from the {source} ({i + 1}/{len(plan)})")
        extra = ("--store", str(store)) if source == "store" else ()
        with ServerProcess.expert(model_dir, FORMAT, cfg.threads, extra=extra) as server:
            t0 = time.perf_counter()
            outputs[source].append(layer_outputs(model_cfg, server.address))
            starts[source].append({"ready_s": server.ready_s, "first_calls_s": time.perf_counter() - t0})
    reference = outputs["checkpoint"][0]
    identical = all(torch.equal(out[layer], reference[layer])
                    for v in outputs.values() for out in v for layer in reference)  # fmt: skip
    if not identical:
        raise AssertionError("layer outputs differ between a server packing at load and one mapping the store")
    ready = {source: min(s["ready_s"] for s in v) for source, v in starts.items()}
    return {
        "model": model_dir.name, "format": FORMAT, "threads": cfg.threads, "store": str(store),
        "store_bytes": store.stat().st_size, "convert_s": convert_s, "outputs_identical": identical,
        "ready_s": ready, "ratio": ready["checkpoint"] / ready["store"], "starts": starts,
        "page_cache": "warm (files read through before the first start)",
    }, store  # fmt: skip


# ------------------------------------------------------------------ output


def verdict(key: str, value: float) -> dict:
    what, bound, kind = TARGETS[key]
    met = value <= bound if kind == "max" else value >= bound
    by = (value / bound - 1) if kind == "max" else (1 - value / bound)
    return {"what": what, "value": value, "target": bound, "kind": kind, "met": met, "missed_by": 0.0 if met else by}


def targets(report: dict) -> dict:
    out = {}
    calls = {(r["path"], r["tokens"], r["dtype"]): r for r in report.get("calls", []) if not r["gap_ms"]}
    if ("shm", 1, "float32") in calls:
        out["shm_p50_us_t1"] = verdict("shm_p50_us_t1", calls[("shm", 1, "float32")]["p50_us"])
        out["shm_p99_us_t1"] = verdict("shm_p99_us_t1", calls[("shm", 1, "float32")]["p99_us"])
    if ("grpc", 1, "float32") in calls:
        out["grpc_p50_us_t1"] = verdict("grpc_p50_us_t1", calls[("grpc", 1, "float32")]["p50_us"])
    if "decode" in report:
        out["decode_ratio"] = verdict("decode_ratio", report["decode"]["ratio"])
    if "startup" in report:
        out["startup_ratio"] = verdict("startup_ratio", report["startup"]["ratio"])
    return out


def mark(t: dict | None) -> str:
    if t is None:
        return ""
    sign = "<=" if t["kind"] == "max" else ">="
    return f"{sign} {t['target']:g}: " + ("met" if t["met"] else f"MISSED by {t['missed_by']:.1%}")


def table(header: list[str], rows: list[list[str]], left: int = 1) -> None:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(v.ljust(w) if i < left or i == len(r) - 1 else v.rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths))).rstrip())  # fmt: skip


def print_report(report: dict) -> None:
    info, tg = report["machine"], report["targets"]
    print(f"{info['cpu']} ({' '.join(info['isa'])}), {info['logical_cpus']} CPUs, torch {info['torch']}, "
          f"{'quick' if report['quick'] else 'full'} run")  # fmt: skip
    warn = "  WARNING: rows are slowed, run again on a quiet machine" if info["foreign_load"] > 0.05 else ""
    print(f"other processes used {info['foreign_load']:.0%} of the CPUs during the run{warn}")
    if "calls" in report:
        print(f"\nlayer call round trip, kernel work taken out (D={HIDDEN}, K={TOP_K}; echo server --threads 1)")
        rows = []
        for r in report["calls"]:
            t1f = r["tokens"] == 1 and r["dtype"] == "float32" and not r["gap_ms"]
            target = [tg.get(f"{r['path']}_p50_us_t1"), tg.get(f"{r['path']}_p99_us_t1")] if t1f else []
            rows.append([str(r["tokens"]), r["dtype"], f"{r['gap_ms']:g}" if r["gap_ms"] else "-", r["path"],
                         f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
                         f"{r['mean_us']:.1f}", f"{r['extra_p50_us']:+.1f}", f"{r['x_p50']:.1f}x", str(r["calls"]),
                         "; ".join(f"p{q} {mark(t)}" for q, t in zip((50, 99), target) if t)])  # fmt: skip
        table(["T", "x dtype", "gap ms", "path", "p50 us", "p99 us", "mean us", "+p50 us", "vs in-proc", "calls",
               "target"], rows, left=4)
        for path, note in PATH_NOTES.items():
            print(f"  {path}: {note}")
        print(f"  the grpc rows' client here: {report['grpc_client']}")
        print("  gap ms: calls that far apart (the caller busy in between, as the dense side between the layers of a\n"
              "  decode step; the server's doorbell spin runs out); -: back to back\n"
              "  +p50 us: p50 over the in-process row's")
    if "decode" in report:
        d = report["decode"]
        print(f"\ndecode, {d['model']} ({d['format']} experts, dense {d['dense_dtype']}, {d['threads']} threads each "
              f"side), prompt {d['prompt_tokens']} tokens, {d['new_tokens']} new greedy, {d['rounds']} rounds "
              "alternating")  # fmt: skip
        rows = []
        for name, med in d["tok_s_median"].items():
            b = d["best"][name]
            ratio = f"{d['ratio']:.3f}x" if name == "server-shm" else "1.000x"
            compute = b.get("server_compute_ms_per_token")
            rows.append([name, f"{med:.2f}", f"{b['step_ms_p50']:.1f}", f"{b['expert_ms_per_token']:.2f}",
                         "-" if compute is None else f"{compute:.2f}", f"{b['expert_calls_per_token']:.0f}",
                         f"{b['prefill_s'] * 1e3:.0f}", ratio,
                         mark(tg.get("decode_ratio")) if name == "server-shm" else ""])  # fmt: skip
        table(["backend", "tok/s", "ms/step", "expert ms/tok", "server compute ms/tok", "calls/tok", "prefill ms",
               "ratio", "target"], rows)
        print(f"  tokens identical across backends and rounds: {d['tokens_identical']}; tok/s: median of rounds; "
              f"other columns: the fastest round; in-process packing took {d['native_pack_s']:.1f} s")  # fmt: skip
        print("  expert ms/tok: submit to end of wait, summed over a step's layer calls; server compute: the part "
              "the server reports as its own (compute_s), the rest is transport")
    if "startup" in report:
        s = report["startup"]
        print(f"\nstartup, {s['model']} ({s['format']}, --threads {s['threads']}), spawn to 'ready on port', "
              f"page cache {s['page_cache'].split(' ')[0]}")  # fmt: skip
        rows = []
        for source, ready in s["ready_s"].items():
            firsts = min(x["first_calls_s"] for x in s["starts"][source])
            rows.append([f"from {source}", f"{ready:.2f}", f"{firsts * 1e3:.0f}", str(len(s["starts"][source])),
                         f"{s['ratio']:.1f}x" if source == "checkpoint" else "1.0x",
                         mark(tg.get("startup_ratio")) if source == "checkpoint" else ""])  # fmt: skip
        table(["source", "ready s", "first calls ms", "starts", "ratio", "target"], rows)
        conv = f"converted in {s['convert_s']:.1f} s" if s["convert_s"] else "cached"
        print(f"  ready s: best of the starts; first calls: one T=4 call per layer right after ready (gRPC); outputs "
              f"bit-identical: {s['outputs_identical']}; store {s['store_bytes'] / 2**30:.2f} GiB, {conv}")  # fmt: skip


def main(argv=None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    load = _machine.ForeignLoad()
    from services.dense.moe.transport import native_grpc

    report: dict = {"machine": _machine.machine_info(cfg.threads), "quick": cfg.quick,
                    "grpc_client": "native" if native_grpc() else "grpcio"}  # the grpc rows' client (auto)
    progress("checkpoints")
    bench_ckpt.echo_checkpoint(), bench_ckpt.bench_checkpoint()
    if "calls" in cfg.parts:
        report["calls"] = call_rows(cfg)
    store = None
    if "startup" in cfg.parts:
        report["startup"], store = startup_part(cfg)
    if "decode" in cfg.parts:
        if store is None:
            store, _ = bench_ckpt.packed_store(bench_ckpt.bench_checkpoint(), FORMAT, cfg.threads)
        report["decode"] = decode_part(cfg, store)
    report["machine"]["foreign_load"] = load.share()
    report["targets"] = targets(report)
    print_report(report)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {cfg.out}")


if __name__ == "__main__":
    main()
