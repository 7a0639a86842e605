"""The two data planes from the dense side to one expert server, behind one submit/wait shape.

- ShmTransport: co-located. A segment this process creates; gRPC OpenSession hands its name to
  the server and then stays open as the liveness signal. Per call: copy in, publish, doorbell;
  wait on the response doorbell. The name is unlinked as soon as the server has mapped it, so a
  crash of either side leaves nothing in /dev/shm.
- InlineTransport: any host. A long-lived Compute stream, tensors inline, answered in order.
Both raise ExpertBackendError with a gRPC status name; a transport that failed is closed and the
owner opens a new one on the next call. T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import torch

from services.common import shm_layout as shm
from services.common import wire
from services.common.errors import ExpertBackendError
from tandem.v1 import expert_pb2 as pb

_STATUS = {0: "OK", 3: "INVALID_ARGUMENT", 13: "INTERNAL"}


def to_wire(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """x [T, D] as numpy float32, or bfloat16 bits when x is bfloat16 (half the bytes, exact)."""
    x = x.detach().to("cpu")
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16), pb.BFLOAT16
    return x.to(torch.float32).contiguous().numpy(), pb.FLOAT32


def from_wire(out: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out.dtype == np.uint16:
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).to(device=device, dtype=dtype)
    return torch.from_numpy(out).to(device=device, dtype=dtype)


def rpc_error(layer: int, exc: grpc.RpcError) -> ExpertBackendError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return ExpertBackendError(layer, details or code.name, "UNAVAILABLE" if code == grpc.StatusCode.UNKNOWN else code.name)


class ShmTransport:
    def __init__(self, stub, hidden: int, top_k: int, max_tokens: int, spin_us: float, timeout_s: float,
                 connect_timeout_s: float = 30.0):
        import tandem_native

        self._tn = tandem_native
        self.hidden, self.top_k, self.max_tokens = hidden, top_k, max_tokens
        self.spin_us, self.timeout_s = spin_us, timeout_s
        self.slots = shm.Slots.plan(max_tokens, hidden, top_k)
        self.segment = shm.Segment.create(self.slots.end, max_tokens)
        self._views(max_tokens, hidden, top_k)
        self.dead = threading.Event()
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._failure: grpc.RpcError | None = None
        self._seq = 0
        self._call = stub.OpenSession(self._requests())
        threading.Thread(target=self._watch, name="shm-session", daemon=True).start()
        try:
            self._handshake(connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _requests(self):
        yield pb.SessionRequest(open=pb.SessionOpen(
            segment_name=self.segment.name, byte_size=self.segment.size,
            layout_version=shm.LAYOUT_VERSION, max_tokens=self.max_tokens,
        ))
        self._closing.wait()

    def _watch(self) -> None:
        """Reads the session stream: its first message is the handshake; its end is the server's."""
        try:
            for _ in self._call:
                self._ready.set()
        except grpc.RpcError as exc:
            self._failure = exc
        finally:
            self.dead.set()
            self._ready.set()
            try:
                self._tn.doorbell_wake(self.segment.mm, shm.RESPONSE_SEQ)
            except (ValueError, BufferError):
                pass  # already closed: nobody is waiting

    def _handshake(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.dead.is_set():
            self._call.cancel()
            if self._failure is not None:
                raise rpc_error(-1, self._failure)
            raise ExpertBackendError(-1, "the shared-memory session was not opened", "UNAVAILABLE")
        self.segment.unlink()  # mapped on both sides now: the name is no longer needed

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace: str = "",
               each: bool = False):
        if self.dead.is_set():
            raise ExpertBackendError(layer, "the expert server's session ended", "UNAVAILABLE")
        t, d = x.shape
        k = ids.shape[1]
        if d != self.hidden or t > self.max_tokens or k > self.top_k:
            raise ExpertBackendError(layer, f"[{t}, {d}] x top-{k} does not fit the session", "INVALID_ARGUMENT")
        wire_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        self._x[wire_dtype][:t].copy_(x)
        self._ids[:t * k].view(t, k).copy_(ids)
        self._w[:t * k].view(t, k).copy_(weights)
        self.segment.write_trace(trace, each)
        s = self.slots
        code = pb.BFLOAT16 if wire_dtype == torch.bfloat16 else pb.FLOAT32
        seq = self.publish(shm.Request(layer, t, d, k, code, s.x, s.ids, s.weights, s.out))
        return layer, seq, wire_dtype, t, x.dtype, x.device

    def _views(self, cap: int, hidden: int, top_k: int) -> None:
        """Tensors over the slots, made once (a view per call costs more than the copy at T=1)."""
        buf, s = self.segment.buf, self.slots

        def view(dtype, offset, n, shape):
            return torch.frombuffer(buf, dtype=dtype, count=n, offset=offset).view(shape)

        self._x = {dt: view(dt, s.x, cap * hidden, (cap, hidden)) for dt in (torch.float32, torch.bfloat16)}
        self._out = {dt: view(dt, s.out, cap * hidden, (cap, hidden)) for dt in (torch.float32, torch.bfloat16)}
        self._ids = view(torch.int64, s.ids, cap * top_k, (cap * top_k,))
        self._w = view(torch.float32, s.weights, cap * top_k, (cap * top_k,))

    def publish(self, request: shm.Request) -> int:
        """Writes a descriptor (its data already in place) and rings; returns its sequence number."""
        self.segment.write_request(request)
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._tn.doorbell_ring(self.segment.mm, shm.REQUEST_SEQ, self._seq)
        return self._seq

    def check(self, layer: int, seq: int) -> float:
        """Waits for the answer to call seq; raises the server's error status, if any; returns the
        seconds the server computed."""
        self._await(layer, seq)
        status, message, compute_s = self.segment.read_response()
        if status:
            raise ExpertBackendError(layer, message, _STATUS.get(status, "INTERNAL"))
        return compute_s

    def wait(self, handle) -> tuple[torch.Tensor, float]:
        """([T, D] result, seconds the server computed)."""
        layer, seq, wire_dtype, t, dtype, device = handle
        compute_s = self.check(layer, seq)
        return self._out[wire_dtype][:t].to(device=device, dtype=dtype, copy=True), compute_s

    def _await(self, layer: int, seq: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        previous = (seq - 1) & 0xFFFFFFFF
        while True:
            left = deadline - time.monotonic()
            value = self._tn.doorbell_wait(self.segment.mm, shm.RESPONSE_SEQ, previous, self.spin_us,
                                           max(0.0, min(left, 0.25)))
            if value == seq:
                return
            if self.dead.is_set():
                raise ExpertBackendError(layer, "the expert server went away mid-call", "UNAVAILABLE")
            if left <= 0:
                self.dead.set()  # the server may still answer later: this session cannot be reused
                raise ExpertBackendError(layer, f"no answer within {self.timeout_s:g} s", "DEADLINE_EXCEEDED")

    def close(self) -> None:
        self._closing.set()
        self._call.cancel()
        self.dead.set()
        self._x = self._out = self._ids = self._w = None  # views pin the mapping
        self.segment.close()


class InlineTransport:
    def __init__(self, stub, timeout_s: float):
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Compute(iter(self._queue.get, None))
        self._deadline: float | None = None
        self._timed_out = False
        self.dead = threading.Event()
        threading.Thread(target=self._watchdog, name="inline-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """Cancels the stream when a call outlives its deadline (a stream has no per-message one)."""
        while not self.dead.wait(0.05):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out = True
                self._call.cancel()
                return

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace: str = "",
               each: bool = False):
        if self.dead.is_set():
            raise ExpertBackendError(layer, "the stream to the expert server ended", "UNAVAILABLE")
        xs, code = to_wire(x)
        self._queue.put(pb.ComputeRequest(
            layer=layer, x=wire.encode(xs, code),
            ids=wire.encode(ids.detach().to("cpu", torch.int64).numpy(), pb.INT64),
            weights=wire.encode(weights.detach().to("cpu", torch.float32).numpy(), pb.FLOAT32),
            traceparent=trace, trace_each=each,
        ))
        self._deadline = time.monotonic() + self.timeout_s
        return layer, x.dtype, x.device

    def wait(self, handle) -> tuple[torch.Tensor, float]:
        """([T, D] result, seconds the server computed)."""
        layer, dtype, device = handle
        try:
            response = next(self._call)
        except grpc.RpcError as exc:
            self.dead.set()
            if self._timed_out:
                raise ExpertBackendError(layer, f"no answer within {self.timeout_s:g} s", "DEADLINE_EXCEEDED") from exc
            raise rpc_error(layer, exc) from exc
        except StopIteration as exc:
            self.dead.set()
            raise ExpertBackendError(layer, "the expert server ended the stream", "UNAVAILABLE") from exc
        finally:
            self._deadline = None
        out = wire.decode("out", response.out, (pb.FLOAT32, pb.BFLOAT16), 2)
        return from_wire(out.copy(), dtype, device), response.compute_s

    def close(self) -> None:
        self.dead.set()
        self._queue.put(None)
        self._call.cancel()
