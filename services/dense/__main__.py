"""python -m services.dense --model DIR [--experts native|reference|remote ...] --listen HOST:PORT

The one place flags are read; everything below gets the frozen DenseConfig.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from services.common import telemetry
from services.common.errors import TandemError
from services.common.telemetry import TracingConfig
from services.common.expert_weights import FORMATS, default_threads
from services.common.checkpoint import resolve_model
from services.common.grpc_defaults import parse_port
from services.dense.config import EXPERTS, DenseConfig
from services.dense.moe.remote import GRPC_CLIENTS, TRANSPORTS, RemoteConfig
from services.dense.runtime import DENSE_FORMATS, DTYPES, DenseRuntime


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.dense", description="Serve a MoE model over gRPC.")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory, or a .gguf file (config and tokenizer from its metadata)")
    p.add_argument("--gguf", type=Path, help="weights from this GGUF file (the first of a split); --model DIR "
                   "then gives config.json and the tokenizer")
    p.add_argument("--listen", default="127.0.0.1:50051", help="host:port (port 0: any free port)")
    p.add_argument("--generate-port", default="0",
                   help="port of Generate's grpc++ server, on --listen's host (default 0: any free port; GetModelInfo "
                        "tells clients which); 'off': Generate on --listen's port only")
    p.add_argument("--served-model-name", default="", help="the name clients use (default: the directory's)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="activations, KV cache and float weights")
    p.add_argument("--dense-format", choices=list(DENSE_FORMATS), default="float",
                   help="dense linears (attention, shared experts, dense MLPs, lm_head): float (--dtype tensors) or a "
                        "packed format computed by the native kernels on the CPU")
    p.add_argument("--experts", choices=list(EXPERTS), default="native",
                   help="routed experts: native (C++ kernels here), reference (PyTorch) or remote (expert servers)")
    p.add_argument("--format", choices=list(FORMATS), default="int4", help="expert format with --experts native")
    p.add_argument("--threads", type=int, default=default_threads(), help="native kernel threads")
    p.add_argument("--expert-servers", help="comma-separated HOST:PORT of expert servers (--experts remote)")
    p.add_argument("--transport", choices=list(TRANSPORTS), default="auto")
    p.add_argument("--grpc-client", choices=list(GRPC_CLIENTS), default="auto",
                   help="inline gRPC client: native (grpc++, tandem_grpc), grpcio, or auto (native where built)")
    p.add_argument("--tls-root", type=Path, help="trust root (PEM) for expert servers using TLS")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV cache size in tokens (default: from the fraction)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.2, help="of free device memory for the KV cache")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (decodes + prompt chunks)")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoding at once")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for KV space before refusals")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep full KV blocks and reuse them for prompts that share a prefix (default: on)")
    p.add_argument("--keep-cpus-awake", action=argparse.BooleanOptionalAction, default=True,
                   help="while requests run, hold the CPUs' wake-up latency at 0 us (/dev/cpu_dma_latency, where "
                        "writable), so idle CPUs poll instead of halting between the hand-offs to a co-located "
                        "expert server (default: on)")
    return p


def runtime(a) -> DenseRuntime:
    return DenseRuntime(a.dtype, a.device, a.dense_format, a.threads)


def config(argv: list[str]) -> DenseConfig:
    a = parser().parse_args(argv)
    remote = None
    if a.experts == "remote":
        addresses = tuple(x for x in (a.expert_servers or "").split(",") if x)
        remote = RemoteConfig(addresses, a.transport, tls_root=a.tls_root, grpc_client=a.grpc_client)
    return DenseConfig(
        model=resolve_model(a.model, a.gguf), runtime=runtime(a), experts=a.experts, expert_format=a.format,
        threads=a.threads, remote=remote, kv_tokens=a.kv_tokens, kv_memory_fraction=a.kv_memory_fraction,
        block_size=a.block_size, max_batch_tokens=a.max_batch_tokens, max_running=a.max_running,
        max_queue=a.max_queue, prefix_caching=a.prefix_caching, keep_cpus_awake=a.keep_cpus_awake, listen=a.listen,
        generate_port=parse_port("--generate-port", a.generate_port), served_model_name=a.served_model_name,
        tracing=TracingConfig.from_env(os.environ),
    )


def main(argv: list[str]) -> int:
    from services.dense.app import start

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config(argv)
        print(f"dense service config: {cfg}", file=sys.stderr, flush=True)
        telemetry.setup("tandem-dense", cfg.tracing)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        running = start(cfg)
    except (TandemError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"dense service ready on port {running.port}", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    running.stop(5.0)
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
