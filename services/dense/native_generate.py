"""Generate's grpc++ server (tandem_grpc.GenerateServer, native/grpc/generate_server.cpp) on a port
of its own next to the grpcio server, which names it in GetModelInfo (generate_port).

Python opens each stream (DenseServicer.open_stream: the request checked and submitted, as the
grpcio Generate does) and the engine's thread pushes each response into it, serialized; the
stream's grpc++ thread writes them. A streamed token takes no grpcio thread and no GIL hand-off.
"""

from __future__ import annotations

import logging

from services.common.grpc_defaults import KEEPALIVE_MS, native_server
from services.dense.config import DenseConfig
from services.dense.server import DenseServicer

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 << 20
MAX_THREADS = 1024  # one a stream, and grpc++'s pollers: streams past it get RESOURCE_EXHAUSTED


def start(cfg: DenseConfig, servicer: DenseServicer):
    """The running tandem_grpc.GenerateServer, or None where it is off or tandem_grpc was not built
    (Generate is then served on --listen's port only); an explicit port without tandem_grpc is a
    ConfigError."""
    if not native_server("--generate-port", cfg.generate_port, "Generate", cfg.listen):
        return None
    import tandem_grpc

    host = cfg.listen.rsplit(":", 1)[0]
    try:
        server = tandem_grpc.GenerateServer(servicer.open_stream, f"{host}:{cfg.generate_port}", MAX_MESSAGE_BYTES,
                                            MAX_THREADS, KEEPALIVE_MS)
    except RuntimeError as exc:
        raise OSError(f"--generate-port: {exc}") from exc
    log.info("Generate (grpc++) listening on %s:%d", host, server.port)
    return server
