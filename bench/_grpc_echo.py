"""A gRPC server with one bidirectional streaming method that echoes raw bytes back: grpcio's own
round trip, with no protobuf and no Python of ours beyond yielding what came in. bench/transport.py
measures it as the floor under the inline gRPC path.

    python -m bench._grpc_echo    # prints "ready on port N" to stderr, serves until SIGTERM
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures

from services.common.grpc_defaults import apply as apply_grpc_defaults

apply_grpc_defaults()

import grpc  # noqa: E402 (after the defaults: gRPC core reads them when it starts)

METHOD = "/tandem.bench.Echo/Stream"


def _identity(b: bytes) -> bytes:
    return b


def _echo(requests, context):
    yield from requests


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 256 << 20),
                                  ("grpc.max_send_message_length", 256 << 20)])
    service, method = METHOD.strip("/").split("/")
    handler = grpc.stream_stream_rpc_method_handler(_echo, _identity, _identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"grpc echo ready on port {port}", file=sys.stderr, flush=True)
    stop.wait()
    server.stop(1).wait()


if __name__ == "__main__":
    main()
