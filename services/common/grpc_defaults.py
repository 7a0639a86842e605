"""gRPC core settings this project defaults to. They are read from the environment when gRPC core
starts, so apply() runs in the package __init__ of every part that uses gRPC, before grpc loads; a
value the user set is kept.

GRPC_EXPERIMENTS: grpcio 1.85's EventEngine endpoints (on by default) hand each read and write to
EventEngine threads; the iomgr endpoints they replace do the I/O in the polling thread. On the
2-core bench machine, one bidirectional-stream round trip of a 28 KB message between two processes
over loopback took 363-412 us p50 with iomgr against 446-529 us with EventEngine, and our inline
Compute path 617-778 us against 712-912 us (three alternating runs each). Channels, servers, TLS,
health and reflection behave the same; `GRPC_EXPERIMENTS=` (empty) restores grpcio's default.
"""

from __future__ import annotations

import logging
import os

from services.common.errors import ConfigError

log = logging.getLogger(__name__)

EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"

# Keepalive on the dense side's channels to expert servers: a link that goes quiet (a cable pulled,
# a host gone, packets dropped) ends the calls in flight with UNAVAILABLE after about
# KEEPALIVE_MS + KEEPALIVE_MS, well inside a call's deadline, instead of at the deadline. The expert
# servers accept pings that often, with or without calls (gRPC's default allows one per 5 minutes
# and closes the connection after two pings more).
KEEPALIVE_MS = 5000
CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
SERVER_KEEPALIVE = [("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0)]


def parse_port(flag: str, text: str) -> int | None:
    """A grpc++ server's port flag (--compute-port, --generate-port): a port number (0: any free one),
    or 'off' (None)."""
    if text == "off":
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{flag}: expected a port in [0, 65535] or 'off', got {text!r}")
    return port


def native_server(flag: str, port: int | None, what: str, listen: str) -> bool:
    """Whether to start the grpc++ server a port flag asks for (None: off). Where tandem_grpc was not
    built, an explicit port is a ConfigError and port 0 leaves `what` on listen's grpcio port."""
    if port is None:
        return False
    if native_grpc():
        return True
    if port:
        raise ConfigError(f"{flag} {port}: tandem_grpc was not built (grpc++ is not installed)")
    log.info("tandem_grpc not built: %s is served on %s only", what, listen)
    return False


def apply() -> None:
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)


def native_grpc() -> bool:
    """Whether tandem_grpc (the inline stream's grpc++ client and server, native/grpc) was built here."""
    try:
        import tandem_grpc  # noqa: F401
    except ImportError:
        return False
    return True
