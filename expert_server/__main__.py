"""python -m expert_server [serve] --model DIR ...   |   python -m expert_server convert --model DIR --out FILE ...

The one place flags (and the environment) are read; everything below gets the frozen ServerConfig.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from expert_server import store
from expert_server.config import ServerConfig, parse_layers
from services.common import telemetry
from services.common.checkpoint import resolve_model
from services.common.errors import TandemError
from services.common.expert_weights import DEFAULT_GROUP_SIZE, FORMATS, default_threads
from services.common.grpc_defaults import parse_port


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory, or a .gguf file (config and tokenizer from its metadata)")
    p.add_argument("--gguf", type=Path, help="weights from this GGUF file (the first of a split); --model DIR "
                   "then gives config.json and the tokenizer")
    p.add_argument("--format", choices=FORMATS, default="int4", help="expert weight format (default int4)")
    p.add_argument("--layers", help="layer range A-B (inclusive) this server owns; default all. A comma list "
                   "of ranges with --shard N: the N-th (a StatefulSet's pod index)")
    p.add_argument("--shard", type=int, help="which range of a --layers list this server owns")
    p.add_argument("--threads", type=int, default=default_threads(), help="kernel threads (default: physical cores)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="quantization group size")


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m expert_server", description="Serve routed experts over gRPC.")
    _common(p)
    p.add_argument("--listen", default="127.0.0.1:50061", help="host:port to listen on (port 0: any free port)")
    p.add_argument("--store", type=Path, help="a packed store written by `convert` (memory-mapped)")
    p.add_argument("--max-tokens", type=int, default=8192, help="most tokens per call")
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM); with --tls-key enables TLS")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--drain-seconds", type=float, default=10.0, help="the longest SIGTERM keeps answering open streams before it ends them (it ends them sooner once all are quiet)")
    p.add_argument("--spin-us", type=float, default=50.0,
                   help="microseconds a shared-memory session spins for the next layer call before sleeping "
                        "(default 50; on a host with cores to spare, a few thousand keeps the futex wake-up, "
                        "tens of microseconds, off every layer call of a decode step)")
    p.add_argument("--compute-port", default="0",
                   help="port of the inline Compute stream's grpc++ server, on --listen's host (default 0: any "
                        "free port; GetInfo tells clients which); 'off': Compute on --listen's port only")
    p.add_argument("--echo", action="store_true", help="return x unchanged (transport benchmarks only)")
    return p


def convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m expert_server convert",
                                description="Quantize and pack routed experts into a store to map at start.")
    _common(p)
    p.add_argument("--out", type=Path, required=True, help="the store file to write")
    return p


def serve(args: argparse.Namespace) -> int:
    from expert_server.app import start

    cfg = ServerConfig(
        model=resolve_model(args.model, args.gguf), format=args.format, layers=parse_layers(args.layers, args.shard), threads=args.threads,
        listen=args.listen, store=args.store, group_size=args.group_size, max_tokens=args.max_tokens,
        tls_cert=args.tls_cert, tls_key=args.tls_key, echo=args.echo, drain_s=args.drain_seconds,
        spin_us=args.spin_us, compute_port=parse_port("--compute-port", args.compute_port),
    )
    print(f"expert server config: {cfg}", file=sys.stderr, flush=True)
    telemetry.setup("tandem-expert-server", telemetry.TracingConfig.from_env(os.environ))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    running = start(cfg)
    print(f"expert server ready on port {running.port}", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    print("expert server draining", file=sys.stderr, flush=True)
    running.stop(cfg.drain_s)
    telemetry.shutdown()
    return 0


def convert(args: argparse.Namespace) -> int:
    import tandem_native

    from services.common.checkpoint import Checkpoint
    from services.common.model_config import parse_model_config

    checkpoint = Checkpoint(resolve_model(args.model, args.gguf))
    model_cfg = parse_model_config(checkpoint.config)
    layers = store.moe_layers(model_cfg, parse_layers(args.layers, args.shard))
    print(f"converting {len(layers)} MoE layers of {checkpoint.dir} ({checkpoint.source.kind}) to {args.format}",
          file=sys.stderr, flush=True)
    report = store.convert(checkpoint, model_cfg, layers, args.format, args.group_size,
                           tandem_native.ThreadPool(args.threads), args.out)
    print(f"wrote {args.out}: {len(layers)} layers in {args.format}; {report}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if argv[:1] == ["convert"]:
            return convert(convert_parser().parse_args(argv[1:]))
        return serve(serve_parser().parse_args(argv[1:] if argv[:1] == ["serve"] else argv))
    except (TandemError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
