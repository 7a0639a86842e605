"""The inline Compute stream's grpc++ server (tandem_grpc.ComputeServer, native/grpc/compute_server.cpp)
on a port of its own next to the grpcio server, which names it in GetInfo (compute_port).

No Python runs on its per-call path: it checks each call and runs it on the native Executor in its
own thread. What Python keeps for these calls runs beside them: the drain polls the server's activity
like any stream's, and a thread turns the traced calls' records into the same spans the grpcio
Compute makes (CallTracer, one per stream).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from expert_server.config import ServerConfig
from expert_server.drain import CallActivity, quiet
from expert_server.executor import ExpertExecutor
from expert_server.tracing import CallTracer
from services.common.grpc_defaults import KEEPALIVE_MS, native_server

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 256 << 20
MAX_THREADS = 64  # one a stream, and grpc++'s pollers


class NativeActivity:
    """The grpc++ server's calls, seen by a drain as one stream (drain.StreamActivity's quiet())."""

    def __init__(self, server):
        self.server = server

    def quiet(self, now: float, since: float, quiet_s: float) -> bool:
        busy, last_end = self.server.activity()
        return quiet(busy, last_end, now, since, quiet_s)


class NativeCompute:
    def __init__(self, cfg: ServerConfig, executor: ExpertExecutor, activity: CallActivity):
        import tandem_grpc

        host = cfg.listen.rsplit(":", 1)[0]
        cert = cfg.tls_cert.read_text() if cfg.tls_cert else ""
        key = cfg.tls_key.read_text() if cfg.tls_key else ""
        try:
            self.server = tandem_grpc.ComputeServer(executor.native, f"{host}:{cfg.compute_port}", cert, key,
                                                    MAX_MESSAGE_BYTES, MAX_THREADS, KEEPALIVE_MS)
        except RuntimeError as exc:
            raise OSError(f"--compute-port: {exc}") from exc
        self.port = self.server.port
        self._last_layer = max(executor.layers)
        self._watch = contextlib.ExitStack()
        self._watch.enter_context(activity.watch(NativeActivity(self.server)))
        self._spans = threading.Thread(target=self._trace, name="compute-spans", daemon=True)
        self._spans.start()
        log.info("Compute (grpc++) listening on %s:%d", host, self.port)

    def _trace(self) -> None:
        tracers: dict[int, CallTracer] = {}
        while (records := self.server.records(1.0)) is not None:
            for stream, traceparent, each, layer, tokens, start_ns, end_ns in records:
                if not traceparent:  # that stream ended
                    tracers.pop(stream, None)
                    continue
                tracer = tracers.setdefault(stream, CallTracer(self._last_layer))
                tracer.record(traceparent, each, layer, tokens, start_ns, end_ns)

    def drain(self) -> None:
        """No new streams; the open ones are answered until stop()."""
        self.server.drain()

    def stop(self) -> None:
        self.server.stop(0.0)
        self._watch.close()
        self._spans.join(5.0)
        if self.server.dropped_records:
            log.warning("tracing: %d traced calls got no span (their records outran the span thread)",
                        self.server.dropped_records)


def start(cfg: ServerConfig, executor: ExpertExecutor, activity: CallActivity) -> NativeCompute | None:
    """The grpc++ Compute server, or None where it is off or tandem_grpc was not built (Compute is then
    served on --listen's port only); an explicit port without tandem_grpc is a ConfigError."""
    if not native_server("--compute-port", cfg.compute_port, "Compute", cfg.listen):
        return None
    return NativeCompute(cfg, executor, activity)
