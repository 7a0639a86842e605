"""Does the stack stay up and lean under sustained load, and heal under chaos? `tandem serve` (the
launcher, as `make serve` runs it) on the built-in default model, N concurrent clients through the
`openai` client for a bounded time: streaming and not, random lengths and sampling parameters, a
share cancelled mid-stream, a share invalid (each must get its 4xx). A sampler records each
process's RSS and open file descriptors, the dense service's KV blocks in use and our /dev/shm
segments. One table: requests by outcome, p50/p99 latency and time to first token, throughput,
memory growth from the warm mark (minute 2, or a fifth of a shorter run) to the end. With --chaos
the expert server, then the dense service, is killed (SIGKILL) at intervals; per kill: the time
until /health is 200 again, and the requests that failed meanwhile.

    python -m bench.soak [--clients 16] [--minutes 10] [--chaos] [--kill-every 60] [--model DIR] [--threads 2]

Targets (the operations issue): no 5xx but the chaos ones; RSS of every process grows < 5% from the
warm mark to the end; no KV block in use and no segment of ours in /dev/shm at the end; under chaos
every request either succeeds or gets an error frame / 503.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai

from bench._machine import ForeignLoad, machine_info, progress
from bench.e2e import free_port
from services.common.shm_layout import NAME_PREFIX, SHM_DIR
from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "soak.json"
LOG = ROOT / "bench" / "results" / "soak-stack.log"
STARTED = re.compile(r"tandem: (\w+) started \(pid (\d+)\)")
DENSE_PORT = re.compile(r"\[dense\] dense service ready on port (\d+)")
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
             "Explain what a CPU does.", "Count from one to ten.", "What is two plus two?",
             "Tell me a short story about a cat.", "Why is the sky blue?"]
KINDS = {"stream": 0.4, "plain": 0.3, "cancel": 0.15, "invalid": 0.15}
EXPECTED = {"ok", "cancelled", "rejected"}  # outcomes that are right answers
CHAOS = {"error frame", "503", "connection"}  # what a request in flight when a part dies may get


@dataclass(frozen=True)
class SoakConfig:
    clients: int
    seconds: float
    chaos: bool
    kill_every: float
    model: str | None
    threads: int
    sample_every: float
    seed: int


def parse_args(argv=None) -> SoakConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--chaos", action="store_true", help="kill the expert server, then the dense service, in turns")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills (chaos)")
    p.add_argument("--model", help="a checkpoint directory (default: the built-in model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.clients < 1 or a.minutes <= 0:
        p.error("--clients and --minutes must be positive")
    return SoakConfig(a.clients, a.minutes * 60, a.chaos, a.kill_every, a.model, a.threads, a.sample_every, a.seed)


# ------------------------------------------------------------------ the stack


class Launcher:
    """`python -m services.launcher serve` in its own session; its output goes to LOG and is read
    for the children's pids (new ones after a restart) and the dense service's port."""

    def __init__(self, cfg: SoakConfig):
        self.port = free_port()
        argv = [sys.executable, "-m", "services.launcher", "serve", "--port", str(self.port),
                "--threads", str(cfg.threads), "--max-restarts", "100"]
        argv += ["--model", cfg.model] if cfg.model else []
        LOG.parent.mkdir(exist_ok=True)
        self.log = open(LOG, "w")
        self.pids: dict[str, int] = {}
        self.dense_port = 0
        self.ready = threading.Event()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.pids["launcher"] = self.proc.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if m := STARTED.search(line):
                self.pids[m.group(1)] = int(m.group(2))
            if m := DENSE_PORT.search(line):
                self.dense_port = int(m.group(1))
            if "tandem: ready at" in line:
                self.ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        end = time.monotonic() + timeout
        while not self.ready.wait(1):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the stack did not start (code {self.proc.poll()}); see {LOG}")

    def health(self) -> int:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.log.close()
        return code


def ours_in_shm() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)}


def alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


# ------------------------------------------------------------------ samples


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def kv_stats(port: int) -> dict | None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            s = pb_grpc.DenseServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=2)
        return {"kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total, "running": s.running,
                "waiting": s.waiting}
    except grpc.RpcError:
        return None


class Sampler:
    def __init__(self, stack: Launcher, every: float):
        self.stack, self.every, self.rows = stack, every, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()
        self.thread.start()

    def sample(self) -> dict:
        procs = {name: {"pid": pid, "rss_mb": rss_mb(pid), "fds": open_fds(pid)}
                 for name, pid in list(self.stack.pids.items())}
        return {"t": time.monotonic() - self.t0, "procs": procs, "shm": len(ours_in_shm()),
                "kv": kv_stats(self.stack.dense_port)}

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.rows.append(self.sample())

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


# ------------------------------------------------------------------ clients


@dataclass
class Record:
    kind: str
    start: float
    outcome: str = ""
    seconds: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    detail: str = ""


def invalid_request(rng: random.Random, model: str) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return rng.choice([
        {"model": model, "messages": messages, "temperature": -1},
        {"model": model, "messages": messages, "top_p": 2},
        {"model": model, "messages": messages, "max_tokens": -5},
        {"model": model, "messages": []},
        {"model": "no-such-model", "messages": messages},
        {"model": model, "messages": [{"role": "wizard", "content": "hi"}]},
    ])


def valid_request(rng: random.Random, model: str) -> dict:
    text = rng.choice(QUESTIONS) + " " + " ".join(rng.choice(QUESTIONS).split()[: rng.randint(0, 6)])
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(4, 64),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 2**31)}


def classify(exc: Exception) -> tuple[str, str]:
    if isinstance(exc, openai.APIStatusError):
        code = exc.status_code
        return ("503" if code == 503 else "5xx" if code >= 500 else f"{code}"), str(exc)[:200]
    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return "connection", str(exc)[:200]
    if isinstance(exc, openai.APIError):  # an error event inside a stream
        return "error frame", str(exc)[:200]
    return "exception", repr(exc)[:200]


def one_request(client: openai.OpenAI, rng: random.Random, model: str, kind: str) -> Record:
    rec = Record(kind, time.monotonic())
    try:
        if kind == "invalid":
            client.chat.completions.create(**invalid_request(rng, model))
            rec.outcome = "invalid accepted"
        elif kind == "plain":
            r = client.chat.completions.create(**valid_request(rng, model))
            rec.outcome, rec.tokens = "ok", r.usage.completion_tokens
        else:
            stop_after = rng.randint(1, 4) if kind == "cancel" else None
            stream = client.chat.completions.create(**valid_request(rng, model), stream=True,
                                                    stream_options={"include_usage": True})
            chunks = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and rec.ttft is None:
                    rec.ttft = time.monotonic() - rec.start
                if chunk.usage:
                    rec.tokens = chunk.usage.completion_tokens
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    stream.close()
                    break
            rec.outcome = "cancelled" if stop_after is not None and chunks >= stop_after else "ok"
    except Exception as exc:  # every failure is an outcome to count
        rec.outcome, rec.detail = classify(exc)
        if kind == "invalid" and rec.outcome in ("400", "404", "422"):
            rec.outcome = "rejected"
    rec.seconds = time.monotonic() - rec.start
    return rec


def client_loop(url: str, model: str, seed: int, deadline: float, records: list[Record]) -> None:
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    while time.monotonic() < deadline:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        records.append(one_request(client, rng, model, kind))
        if records[-1].outcome in CHAOS:
            time.sleep(0.5)  # as a client would, rather than spin on a part that is down
    client.close()


# ------------------------------------------------------------------ chaos


def chaos_loop(stack: Launcher, every: float, deadline: float, kills: list[dict], t0: float) -> None:
    """Kills the expert server, then the dense service, in turns; each time waits until /health is
    200 again and records how long it took."""
    parts = ["expert", "dense"]
    i = 0
    while time.monotonic() + every + 30 < deadline:
        time.sleep(every)
        name = parts[i % 2]
        i += 1
        pid, at = stack.pids[name], time.monotonic()
        os.kill(pid, signal.SIGKILL)
        progress(f"chaos: killed {name} (pid {pid})")
        saw_503 = False
        while time.monotonic() - at < 300:
            code = stack.health()
            saw_503 |= code == 503
            if code == 200 and stack.pids[name] != pid:
                break
            time.sleep(0.2)
        back = time.monotonic()
        kills.append({"part": name, "at_s": at - t0, "recovered_s": back - at, "saw_503": saw_503,
                      "healthy": stack.health() == 200, "window": (at, back)})
        progress(f"chaos: {name} back after {back - at:.1f} s")


# ------------------------------------------------------------------ report


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def memory_rows(samples: list[dict], warm_s: float) -> list[dict]:
    """Per process: RSS and fds at the warm mark and at the last sample under load (the same pid:
    a process restarted after the mark is measured from its own first sample)."""
    rows = []
    names = sorted({n for s in samples for n in s["procs"]})
    for name in names:
        seen = [(s["t"], s["procs"][name]) for s in samples if name in s["procs"] and s["procs"][name]["rss_mb"]]
        if not seen:
            continue
        last_t, last = seen[-1]
        same = [(t, p) for t, p in seen if p["pid"] == last["pid"]]
        warm = next(((t, p) for t, p in same if t >= warm_s), same[0])
        restarted = same[0][0] > warm_s
        rows.append({"process": name, "pid": last["pid"], "from_s": warm[0], "to_s": last_t,
                     "rss_from_mb": warm[1]["rss_mb"], "rss_to_mb": last["rss_mb"],
                     "growth": last["rss_mb"] / warm[1]["rss_mb"] - 1, "fds_from": warm[1]["fds"],
                     "fds_to": last["fds"], "restarted_after_mark": restarted})
    return rows


def summarize(cfg: SoakConfig, records: list[Record], samples: list[dict], kills: list[dict], end: dict) -> dict:
    ok = [r for r in records if r.outcome == "ok"]
    duration = cfg.seconds
    warm_s = min(120.0, duration / 5)
    outcomes = Counter(f"{r.kind}: {r.outcome}" for r in records)
    windows = [k.pop("window") for k in kills]
    overlaps = lambda r, a, b: r.start <= b + 1 and r.start + r.seconds >= a  # noqa: E731 (in flight or sent then)
    for k, (a, b) in zip(kills, windows):
        k["failed"] = dict(Counter(r.outcome for r in records if r.outcome not in EXPECTED and overlaps(r, a, b)))
    unexpected = [r for r in records if r.outcome not in EXPECTED
                  and not (r.outcome in CHAOS and any(overlaps(r, a, b) for a, b in windows))]
    for r in unexpected:
        r.start -= end["t0"]
    memory = memory_rows(samples, warm_s)
    grow = [m for m in memory if not m["restarted_after_mark"]]
    return {
        "requests": len(records), "outcomes": dict(sorted(outcomes.items())),
        "latency_s": {"p50": pct([r.seconds for r in ok], 0.5), "p99": pct([r.seconds for r in ok], 0.99)},
        "ttft_s": {"p50": pct([r.ttft for r in ok if r.ttft], 0.5), "p99": pct([r.ttft for r in ok if r.ttft], 0.99)},
        "throughput": {"completion_tokens_per_s": sum(r.tokens for r in records) / duration,
                       "ok_requests_per_s": len(ok) / duration},
        "memory": memory, "warm_mark_s": warm_s,
        "kv_samples_max_used": max((s["kv"]["kv_blocks_used"] for s in samples if s["kv"]), default=None),
        "kills": kills, "end": {k: v for k, v in end.items() if k != "t0"},
        "unexpected": [r.__dict__ for r in unexpected[:20]], "unexpected_count": len(unexpected),
        "targets": {
            "no unexpected failure (5xx but chaos)": not unexpected,
            "RSS growth < 5% from the warm mark": all(m["growth"] < 0.05 for m in grow),
            "KV blocks in use back to 0": end["kv_blocks_used"] == 0,
            "no segment of ours in /dev/shm at the end": end["shm_after_stop"] == 0,
            "no child left after stop": not end["children_left"],
            "every kill recovered": all(k["healthy"] for k in kills),
        },
    }


def print_report(report: dict) -> None:
    m, c, s = report["machine"], report["config"], report["summary"]
    print(f"\nsoak: {c['clients']} clients for {c['seconds']:.0f} s{' with chaos' if c['chaos'] else ''}; "
          f"{m['cpu']}, {m['threads']} threads, other load {m['foreign_load']:.0%}")
    print(f"\n{'requests by kind: outcome':<34} {'count':>6}")
    for k, v in s["outcomes"].items():
        print(f"{k:<34} {v:>6}")
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"\nok requests: latency p50 {fmt(s['latency_s']['p50'])} s, p99 {fmt(s['latency_s']['p99'])} s; "
          f"time to first token p50 {fmt(s['ttft_s']['p50'])} s, p99 {fmt(s['ttft_s']['p99'])} s")
    t = s["throughput"]
    print(f"throughput: {t['completion_tokens_per_s']:.1f} completion tokens/s, {t['ok_requests_per_s']:.2f} ok "
          f"requests/s")
    print(f"\n{'process':<10} {'pid':>8} {'from s':>7} {'to s':>6} {'RSS from MB':>12} {'RSS to MB':>10} "
          f"{'growth':>7} {'fds':>9}")
    for r in s["memory"]:
        note = " (restarted after the mark)" if r["restarted_after_mark"] else ""
        print(f"{r['process']:<10} {r['pid']:>8} {r['from_s']:>7.0f} {r['to_s']:>6.0f} {r['rss_from_mb']:>12.1f} "
              f"{r['rss_to_mb']:>10.1f} {r['growth']:>+7.1%} {r['fds_from']:>4}->{r['fds_to']:<4}{note}")
    e = s["end"]
    print(f"\nat the end: KV blocks in use {e['kv_blocks_used']} of {e['kv_blocks_total']} (at most "
          f"{s['kv_samples_max_used']} while loaded); our /dev/shm segments {e['shm_loaded']} while up, "
          f"{e['shm_after_stop']} after stop; launcher exit code {e['launcher_code']}; children left "
          f"{e['children_left'] or 'none'}")
    if s["kills"]:
        print(f"\n{'kill':<7} {'at s':>6} {'/health 200 after s':>20} {'503 seen':>9}  failed requests")
        for k in s["kills"]:
            print(f"{k['part']:<7} {k['at_s']:>6.0f} {k['recovered_s']:>20.1f} {str(k['saw_503']):>9}  "
                  f"{k['failed'] or 'none'}")
    for r in s["unexpected"][:5]:
        print(f"unexpected: {r['kind']} {r['outcome']} at {r['start']:.0f}: {r['detail']}")
    print()
    for name, met in s["targets"].items():
        print(f"target: {name}: {'MET' if met else 'MISSED'}")


# ------------------------------------------------------------------ main


def wait_idle(stack: Launcher, timeout: float = 60) -> dict:
    end = time.monotonic() + timeout
    while True:
        kv = kv_stats(stack.dense_port)
        if (kv and kv["kv_blocks_used"] == 0 and kv["running"] == 0) or time.monotonic() > end:
            return kv or {"kv_blocks_used": None, "kv_blocks_total": None}
        time.sleep(0.5)


def main(argv=None) -> None:
    cfg = parse_args(argv)
    shm_before = ours_in_shm()
    progress("starting the stack (tandem serve)")
    stack = Launcher(cfg)
    load = ForeignLoad()
    records: list[Record] = []
    kills: list[dict] = []
    try:
        stack.wait_ready()
        with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        progress(f"stack up ({model}); {cfg.clients} clients for {cfg.seconds:.0f} s")
        sampler = Sampler(stack, cfg.sample_every)
        t0 = time.monotonic()
        deadline = t0 + cfg.seconds
        threads = [threading.Thread(target=client_loop, args=(stack.url, model, cfg.seed * 1000 + i, deadline,
                                                              records)) for i in range(cfg.clients)]
        if cfg.chaos:
            threads.append(threading.Thread(target=chaos_loop, args=(stack, cfg.kill_every, deadline, kills, t0)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sampler.close()
        progress(f"load over: {len(records)} requests; waiting for the engine to go idle")
        kv = wait_idle(stack)
        shm_loaded = len(ours_in_shm() - shm_before)
        children = {n: p for n, p in stack.pids.items() if n != "launcher"}
    finally:
        code = stack.stop()
    left = [n for n, p in children.items() if alive(p)]
    end = {"t0": t0, "kv_blocks_used": kv["kv_blocks_used"], "kv_blocks_total": kv["kv_blocks_total"],
           "shm_loaded": shm_loaded, "shm_after_stop": len(ours_in_shm() - shm_before), "launcher_code": code,
           "children_left": left}
    report = {"machine": {**machine_info(cfg.threads), "foreign_load": load.share()}, "config": cfg.__dict__,
              "summary": summarize(cfg, records, sampler.rows, kills, end), "samples": sampler.rows}
    print_report(report)
    RESULTS.parent.mkdir(exist_ok=True)
    out = RESULTS.with_name("soak-chaos.json") if cfg.chaos else RESULTS
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {out}; the stack's log: {LOG}")


if __name__ == "__main__":
    main()
