"""A llama.cpp model behind stdin/stdout, run by bench/e2e.py in its llama-cpp-python venv.

One JSON command per line in, one JSON answer per line out:
  {"cmd": "decode", "prompt": [ids], "tokens": N}  greedy N tokens after the prompt: {"tok_s", "tokens"}
  {"cmd": "prefill", "prompt": [ids]}              the prompt in one batch: {"tok_s"}
  {"cmd": "perplexity", "tokens": [ids], "ctx": C} mean negative log-likelihood over windows: {"nll", "count"}

    python bench/_llama_worker.py MODEL.gguf THREADS CONTEXT
"""

import json
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama


def load(path: str, threads: int, ctx: int, logits_all: bool = False) -> Llama:
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512, n_ubatch=512,
                 logits_all=logits_all, verbose=False)


def last_logits(llm: Llama) -> np.ndarray:
    """The last evaluated token's logits (without logits_all, Llama.scores is not written)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def decode(llm: Llama, prompt: list[int], n: int) -> dict:
    llm.reset()
    llm.eval(prompt)
    out = []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(last_logits(llm)))
        out.append(tok)
        llm.eval([tok])
    took = time.perf_counter() - t0
    return {"tok_s": n / took, "tokens": out}


def prefill(llm: Llama, prompt: list[int]) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    return {"tok_s": len(prompt) / (time.perf_counter() - t0)}


def perplexity(llm: Llama, tokens: list[int], ctx: int) -> dict:
    """Non-overlapping windows of ctx tokens, each scored from its second token on."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, ctx):
        window = tokens[start:start + ctx]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(window) - 1), window[1:]].sum())
        count += len(window) - 1
    return {"nll": nll, "count": count}


def main() -> None:
    path, threads, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    logits_all = len(sys.argv) > 4 and sys.argv[4] == "all"
    llm = load(path, threads, ctx, logits_all)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "decode":
            answer = decode(llm, cmd["prompt"], cmd["tokens"])
        elif cmd["cmd"] == "prefill":
            answer = prefill(llm, cmd["prompt"])
        elif cmd["cmd"] == "perplexity":
            answer = perplexity(llm, cmd["tokens"], cmd["ctx"])
        else:
            answer = {"error": f"unknown command {cmd['cmd']!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
