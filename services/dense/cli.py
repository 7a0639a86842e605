"""Generate text from a checkpoint: the dense path here, routed experts in process or on expert servers.

    python -m services.dense.cli --model DIR --prompt "Hello" [--max-tokens 64 --temperature 0]
    python -m services.dense.cli --model DIR --prompt "Hello" --experts remote --expert-servers HOST:PORT[,...]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import TandemError
from services.dense.generate import stream
from services.common.expert_weights import FORMATS, default_threads
from services.common.checkpoint import resolve_model
from services.dense.loader import load_model, open_checkpoint
from services.dense.moe.experts import ExpertBackend
from services.dense.moe.remote import GRPC_CLIENTS, TRANSPORTS, RemoteConfig, RemoteExperts
from services.dense.runtime import DENSE_FORMATS, DTYPES, DenseRuntime
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer


@dataclass(frozen=True)
class CliConfig:
    model: str
    prompt: str
    runtime: DenseRuntime
    sampling: SamplingParams
    experts: str  # "reference" (torch, float weights), "native" (tandem_native kernels) or "remote"
    expert_format: str
    threads: int
    remote: RemoteConfig | None = None  # expert servers, with --experts remote


def parse_args(argv: list[str] | None = None) -> CliConfig:
    p = argparse.ArgumentParser(prog="python -m services.dense.cli", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory, or a .gguf file (config and tokenizer from its metadata)")
    p.add_argument("--gguf", type=Path, help="weights from this GGUF file (the first of a split); --model DIR "
                   "then gives config.json and the tokenizer")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="activations, KV cache and float weights")
    p.add_argument("--dense-format", choices=list(DENSE_FORMATS), default="float",
                   help="dense linears: float (--dtype tensors) or a packed format for the native kernels (CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--experts", choices=["reference", "native", "remote"], default="native")
    p.add_argument("--expert-servers", help="comma-separated HOST:PORT of expert servers (--experts remote)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default="auto",
                   help="remote experts: shm (same host), grpc (inline), or auto")
    p.add_argument("--grpc-client", choices=list(GRPC_CLIENTS), default="auto",
                   help="inline gRPC client: native (grpc++, tandem_grpc), grpcio, or auto (native where built)")
    p.add_argument("--tls-root", type=Path, help="trust root (PEM) for expert servers using TLS")
    p.add_argument("--format", choices=list(FORMATS), default="bf16", help="routed-expert format (native)")
    p.add_argument("--threads", type=int, default=default_threads(), help="native kernel threads")
    a = p.parse_args(argv)
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    try:
        sampling = SamplingParams(a.temperature, a.top_p, a.top_k, a.seed, a.max_tokens)
        runtime = DenseRuntime(a.dtype, a.device, a.dense_format, a.threads)
        remote = None
        if a.experts == "remote":
            addresses = tuple(x for x in (a.expert_servers or "").split(",") if x)
            remote = RemoteConfig(addresses, a.transport, tls_root=a.tls_root, grpc_client=a.grpc_client)
        return CliConfig(resolve_model(a.model, a.gguf), a.prompt, runtime, sampling, a.experts, a.format, a.threads, remote)
    except TandemError as exc:
        p.error(str(exc))


def _experts(cfg: CliConfig) -> ExpertBackend | None:
    if cfg.experts == "reference":
        return None
    checkpoint, model_cfg = open_checkpoint(cfg.model)
    if cfg.remote is not None:
        return RemoteExperts(model_cfg, cfg.remote)
    from services.dense.moe.native import NativeExperts

    return NativeExperts(model_cfg, checkpoint, cfg.expert_format, cfg.threads)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    print(f"# {cfg}", file=sys.stderr)
    try:
        model, _ = load_model(cfg.model, cfg.runtime, _experts(cfg))
        tokenizer = Tokenizer(cfg.model)
        tokens: list[int] = []
        shown = ""
        for token in stream(model, tokenizer.encode(cfg.prompt), cfg.sampling, tokenizer.eos_token_ids):
            tokens.append(token)
            text = tokenizer.decode(tokens)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                print(text[len(shown):], end="", flush=True)
                shown = text
        print()
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
