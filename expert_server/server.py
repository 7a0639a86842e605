"""The expert service's gRPC servicer, health and reflection, and the drain on shutdown.

Domain errors become gRPC status codes here and nowhere else.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import logging
import os
import time
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from expert_server.config import ServerConfig
from services.common.grpc_defaults import SERVER_KEEPALIVE
from expert_server.drain import CallActivity, StreamActivity
from expert_server.executor import ExpertExecutor
from expert_server.native_compute import NativeCompute
from expert_server.shm_session import ShmSession
from expert_server.tracing import CallTracer
from services.common import shm_layout as shm
from services.common import wire
from services.common.errors import InvalidRequestError, TandemError
from services.common.grpc_status import abort
from tandem.v1 import expert_pb2 as pb
from tandem.v1 import expert_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(self, cfg: ServerConfig, model_type: str, top_k: int):
        self.cfg, self.model_type, self.top_k = cfg, model_type, top_k
        self.executor: ExpertExecutor | None = None
        self.compute: NativeCompute | None = None  # Compute's grpc++ server on a port of its own
        self.nbytes = 0
        self.draining = threading.Event()
        self.activity = CallActivity()
        self._sessions: set[ShmSession] = set()
        self._lock = threading.Lock()

    def ready(self, executor: ExpertExecutor, nbytes: int, compute: NativeCompute | None = None) -> None:
        self.executor, self.nbytes, self.compute = executor, nbytes, compute

    def _serving(self, context) -> ExpertExecutor:
        if self.executor is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the expert weights are still loading")
        if self.draining.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the expert server is shutting down")
        return self.executor

    def GetInfo(self, request, context):
        import tandem_native

        ex = self._serving(context)
        return pb.GetInfoResponse(
            model_type=self.model_type, layers=sorted(ex.layers), format=self.cfg.format,
            isa=tandem_native.active_isa(), threads=self.cfg.threads, memory_bytes=self.nbytes,
            hidden_size=ex.hidden, num_experts=ex.num_experts, top_k=self.top_k, host_id=shm.host_id(),
            max_tokens=self.cfg.max_tokens, compute_port=self.compute.port if self.compute else 0,
        )

    def Compute(self, request_iterator, context):
        ex = self._serving(context)
        calls = CallTracer(max(ex.layers))
        with self.activity.watch(StreamActivity()) as stream:
            for req in request_iterator:
                stream.begin()
                try:
                    yield self._compute(ex, calls, req, context)
                finally:  # runs once the answer has gone (or the stream was cancelled)
                    stream.end()

    def _compute(self, ex: ExpertExecutor, calls: CallTracer, req, context) -> pb.ComputeResponse:
        try:
            x = wire.decode("x", req.x, (pb.FLOAT32, pb.BFLOAT16), 2)
            ids = wire.decode("ids", req.ids, (pb.INT64,), 2)
            weights = wire.decode("weights", req.weights, (pb.FLOAT32,), 2)
            start = time.time_ns()
            out = ex.compute(req.layer, x, ids, weights)
            end = time.time_ns()
        except TandemError as exc:
            abort(context, exc)
        calls.record(req.traceparent, req.trace_each, req.layer, x.shape[0], start, end)
        response = pb.ComputeResponse(compute_s=(end - start) / 1e9)
        wire.encode(response.out, out, req.x.dtype)
        return response

    def OpenSession(self, request_iterator, context):
        ex = self._serving(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open: the first message must open the session")
        o = first.open
        if not 1 <= o.max_tokens <= self.cfg.max_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"max_tokens: {o.max_tokens} is outside [1, {self.cfg.max_tokens}]")
        try:
            segment = shm.Segment.attach(o.segment_name, o.byte_size, o.layout_version, o.max_tokens)
        except InvalidRequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        session = ShmSession(segment, ex, o.max_tokens, self.cfg.spin_us, StreamActivity())
        context.add_callback(session.stop)
        with self._lock:
            self._sessions.add(session)
        try:
            with self.activity.watch(session.activity):
                session.start()
                yield pb.SessionResponse(ready=pb.SessionReady(session_id=id(session)))
                for _ in request_iterator:  # nothing more is expected: this waits for the stream's end
                    pass
        finally:
            session.stop()
            with self._lock:
                self._sessions.discard(session)

    @property
    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def drain(self, deadline: float) -> None:
        """Refuses new streams and sessions, answers the open ones until they have all been quiet for
        QUIET_S (or deadline, time.monotonic()), then ends the sessions, each after its call in hand."""
        since = time.monotonic()
        self.draining.set()
        if self.compute is not None:
            self.compute.drain()
        if not self.activity.wait_quiet(since, deadline):
            log.warning("drain: streams not yet quiet at the end of the drain time; ending them")
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.stop()
        if self.compute is not None:
            self.compute.stop()


def credentials(cfg: ServerConfig):
    if cfg.tls_cert is None:
        return None
    return grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])


def build_server(cfg: ServerConfig, servicer: ExpertServicer) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server (health NOT_SERVING until weights are loaded) and its bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="expert-rpc"),
        maximum_concurrent_rpcs=60,
        options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                 *SERVER_KEEPALIVE],
    )
    pb_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    creds = credentials(cfg)
    port = server.add_secure_port(cfg.listen, creds) if creds else server.add_insecure_port(cfg.listen)
    if port == 0:
        raise OSError(f"--listen: cannot bind {cfg.listen}")
    server.start()
    log.info("expert server listening on %s (pid %d)", cfg.listen.rsplit(":", 1)[0] + f":{port}", os.getpid())
    return server, health_servicer, port


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        health_servicer.set(name, status)
