"""What do the packed formats cost in quality, against what llama.cpp's cost on the same model? One run:
perplexity of the built-in default model (SmolLM2-135M-Instruct as an equivalent Mixtral, from
services/launcher/default_model.py) on a fixed text, in every Tandem dense/expert format pair, and
llama.cpp's perplexity of the same checkpoint converted by its own convert_hf_to_gguf.py (bf16) and
quantized by llama_model_quantize (q8_0, q4_0, Q4_K_M), side by side.

The text is the docstrings of a fixed list of standard-library modules of the running Python (each
module's, then its public functions' and classes' in name order), tokenized once by our tokenizer;
both sides score the same token ids in the same non-overlapping windows of --context tokens.
llama.cpp runs in bench/.venv-llama (bench/setup_llama.sh, as for bench/e2e.py).

    python -m bench.quality [--context 512] [--max-tokens 16384] [--threads 2]

Target (the CPU-speed issue): the perplexity increase over bf16 of our int8 (dense and experts) no
larger than llama.cpp q8_0's over its bf16, and of our int4 no larger than q4_0's.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._machine import machine_info, progress
from bench.e2e import LlamaWorker, gguf_files

RESULTS = Path(__file__).resolve().parent / "results" / "quality.json"
MODULES = ("argparse", "collections", "contextlib", "dataclasses", "functools", "itertools", "json", "logging",
           "os", "pathlib", "re", "shutil", "string", "subprocess", "textwrap", "threading", "typing")
DENSE = ("float", "bf16", "int8", "int4")
EXPERTS = ("bf16", "int8", "int4")
LLAMA = ("bf16", "q8_0", "q4_0", "Q4_K_M")


@dataclass(frozen=True)
class BenchConfig:
    context: int
    max_tokens: int
    threads: int
    out: Path


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=16384, help="the text is cut to this many tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    if a.context < 2 or a.max_tokens < a.context or a.threads < 1:
        p.error("--context must be >= 2, --max-tokens >= --context, --threads >= 1")
    return BenchConfig(a.context, a.max_tokens, a.threads, a.out)


def text() -> str:
    """The fixed text: each module's docstring, then its public members' in name order."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or not (inspect.isfunction(member) or inspect.isclass(member)):
                continue
            if getattr(member, "__module__", None) == name and inspect.getdoc(member):
                parts.append(f"{member_name}: {inspect.getdoc(member)}")
    return "\n\n".join(p for p in parts if p)


def windows(tokens: list[int], context: int) -> list[list[int]]:
    return [tokens[i:i + context] for i in range(0, len(tokens) - 1, context) if len(tokens[i:i + context]) >= 2]


def tandem_nll(path: Path, dense: str, experts: str, tokens: list[int], context: int, threads: int) -> tuple[float, int]:
    """Summed negative log-likelihood of every window's tokens after its first, and their count."""
    from services.dense.loader import load_model, open_checkpoint
    from services.dense.moe.native import NativeExperts
    from services.dense.runtime import DenseRuntime

    checkpoint, cfg = open_checkpoint(path)
    model, _ = load_model(path, DenseRuntime("float32", "cpu", dense, threads), NativeExperts(cfg, checkpoint, experts, threads))
    nll, count = 0.0, 0
    for window in windows(tokens, context):
        ids = torch.tensor(window)
        logits = model.forward(ids, model.new_cache(len(window)))  # [T, V] float32
        nll += F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum").item()
        count += len(window) - 1
    return nll, count


def main(argv=None) -> None:
    from services.dense.tokenizer import Tokenizer
    from services.launcher.default_model import default_model

    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    path = default_model()
    tokens = Tokenizer(path).encode(text())[:cfg.max_tokens]
    progress(f"{len(tokens)} tokens of docstrings from {len(MODULES)} modules, windows of {cfg.context}")
    rows = []
    for dense in DENSE:
        for experts in EXPERTS:
            nll, count = tandem_nll(path, dense, experts, tokens, cfg.context, cfg.threads)
            rows.append({"who": "tandem", "dense": dense, "experts": experts, "ppl": math.exp(nll / count), "tokens": count})
            progress(f"tandem {dense}/{experts}: perplexity {rows[-1]['ppl']:.4f}")
    files = gguf_files(path, list(LLAMA), cfg.threads)
    for t in LLAMA:
        worker = LlamaWorker(files[t], cfg.threads, cfg.context, logits_all=True)
        try:
            got = worker.ask(cmd="perplexity", tokens=tokens, ctx=cfg.context)
        finally:
            worker.close()
        rows.append({"who": "llama.cpp", "type": t, "ppl": math.exp(got["nll"] / got["count"]), "tokens": got["count"]})
        progress(f"llama.cpp {t}: perplexity {rows[-1]['ppl']:.4f}")
    report = {"machine": machine_info(cfg.threads), "model": path.name, "context": cfg.context, "tokens": len(tokens),
              "modules": MODULES, "rows": rows, "targets": targets(rows)}
    print_report(report)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {cfg.out}")


def ppl(rows: list[dict], **key) -> float:
    return next(r["ppl"] for r in rows if all(r.get(k) == v for k, v in key.items()))


def targets(rows: list[dict]) -> dict:
    ours_bf16, theirs_bf16 = ppl(rows, who="tandem", dense="bf16", experts="bf16"), ppl(rows, who="llama.cpp", type="bf16")
    out = {}
    for ours, theirs in (("int8", "q8_0"), ("int4", "q4_0")):
        mine = ppl(rows, who="tandem", dense=ours, experts=ours) - ours_bf16
        peer = ppl(rows, who="llama.cpp", type=theirs) - theirs_bf16
        out[f"{ours} vs {theirs}"] = {"tandem_increase": mine, "llama_increase": peer, "holds": mine <= peer}
    return out


def print_report(report: dict) -> None:
    m, rows = report["machine"], report["rows"]
    print(f"\nCPU: {m['cpu']}; {report['model']}, {report['tokens']} tokens in windows of {report['context']}")
    print("\nTandem perplexity, dense format (rows) x expert format (columns)")
    print(f"{'':>8}" + "".join(f"{e:>10}" for e in EXPERTS))
    for d in DENSE:
        print(f"{d:>8}" + "".join(f"{ppl(rows, who='tandem', dense=d, experts=e):10.4f}" for e in EXPERTS))
    print("\nllama.cpp perplexity: " + ", ".join(f"{t} {ppl(rows, who='llama.cpp', type=t):.4f}" for t in LLAMA))
    print("\nincrease over bf16:")
    for name, t in report["targets"].items():
        print(f"  {name}: ours {t['tandem_increase']:+.4f}, llama.cpp {t['llama_increase']:+.4f}"
              f"  {'holds' if t['holds'] else 'MISSED'}")


if __name__ == "__main__":
    main()
