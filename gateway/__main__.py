"""python -m gateway --dense HOST:PORT[,HOST:PORT...] [--host H --port P --api-key K]

The one place flags are read. SIGTERM (uvicorn's) stops accepting, lets in-flight requests finish
within --drain-seconds, then exits. uvicorn runs on uvloop and httptools (its "standard" set): 18%
less gateway CPU per streamed token than asyncio's loop and h11 (bench/gateway.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.parsing.output import REASONING_PARSERS, TOOL_PARSERS
from services.common import telemetry
from services.common.errors import ConfigError
from services.common.telemetry import TracingConfig


def config(argv: list[str]) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description="OpenAI-compatible HTTP gateway.")
    p.add_argument("--dense", default="127.0.0.1:50051", help="the dense service's gRPC address; several, comma-separated: each request goes to the "
                   "least-loaded healthy one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require this bearer key (default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--drain-seconds", type=float, default=30.0)
    p.add_argument("--tool-parser", default="auto", help=f"tool-call format: {', '.join(TOOL_PARSERS)} "
                                                         "(auto: recognised from the chat template)")
    p.add_argument("--reasoning-parser", default="auto", help=f"{', '.join(REASONING_PARSERS)} (auto: split "
                                                              "<think> when the chat template writes it)")
    a = p.parse_args(argv)
    return GatewayConfig(dense=a.dense, host=a.host, port=a.port, api_key=a.api_key or None,
                         max_body_bytes=a.max_body_bytes, drain_s=a.drain_seconds, tool_parser=a.tool_parser,
                         reasoning_parser=a.reasoning_parser,
                         tracing=TracingConfig.from_env(os.environ))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = {k: ("***" if k == "api_key" and v else v) for k, v in vars(cfg).items()}
    print(f"gateway config: {shown}", file=sys.stderr, flush=True)
    telemetry.setup("tandem-gateway", cfg.tracing)
    uvicorn.run(build_app(cfg), host=cfg.host, port=cfg.port, timeout_graceful_shutdown=int(cfg.drain_s),
                log_level="info", loop="uvloop", http="httptools")
    telemetry.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
