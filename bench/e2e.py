"""Is Tandem faster than llama.cpp end to end on the CPU? One run, the same checkpoints and threads,
rounds taking turns:

  pairs     the bench checkpoint (bench/checkpoint.py: qwen3_moe, hidden 2048, 64 experts top-8, 6
            layers): llama.cpp bf16 / q8_0 / q4_0 / Q4_K_M against Tandem in process with dense
            linears and experts in bf16 / int8 / int4 / int4 (native kernels, float32 activations):
            greedy decode tok/s after a 16-token prompt, and prefill tok/s of 512 tokens.
  stack     the same Tandem configurations through `make serve`'s stack (expert server over shared
            memory, dense service, gateway; tokens streamed over HTTP) against in process.
  mla       the `mla` bench checkpoint (deepseek_v3 with DeepSeek-V3's attention): decode after a
            2048-token prompt, llama.cpp q4_0 against Tandem int4 / int4 (absorbed MLA).
  combos    in-process decode of the candidate defaults (dense format x dtype, int4 experts): what
            the launcher should print as this machine's defaults.

llama.cpp is llama-cpp-python 0.3.36 built from its sdist for this CPU in bench/.venv-llama
(bench/setup_llama.sh, about 12 minutes on 2 cores, once); checkpoints are converted with the
sdist's own convert_hf_to_gguf.py (its vocabulary check answered "gpt-2": the tiny tokenizer is one
it does not know, and only token ids are timed) and quantized with llama_cpp.llama_model_quantize,
cached under .cache/bench-models/gguf/. Tandem decodes and prefills holding the CPU wake-up
latency request the dense service's engine holds while it has work (services/common/cpu_wake.py; in
process too, so the stack's ratio is the stack's own cost); the report says whether it could.

    python -m bench.e2e [--quick] [--threads 2] [--parts pairs,stack,mla,combos]

Targets (the CPU-speed issue): in process decode >= 1.0x llama.cpp for every pair, prefill >= 1.5x;
the stack's decode >= 0.9x in process; the MLA decode at 2048 tokens >= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench._machine import machine_info, progress
from bench._stream import streamed_rate
from bench.checkpoint import CACHE_ROOT, REPO, bench_checkpoint, mla_checkpoint
from services.common import cpu_wake

RESULTS = Path(__file__).resolve().parent / "results" / "e2e.json"
LLAMA_VERSION = "0.3.36"
VENV = REPO / "bench" / ".venv-llama"
LLAMA_CPP = REPO / ".cache" / "llama-cpp" / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
GGUF_ROOT = CACHE_ROOT / "gguf"
# (llama.cpp type, Tandem dense format, Tandem expert format)
PAIRS = [("bf16", "bf16", "bf16"), ("q8_0", "int8", "int8"), ("q4_0", "int4", "int4"), ("Q4_K_M", "int4", "int4")]
FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
# (dense format, dtype) candidates for the launcher's CPU defaults, all with int4 experts
COMBOS = [("float", "float32"), ("float", "bfloat16"), ("int8", "float32"), ("int8", "bfloat16"), ("int4", "float32"),
          ("int4", "bfloat16"), ("bf16", "float32")]
PARTS = ("pairs", "stack", "mla", "combos")
PROMPT, PREFILL, MLA_CONTEXT = 16, 512, 2048

CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece = base.TextModel._set_vocab_sentencepiece
def no_sentencepiece_model(self, *args, **kwargs):  # as the converter expects where there is none
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return sentencepiece(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = no_sentencepiece_model
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "bf16"]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""
QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, sys.argv[3])
p.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


@dataclass(frozen=True)
class BenchConfig:
    threads: int
    quick: bool
    parts: tuple[str, ...]
    rounds: int
    stack_rounds: int  # the stack's decode samples are short and this machine's speed drifts: more pairs
    decode_tokens: int
    out: Path


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round of fewer tokens (a smoke run)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    parts = tuple(x for x in a.parts.split(",") if x)
    if a.threads < 1 or not set(parts) <= set(PARTS):
        p.error(f"--threads must be >= 1 and --parts a subset of {', '.join(PARTS)}")
    return BenchConfig(a.threads, a.quick, parts, 1 if a.quick else 3, 1 if a.quick else 9, 16 if a.quick else 32, a.out)


# ------------------------------------------------------------------ llama.cpp: venv, GGUF files, worker


def llama_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists() or not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
        progress("setting up llama-cpp-python in bench/.venv-llama (a source build, about 12 minutes on 2 cores)")
        subprocess.run(["bash", str(REPO / "bench" / "setup_llama.sh")], check=True)
    return python


def gguf_files(model_dir: Path, types: list[str], threads: int) -> dict[str, Path]:
    """The checkpoint as llama.cpp's converter writes it (bf16) and quantized to each type; cached."""
    out = GGUF_ROOT / model_dir.name
    out.mkdir(parents=True, exist_ok=True)
    files = {"bf16": out / "bf16.gguf"}
    if not files["bf16"].exists():
        llama_python()  # the converter ships in the sdist the setup unpacks
        progress(f"converting {model_dir.name} with llama.cpp's convert_hf_to_gguf.py")
        tmp = files["bf16"].with_suffix(".tmp")
        converted = subprocess.run([sys.executable, "-c", CONVERT, str(LLAMA_CPP), str(model_dir), str(tmp)],
                                   capture_output=True, text=True)
        if converted.returncode:
            raise SystemExit(f"convert_hf_to_gguf.py failed on {model_dir}:\n{converted.stderr[-4000:]}")
        tmp.rename(files["bf16"])
    for t in types:
        if t == "bf16":
            continue
        files[t] = out / f"{t}.gguf"
        if not files[t].exists():
            progress(f"quantizing {model_dir.name} to {t} with llama_model_quantize")
            tmp = files[t].with_suffix(".tmp")
            subprocess.run([str(llama_python()), "-c", QUANTIZE, str(files["bf16"]), str(tmp), FTYPES[t], str(threads)],
                           check=True, capture_output=True)
            tmp.rename(files[t])
    return files


class LlamaWorker:
    """A llama.cpp model in a child of bench/.venv-llama (bench/_llama_worker.py)."""

    def __init__(self, path: Path, threads: int, context: int, logits_all: bool = False):
        worker = REPO / "bench" / "_llama_worker.py"
        args = [str(llama_python()), str(worker), str(path), str(threads), str(context)] + (["all"] if logits_all else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.proc.stdout.readline()).get("ready"):
            raise RuntimeError(f"llama.cpp worker for {path} did not start")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def decode(self, prompt: list[int], n: int) -> float:
        return self.ask(cmd="decode", prompt=prompt, tokens=n)["tok_s"]

    def prefill(self, prompt: list[int]) -> float:
        return self.ask(cmd="prefill", prompt=prompt)["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ------------------------------------------------------------------ Tandem in process


_EXPERTS: dict = {}  # (checkpoint, format) -> NativeExperts, shared by the models of a run


class TandemModel:
    """The model with native experts in this process, as `python -m services.dense --experts native` runs it."""

    def __init__(self, path: Path, dense_format: str, expert_format: str, dtype: str, threads: int):
        from services.dense.loader import load_model, open_checkpoint
        from services.dense.moe.native import NativeExperts
        from services.dense.runtime import DenseRuntime

        if (path, expert_format) not in _EXPERTS:
            checkpoint, cfg = open_checkpoint(path)
            _EXPERTS[path, expert_format] = NativeExperts(cfg, checkpoint, expert_format, threads)
        runtime = DenseRuntime(dtype, "cpu", dense_format, threads)
        self.model, _ = load_model(path, runtime, _EXPERTS[path, expert_format])

    def decode(self, prompt: list[int], n: int) -> float:
        m = self.model
        cache = m.new_cache(len(prompt) + n + 1)
        with cpu_wake.CpuWake():  # as the service's engine holds it while it has work
            logits = m.forward(torch.tensor(prompt), cache, last_only=True)
            t0 = time.perf_counter()
            for _ in range(n):
                logits = m.forward(logits.argmax(-1), cache, last_only=True)
            return n / (time.perf_counter() - t0)

    def prefill(self, prompt: list[int]) -> float:
        m = self.model
        cache = m.new_cache(len(prompt))
        with cpu_wake.CpuWake():
            t0 = time.perf_counter()
            m.forward(torch.tensor(prompt), cache, last_only=True)
            return len(prompt) / (time.perf_counter() - t0)


def prompt_ids(n: int, vocab: int = 500, seed: int = 0) -> list[int]:
    return [(7 * seed + 13 * j + j * j) % (vocab - 3) + 3 for j in range(n)]


# ------------------------------------------------------------------ Tandem through the stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TandemStack:
    """`tandem serve` (services/launcher) on the checkpoint: expert server, dense service, gateway."""

    def __init__(self, path: Path, dense_format: str, expert_format: str, dtype: str, threads: int):
        from services.launcher.__main__ import LaunchConfig
        from services.launcher.processes import Stack

        self.port = free_port()
        cfg = LaunchConfig(path, "127.0.0.1", self.port, expert_format, dtype, dense_format, threads,
                           served_model_name="bench")
        self.stack, self.stop_event = Stack(cfg), threading.Event()
        self.stack.start(self.stop_event)

    def decode(self, prompt: list[int], n: int) -> float:
        """Streamed greedy tokens over HTTP: tokens after the first over the time between them."""
        body = {"model": "bench", "prompt": prompt, "max_tokens": n + 1, "temperature": 0, "ignore_eos": True}
        return streamed_rate(self.port, body, n)

    def pids(self) -> dict[str, int]:
        """The stack's processes by part, and this one (the HTTP client) as "client"."""
        return {**{c.name: c.proc.pid for c in self.stack.children}, "client": os.getpid()}

    def close(self) -> None:
        self.stop_event.set()
        self.stack.stop()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process's threads have run so far (the scheduler's own count, in ns)."""
    out = {}
    for name, pid in pids.items():
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                continue
        out[name] = total / 1e9
    return out


def decode_with_cpu(stack: TandemStack, prompt: list[int], n: int) -> tuple[float, dict[str, float]]:
    """warm_decode through the stack, and the CPU milliseconds per decoded token each process ran,
    with the cores' capacity (the machine's cores x the time): the timed request's less the warm-up's
    (both prefill the same prompt) over the tokens between."""
    pids, short, runs = stack.pids(), 4, []
    for tokens in (short, n):
        before, started = cpu_seconds(pids), time.perf_counter()
        rate = stack.decode(prompt, tokens)
        wall, after = time.perf_counter() - started, cpu_seconds(pids)
        runs.append({**{name: after[name] - before[name] for name in pids}, "capacity": (os.cpu_count() or 1) * wall})
    (warm, timed), extra = runs, n - short
    return rate, {name: (timed[name] - warm[name]) * 1e3 / extra for name in timed}


# ------------------------------------------------------------------ the parts


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def rest() -> None:
    """A pause before each timed run, so that the threads the previous one left polling (ours, or
    llama.cpp's OpenMP workers) have gone to sleep and take no core from it."""
    time.sleep(0.5)


def warm_decode(runner, prompt: list[int], n: int) -> float:
    """A few tokens untimed, then the timed decode: neither side pays for waking its threads."""
    runner.decode(prompt, 4)
    return runner.decode(prompt, n)


def run_pairs(cfg: BenchConfig, models: dict) -> list[dict]:
    path = bench_checkpoint()
    files = gguf_files(path, [p[0] for p in PAIRS], cfg.threads)
    workers = {t: LlamaWorker(files[t], cfg.threads, PREFILL + 64) for t, _, _ in PAIRS}
    prompt, long_prompt = prompt_ids(PROMPT), prompt_ids(PREFILL, seed=1)
    results = {t: {"llama_decode": [], "llama_prefill": [], "tandem_decode": [], "tandem_prefill": []} for t, _, _ in PAIRS}
    try:
        for r in range(cfg.rounds):
            for t, dense, experts in PAIRS:
                ours, theirs, row = models[(dense, experts, "float32")], workers[t], results[t]
                first_llama = (r + PAIRS.index((t, dense, experts))) % 2 == 0
                for who in (("llama", "tandem") if first_llama else ("tandem", "llama")):
                    runner = theirs if who == "llama" else ours
                    rest()
                    row[f"{who}_decode"].append(warm_decode(runner, prompt, cfg.decode_tokens))
                    rest()
                    row[f"{who}_prefill"].append(runner.prefill(long_prompt))
                progress(f"round {r + 1}: {t} {row['llama_decode'][-1]:.1f} vs {dense}/{experts} "
                         f"{row['tandem_decode'][-1]:.1f} tok/s decode")
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for t, dense, experts in PAIRS:
        row = {k: med(v) for k, v in results[t].items()}
        rows.append({"llama": t, "dense": dense, "experts": experts, **row, "samples": results[t],
                     "decode_ratio": row["tandem_decode"] / row["llama_decode"],
                     "prefill_ratio": row["tandem_prefill"] / row["llama_prefill"]})
    return rows


def run_stack(cfg: BenchConfig, models: dict) -> list[dict]:
    path, prompt, rows = bench_checkpoint(), prompt_ids(PROMPT), []
    for dense, experts in dict.fromkeys((d, e) for _, d, e in PAIRS):
        progress(f"starting the stack with {dense} dense linears and {experts} experts")
        stack = TandemStack(path, dense, experts, "float32", cfg.threads)
        inproc, served, cpu = [], [], []
        try:
            for r in range(cfg.stack_rounds):
                for who in ("stack", "inprocess") if r % 2 == 0 else ("inprocess", "stack"):
                    rest()
                    if who == "stack":
                        rate, ms = decode_with_cpu(stack, prompt, cfg.decode_tokens)
                        served.append(rate)
                        cpu.append(ms)
                    else:
                        inproc.append(warm_decode(models[(dense, experts, "float32")], prompt, cfg.decode_tokens))
                progress(f"stack round {r + 1}: {dense}/{experts} {served[-1]:.1f} through the stack, "
                         f"{inproc[-1]:.1f} in process")
        finally:
            stack.close()
        rows.append({"dense": dense, "experts": experts, "stack_decode": med(served), "inprocess_decode": med(inproc),
                     "ratio": med([s / i for s, i in zip(served, inproc)]), "samples": {"stack": served, "inprocess": inproc},
                     "cpu_ms_per_token": {name: med([c[name] for c in cpu]) for name in cpu[0]}})
    return rows


def run_mla(cfg: BenchConfig) -> dict:
    path = mla_checkpoint()
    files = gguf_files(path, ["q4_0"], cfg.threads)
    ours = TandemModel(path, "int4", "int4", "float32", cfg.threads)
    theirs = LlamaWorker(files["q4_0"], cfg.threads, MLA_CONTEXT + 64)
    prompt, got = prompt_ids(MLA_CONTEXT, seed=2), {"llama": [], "tandem": []}
    try:
        for r in range(cfg.rounds):
            for who in (("llama", "tandem") if r % 2 == 0 else ("tandem", "llama")):
                rest()
                got[who].append(warm_decode(theirs if who == "llama" else ours, prompt, cfg.decode_tokens))
            progress(f"mla round {r + 1}: q4_0 {got['llama'][-1]:.1f} vs int4/int4 {got['tandem'][-1]:.1f} tok/s")
    finally:
        theirs.close()
    return {"llama": "q4_0", "dense": "int4", "experts": "int4", "context": MLA_CONTEXT, "llama_decode": med(got["llama"]),
            "tandem_decode": med(got["tandem"]), "ratio": med(got["tandem"]) / med(got["llama"]), "samples": got}


def run_combos(cfg: BenchConfig, models: dict) -> list[dict]:
    prompt, got = prompt_ids(PROMPT), {c: [] for c in COMBOS}
    for _ in range(cfg.rounds):
        for dense, dtype in COMBOS:
            rest()
            got[(dense, dtype)].append(warm_decode(models[(dense, "int4", dtype)], prompt, cfg.decode_tokens))
    return [{"dense": d, "experts": "int4", "dtype": t, "decode": med(got[(d, t)]), "samples": got[(d, t)]} for d, t in COMBOS]


def needed_models(cfg: BenchConfig) -> list[tuple[str, str, str]]:
    keys = []
    if {"pairs", "stack"} & set(cfg.parts):
        keys += [(d, e, "float32") for _, d, e in PAIRS]
    if "combos" in cfg.parts:
        keys += [(d, "int4", t) for d, t in COMBOS]
    return list(dict.fromkeys(keys))


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"\nCPU: {m['cpu']} ({', '.join(m['isa'])}), {report['threads']} threads")
    held = "held" if report.get("cpu_wake_held") else "not held (the device is not writable here)"
    print(f"CPU wake-up latency of 0 us while Tandem decodes, in process and through the stack alike: {held}")
    if "pairs" in report:
        print(f"\nin process, decode after a {PROMPT}-token prompt and prefill of {PREFILL} (tok/s, medians of "
              f"{report['rounds']} rounds)")
        print(f"{'llama.cpp':>10} {'tandem':>12} | {'decode':>8} {'ours':>8} {'ratio':>6} | {'prefill':>8} {'ours':>8} {'ratio':>6}")
        for r in report["pairs"]:
            print(f"{r['llama']:>10} {r['dense'] + '/' + r['experts']:>12} | {r['llama_decode']:8.1f} {r['tandem_decode']:8.1f} "
                  f"{r['decode_ratio']:6.2f} | {r['llama_prefill']:8.1f} {r['tandem_prefill']:8.1f} {r['prefill_ratio']:6.2f}")
    if "stack" in report:
        print("\nthrough the stack (expert server over shared memory, gateway over HTTP) against in process, decode tok/s"
              f" (medians of {report['stack_rounds']} rounds, each taking both in turn; ratio: the median of the rounds' ratios)")
        for r in report["stack"]:
            print(f"{r['dense'] + '/' + r['experts']:>12} | stack {r['stack_decode']:8.1f}  in process {r['inprocess_decode']:8.1f}"
                  f"  ratio {r['ratio']:5.2f}")
        print("CPU ms per decoded token through the stack (each process's threads together, spinning included), "
              "of the cores' capacity (the machine's cores x the time per token), and the in-process step's time")
        for r in report["stack"]:
            parts = "  ".join(f"{name} {ms:5.2f}" for name, ms in r["cpu_ms_per_token"].items())
            print(f"{r['dense'] + '/' + r['experts']:>12} | {parts}  | in-process step {1e3 / r['inprocess_decode']:5.2f}")
    if "mla" in report:
        r = report["mla"]
        print(f"\nMLA (deepseek_v3 bench), decode after {r['context']} tokens: llama.cpp {r['llama']} {r['llama_decode']:.1f}, "
              f"tandem {r['dense']}/{r['experts']} {r['tandem_decode']:.1f} tok/s, ratio {r['ratio']:.2f}")
    if "combos" in report:
        print("\ncandidate CPU defaults (int4 experts), in-process decode tok/s")
        best = max(report["combos"], key=lambda r: r["decode"])
        for r in report["combos"]:
            mark = "  <- fastest" if r is best else ""
            print(f"  --dense-format {r['dense']:<6} --dtype {r['dtype']:<9} {r['decode']:8.1f}{mark}")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    report: dict = {"machine": machine_info(cfg.threads), "threads": cfg.threads, "rounds": cfg.rounds,
                    "cpu_wake_held": cpu_wake.available(),
                    "stack_rounds": cfg.stack_rounds, "decode_tokens": cfg.decode_tokens}
    models = {}
    for key in needed_models(cfg):
        progress(f"loading Tandem with {key[0]} dense linears, {key[1]} experts, {key[2]} activations")
        models[key] = TandemModel(bench_checkpoint(), *key, cfg.threads)
    if "pairs" in cfg.parts:
        report["pairs"] = run_pairs(cfg, models)
    if "combos" in cfg.parts:
        report["combos"] = run_combos(cfg, models)
    if "stack" in cfg.parts:
        report["stack"] = run_stack(cfg, models)
    models.clear()
    _EXPERTS.clear()
    if "mla" in cfg.parts:
        report["mla"] = run_mla(cfg)
    print_report(report)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {cfg.out}")


if __name__ == "__main__":
    main()
