"""What does structured output cost? Greedy decode tokens/s of a request constrained by a JSON schema
against the same request free, and of a free request whose batch-mate is constrained against one
whose batch-mate is free, through `make serve`'s stack on the bench checkpoint (int4 dense linears
and experts, 2 threads), in rounds that take turns.

    python -m bench.structured [--rounds 5] [--tokens 96] [--threads 2] [--out F]

Targets (the agent-API issue): constrained at least 0.9x free; a free batch-mate loses nothing
measurable (its ratio within the run-to-run noise of the free pair).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from bench._machine import ForeignLoad, machine_info, progress
from bench._stream import streamed_rate
from bench.checkpoint import bench_checkpoint
from bench.e2e import TandemStack

RESULTS = Path(__file__).resolve().parent / "results" / "structured.json"
VOCAB = 500
# Long enough never to end before the timed tokens: at least 400 short strings.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 400,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["items"], "additionalProperties": False}


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * j + j * j) % (VOCAB - 3) + 3 for j in range(n)]


def decode(port: int, ids: list[int], n: int, constrained: bool) -> float:
    """Streamed greedy tokens/s after the first."""
    body = {"model": "bench", "prompt": ids, "max_tokens": n + 1, "temperature": 0}
    body.update({"guided_json": SCHEMA} if constrained else {"ignore_eos": True})
    return streamed_rate(port, body, n)


def beside(port: int, ids: list[int], n: int, mate_constrained: bool) -> float:
    """A free request's tokens/s while a longer batch-mate (constrained or not) decodes beside it."""
    mate = threading.Thread(target=decode, args=(port, prompt(99, 16), n * 2, mate_constrained))
    mate.start()
    time.sleep(0.3)  # the mate is decoding by the time the timed request starts
    try:
        return decode(port, ids, n, False)
    finally:
        mate.join()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    progress("starting the stack (int4 dense linears and experts)")
    stack = TandemStack(bench_checkpoint(), "int4", "int4", "float32", a.threads)
    rows = {"free": [], "constrained": [], "mate_free": [], "mate_constrained": []}
    load = ForeignLoad()
    try:
        for constrained in (True, False):  # first-use costs (the grammar tokenizer) and warm-up
            decode(stack.port, prompt(10**6, 16), a.tokens, constrained)
        for r in range(a.rounds):
            ids = prompt(r, 16)
            order = [("free", False), ("constrained", True)]
            for name, constrained in order if r % 2 == 0 else order[::-1]:
                rows[name].append(decode(stack.port, ids, a.tokens, constrained))
            order = [("mate_free", False), ("mate_constrained", True)]
            for name, constrained in order if r % 2 == 0 else order[::-1]:
                rows[name].append(beside(stack.port, ids, a.tokens, constrained))
            progress(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()))
    finally:
        stack.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {"machine": machine_info(a.threads), "tokens": a.tokens, "rounds": a.rounds, "tok_per_s": med,
              "constrained_ratio": med["constrained"] / med["free"],
              "batch_mate_ratio": med["mate_constrained"] / med["mate_free"],
              "foreign_cpu_share": load.share(), "samples": rows}
    m = report["machine"]
    print(f"\nCPU: {m.get('cpu', '?')}, {a.threads} threads; other processes took {report['foreign_cpu_share']:.1%} "
          "of the CPUs")
    print(f"greedy decode tok/s, median of {a.rounds} rounds ({a.tokens} tokens each):")
    print(f"  alone:        free {med['free']:7.1f}   JSON-schema constrained {med['constrained']:7.1f}   "
          f"x{report['constrained_ratio']:.3f} (target >= 0.9: "
          f"{'met' if report['constrained_ratio'] >= 0.9 else 'MISSED'})")
    print(f"  a free request beside a free mate {med['mate_free']:7.1f}, beside a constrained mate "
          f"{med['mate_constrained']:7.1f}   x{report['batch_mate_ratio']:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
