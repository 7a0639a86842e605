"""The remote expert backend: one or more expert servers, each owning a range of MoE layers.

Each layer goes to its owner over shared memory (same host) or inline gRPC (any host). A server
that went away fails the call in hand with UNAVAILABLE; the next call reconnects.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from opentelemetry import trace

from services.common import shm_layout as shm
from services.common import telemetry
from services.common.errors import ConfigError, ExpertBackendError
from services.common.grpc_defaults import CLIENT_KEEPALIVE
from services.common.model_config import ModelConfig
from services.dense.moe.experts import ExpertBackend
from services.dense.moe.transport import ShmTransport, inline_transport, native_grpc, rpc_error
from services.dense.pool import park_pools, unpark_pools
from tandem.v1 import expert_pb2 as pb
from tandem.v1 import expert_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("tandem.dense.experts")
TRANSPORTS = ("auto", "shm", "grpc")
GRPC_CLIENTS = ("auto", "native", "grpcio")  # the inline stream's client: grpc++ (tandem_grpc) or grpcio
# a restarted server is found again within about a second, not after gRPC's default backoff of minutes
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
    *CLIENT_KEEPALIVE,
]


@dataclass(frozen=True)
class RemoteConfig:
    addresses: tuple[str, ...]
    transport: str = "auto"        # auto: shared memory when the server is on this host
    timeout_s: float = 120.0       # per layer call
    connect_timeout_s: float = 30.0
    tls_root: Path | None = None   # trust root (PEM) for servers that use TLS
    max_tokens: int = 4096         # shared-memory session capacity (tokens per call)
    spin_us: float = 50.0
    grpc_client: str = "auto"      # auto: grpc++ where tandem_grpc was built, else grpcio

    def __post_init__(self):
        if not self.addresses:
            raise ConfigError("--expert-servers: at least one address is needed")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--transport: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.grpc_client not in GRPC_CLIENTS:
            raise ConfigError(f"--grpc-client: expected one of {', '.join(GRPC_CLIENTS)}, got {self.grpc_client!r}")
        if self.grpc_client == "native" and not native_grpc():
            raise ConfigError("--grpc-client native: tandem_grpc was not built (grpc++ is not installed here)")


class ExpertServerClient:
    """One expert server: its info, and a transport (re)opened on demand."""

    def __init__(self, address: str, rc: RemoteConfig):
        self.address, self.rc = address, rc
        if rc.tls_root is not None:
            creds = grpc.ssl_channel_credentials(rc.tls_root.read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ExpertServiceStub(self.channel)
        try:
            self.info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=rc.connect_timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConfigError(f"expert server {address}: not reachable within {rc.connect_timeout_s:g} s") from exc
            raise ConfigError(f"expert server {address}: {exc.details() or exc.code().name}") from exc
        self.use_shm = rc.transport == "shm" or (rc.transport == "auto" and self.info.host_id == shm.host_id())
        self.capacity = min(rc.max_tokens, self.info.max_tokens)
        self._transport = None
        self._info_stale = False  # once a transport was opened: a reconnect asks for the info again
        self._lock = threading.Lock()

    def transport(self, layer: int):
        if self._transport is not None and not self._transport.dead.is_set():
            return self._transport
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._transport = self._open(layer)
        return self._transport

    def _open(self, layer: int):
        if not self.use_shm:
            try:
                return self._inline()
            except ExpertBackendError as exc:
                raise ExpertBackendError(layer, exc.cause, exc.code) from exc
        try:
            return ShmTransport(self.stub, self.info.hidden_size, self.info.top_k, self.capacity,
                                self.rc.spin_us, self.rc.timeout_s, self.rc.connect_timeout_s)
        except ExpertBackendError as exc:
            if self.rc.transport == "shm" or exc.code == "UNAVAILABLE":
                raise ExpertBackendError(layer, exc.cause, exc.code) from exc
            log.warning("expert server %s: shared memory refused (%s); using inline gRPC", self.address, exc.cause)
            self.use_shm = False
            return self._inline()

    def _inline(self):
        rc = self.rc
        root = rc.tls_root.read_bytes() if rc.tls_root is not None else None
        native = {"auto": None, "native": True, "grpcio": False}[rc.grpc_client]
        address = self._compute_address() if native is not False and native_grpc() else self.address
        return inline_transport(self.stub, rc.timeout_s, address, root, rc.connect_timeout_s, native)

    def _compute_address(self) -> str:
        """Where the grpc++ client opens its stream: the server's own grpc++ Compute port when it has
        one (asked anew on a reconnect, as a restarted server may have another), else its address."""
        if self._info_stale:
            try:
                self.info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.rc.connect_timeout_s)
            except grpc.RpcError as exc:
                raise rpc_error(-1, exc) from exc
        self._info_stale = True
        port = self.info.compute_port
        return f"{self.address.rsplit(':', 1)[0]}:{port}" if port else self.address

    def serving(self, timeout_s: float = 1.0) -> bool:
        """Whether the server answers its grpc.health.v1 check with SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            status = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return status.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self.channel.close()


def _new_stats() -> dict:
    return {"calls": 0, "bytes": 0, "expert_s": 0.0, "transport_s": 0.0}


class RemoteExperts(ExpertBackend):
    def __init__(self, cfg: ModelConfig, rc: RemoteConfig, trace_each: bool = False):
        self.cfg, self.trace_each = cfg, trace_each  # trace_each: a span per layer call
        self._step = _new_stats()
        self.servers = [ExpertServerClient(address, rc) for address in rc.addresses]
        self.owner: dict[int, ExpertServerClient] = {}
        for server in self.servers:
            self._check(server)
            for layer in server.info.layers:
                if layer in self.owner:
                    raise ConfigError(f"layer {layer} is served by both {self.owner[layer].address} and {server.address}")
                self.owner[layer] = server
        missing = [i for i in range(cfg.num_layers) if cfg.is_moe(i) and i not in self.owner]
        if missing:
            raise ConfigError(f"no expert server owns MoE layers {missing}")

    def _check(self, server: ExpertServerClient) -> None:
        info, cfg = server.info, self.cfg
        if (info.hidden_size, info.num_experts) != (cfg.hidden_size, cfg.moe.num_experts):
            raise ConfigError(
                f"expert server {server.address} serves hidden {info.hidden_size} x {info.num_experts} experts, "
                f"the model has hidden {cfg.hidden_size} x {cfg.moe.num_experts} experts"
            )

    def submit(self, layer, x, ids, weights):
        server = self._owner(layer)
        if x.shape[0] > server.capacity:  # over a call's capacity: run it in pieces, one after the other
            parts = [self.forward(layer, *chunk) for chunk in zip(*(
                t.split(server.capacity) for t in (x, ids, weights)))]
            return None, torch.cat(parts), None, 0.0, 0
        span, started = self._span(layer, x), time.perf_counter()
        with server._lock:
            transport = server.transport(layer)
            try:
                inner = transport.submit(layer, x, ids, weights, telemetry.traceparent(span), span is not None)
            except grpc.RpcError as exc:
                raise rpc_error(layer, exc) from exc
        return transport, inner, span, started, x.nbytes + ids.nbytes + weights.nbytes

    def forward(self, layer, x, ids, weights):
        """wait(submit()); over shared memory one native call (ShmTransport.call) that rings the
        server as it goes to sleep, leaving nothing here to run when the server's thread takes the core."""
        server = self._owner(layer)
        if x.shape[0] <= server.capacity:
            with server._lock:
                call = getattr(server.transport(layer), "call", None)
                if call is not None:
                    span, started = self._span(layer, x), time.perf_counter()
                    out, compute_s = call(layer, x, ids, weights, telemetry.traceparent(span), span is not None)
                    self._account(span, started, compute_s, x.nbytes + ids.nbytes + weights.nbytes + out.nbytes)
                    return out
        return super().forward(layer, x, ids, weights)

    def expect(self, layer):
        server = self.owner.get(layer)
        transport = server._transport if server is not None else None
        if transport is not None and hasattr(transport, "expect"):
            transport.expect()

    def wait(self, handle):
        transport, inner, span, started, sent = handle
        if transport is None:
            return inner
        if transport.PARKS_POOLS:
            out, compute_s = transport.wait(inner)
        else:
            park_pools()  # a co-located server computes on these cores meanwhile
            try:
                out, compute_s = transport.wait(inner)
            finally:
                unpark_pools()  # they are this process's again: the helpers' wake-up overlaps the Python before the next call
        self._account(span, started, compute_s, sent + out.nbytes)
        return out

    def _owner(self, layer: int) -> ExpertServerClient:
        server = self.owner.get(layer)
        if server is None:
            raise ExpertBackendError(layer, "no expert server owns this layer", "INVALID_ARGUMENT")
        return server

    def _span(self, layer: int, x: torch.Tensor):
        """A span for this layer call where each is traced (trace_each) inside a recorded trace, else None."""
        if self.trace_each and trace.get_current_span().is_recording():
            return _tracer.start_span("expert_call", attributes={"tandem.layer": layer, "tandem.tokens": x.shape[0]})
        return None

    def _account(self, span, started: float, compute_s: float, nbytes: int) -> None:
        """Ends a call's span and adds it to this step's stats."""
        call_s = time.perf_counter() - started
        if span is not None:
            span.set_attribute("tandem.expert_s", compute_s)
            span.end()
        s = self._step
        s["calls"] += 1
        s["expert_s"] += compute_s
        s["transport_s"] += max(0.0, call_s - compute_s)
        s["bytes"] += nbytes

    def take_step_stats(self) -> dict:
        """Calls, bytes, seconds in the expert servers and in transport since the last take."""
        stats, self._step = self._step, _new_stats()
        return stats

    def serving(self) -> bool:
        return all(server.serving() for server in self.servers)

    def close(self) -> None:
        for server in self.servers:
            server.close()
