"""The two data planes from the dense side to one expert server, behind one submit/wait shape.

- ShmTransport: co-located. A segment this process creates; gRPC OpenSession hands its name to
  the server and then stays open as the liveness signal. Per call, tandem_native.ShmClient copies
  in, publishes and rings, then waits on the response doorbell (GIL released) and copies out. The
  name is unlinked as soon as the server has mapped it, so a crash of either side leaves nothing
  in /dev/shm.
- inline_transport: any host. A long-lived Compute stream, tensors inline, answered in order, on
  grpc++ (NativeInlineTransport, tandem_grpc: the calling thread drives the stream, GIL released)
  where it was built, or on grpcio's (GrpcioInlineTransport: a request-iterator thread and a
  polling thread).
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
from services.common.grpc_defaults import KEEPALIVE_MS, native_grpc
from services.dense.pool import all_pools
from tandem.v1 import expert_pb2 as pb

_STATUS = {0: "OK", 3: "INVALID_ARGUMENT", 13: "INTERNAL"}


def to_wire(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """x [T, D] as numpy float32, or bfloat16 bits when x is bfloat16 (half the bytes, exact)."""
    if x.dtype is torch.bfloat16:
        return host_array(x, torch.bfloat16).view(np.uint16), pb.BFLOAT16
    return host_array(x, torch.float32), pb.FLOAT32


def host_array(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """t as a C-contiguous numpy array on the CPU in dtype (bfloat16 as int16 bits); a view when t is
    one already (the common case: this is on every layer call's path)."""
    if t.dtype is not dtype or not t.is_cpu or t.requires_grad or not t.is_contiguous():
        t = t.detach().to("cpu", dtype).contiguous()
    return t.view(torch.int16).numpy() if dtype is torch.bfloat16 else t.numpy()


def from_wire(out: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out.dtype == np.uint16:
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).to(device=device, dtype=dtype)
    return torch.from_numpy(out).to(device=device, dtype=dtype)


def rpc_error(layer: int, exc: grpc.RpcError) -> ExpertBackendError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return ExpertBackendError(layer, details or code.name, "UNAVAILABLE" if code == grpc.StatusCode.UNKNOWN else code.name)


class ShmTransport:
    PARKS_POOLS = True  # a wait parks this process's pools on the answer's doorbell itself

    def __init__(self, stub, hidden: int, top_k: int, max_tokens: int, spin_us: float, timeout_s: float,
                 connect_timeout_s: float = 30.0):
        import tandem_native

        self.hidden, self.top_k, self.max_tokens = hidden, top_k, max_tokens
        self.spin_us, self.timeout_s = spin_us, timeout_s
        self.slots = s = shm.Slots.plan(max_tokens, hidden, top_k)
        self.segment = shm.Segment.create(s.end, max_tokens)
        self._native = tandem_native.ShmClient(self.segment.mm, s.x, s.ids, s.weights, s.out, max_tokens, hidden,
                                               top_k)
        self._descriptor = tandem_native.ShmDescriptor
        self.dead = threading.Event()
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._failure: grpc.RpcError | None = None
        self._pending: tuple[int, int] | None = None  # (layer, seq) submitted and not yet waited for
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
            self._native.wake()  # a wait in progress sees `dead`; after close() this does nothing

    def _handshake(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s) or self.dead.is_set():
            self._call.cancel()
            if self._failure is not None:
                raise rpc_error(-1, self._failure)
            raise ExpertBackendError(-1, "the shared-memory session was not opened", "UNAVAILABLE")
        self.segment.unlink()  # mapped on both sides now: the name is no longer needed

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace: str = "",
               each: bool = False):
        self._begin(layer)
        seq = self._staged(layer, x, ids, weights, lambda *arrays: self._native.submit(layer, *arrays, trace, each))
        self._pending = layer, seq
        return layer, seq, x.shape[0], x.dtype, None if x.is_cpu else x.device

    def call(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace: str = "",
             each: bool = False) -> tuple[torch.Tensor, float]:
        """submit() and wait() in one native call (tandem_native.ShmClient.call), for a caller with
        nothing to do until the answer: ([T, D] result, seconds the server computed)."""
        self._begin(layer)
        out, first_s = self._out(x.shape[0], x.dtype), min(self.timeout_s, 0.25)
        seq, answer = self._staged(layer, x, ids, weights, lambda *arrays: self._native.call(
            layer, *arrays, out, self.spin_us, first_s, all_pools(), trace, each))
        if answer is None:
            answer = self._await(layer, seq, out, self.timeout_s - first_s)
        return self._tensor(out, x.dtype, None if x.is_cpu else x.device), self._status(layer, answer)

    def _begin(self, layer: int) -> None:
        if self.dead.is_set():
            raise ExpertBackendError(layer, "the expert server's session ended", "UNAVAILABLE")
        if self._pending is not None:  # an answer nobody waited for: awaited (the slots are in use) and dropped
            try:
                self.check(*self._pending)
            except ExpertBackendError:  # that call's own error is not this one's, unless the session ended
                if self.dead.is_set():
                    raise

    @staticmethod
    def _staged(layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, send):
        """send(x, ids, weights): CPU tensors of the wire's dtypes go as they are; others (on another
        device, of another dtype, strided) are converted and checked again."""
        try:
            return send(x, ids, weights)
        except ValueError:
            wire_dtype = torch.bfloat16 if x.dtype is torch.bfloat16 else torch.float32
            try:
                return send(host_array(x, wire_dtype), host_array(ids, torch.int64), host_array(weights, torch.float32))
            except ValueError as exc:  # the call does not fit the session (hidden size, tokens, top-k)
                raise ExpertBackendError(layer, str(exc), "INVALID_ARGUMENT") from exc

    def expect(self) -> None:
        """Wakes the server's helpers for a call that follows shortly (tandem_native.ShmClient.expect)."""
        if self.dead.is_set():
            return
        try:
            self._native.expect(all_pools())
        except RuntimeError:  # released meanwhile (closed): the call that follows will say so
            pass

    def publish(self, request: shm.Request) -> int:
        """Writes a descriptor (its data already in place) and rings; returns its sequence number."""
        r = request
        return self._native.publish(self._descriptor(r.layer, r.tokens, r.hidden, r.top_k, r.x_dtype, r.x_offset,
                                                     r.ids_offset, r.weights_offset, r.out_offset))

    def check(self, layer: int, seq: int, out: np.ndarray | None = None) -> float:
        """Waits for the answer to call seq; raises the server's error status, if any; copies the
        result into out (when given); returns the seconds the server computed."""
        self._pending = None
        first_s = min(self.timeout_s, 0.25)
        answer = self._native.finish(seq, self.spin_us, first_s, out, all_pools())
        if answer is None:
            answer = self._await(layer, seq, out, self.timeout_s - first_s)
        return self._status(layer, answer)

    @staticmethod
    def _status(layer: int, answer: tuple[int, str, float]) -> float:
        status, message, compute_s = answer
        if status:
            raise ExpertBackendError(layer, message, _STATUS.get(status, "INTERNAL"))
        return compute_s

    def wait(self, handle) -> tuple[torch.Tensor, float]:
        """([T, D] result, seconds the server computed)."""
        layer, seq, t, dtype, device = handle  # device: None for the CPU
        out = self._out(t, dtype)
        compute_s = self.check(layer, seq, out)
        return self._tensor(out, dtype, device), compute_s

    def _out(self, t: int, dtype: torch.dtype) -> np.ndarray:
        """The [T, D] array an answer is copied into: the wire's dtype for dtype (bfloat16 as int16 bits)."""
        return np.empty((t, self.hidden), np.int16 if dtype is torch.bfloat16 else np.float32)

    @staticmethod
    def _tensor(out: np.ndarray, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """The answer copied into out as a tensor of dtype on device (None: the CPU)."""
        result = torch.from_numpy(out)
        if dtype is torch.bfloat16:
            result = result.view(torch.bfloat16)
        if result.dtype is not dtype or device is not None:
            result = result.to(device=device, dtype=dtype)
        return result

    def _await(self, layer: int, seq: int, out: np.ndarray | None, left_s: float) -> tuple[int, str, float]:
        """The slow path of check(): waits in slices, watching the session and the deadline."""
        deadline = time.monotonic() + left_s
        while True:
            if self.dead.is_set():
                raise ExpertBackendError(layer, "the expert server went away mid-call", "UNAVAILABLE")
            left = deadline - time.monotonic()
            if left <= 0:
                self.dead.set()  # the server may still answer later: this session cannot be reused
                raise ExpertBackendError(layer, f"no answer within {self.timeout_s:g} s", "DEADLINE_EXCEEDED")
            answer = self._native.finish(seq, self.spin_us, min(left, 0.25), out, all_pools())
            if answer is not None:
                return answer

    def close(self) -> None:
        self._closing.set()
        self._call.cancel()
        self.dead.set()
        self._native.release()
        self.segment.close()


class NativeInlineTransport:
    """The Compute stream on tandem_grpc (native/grpc): no Python thread between the caller and the
    wire, which is most of what a layer's round trip over grpcio costs on a small machine."""

    PARKS_POOLS = False  # RemoteExperts parks the pools around a wait

    def __init__(self, address: str, timeout_s: float, tls_root: bytes | None = None, connect_timeout_s: float = 30.0):
        import tandem_grpc

        self.timeout_s = timeout_s
        self.dead = threading.Event()
        self._failure = tandem_grpc.RpcFailure
        try:
            self._stream = tandem_grpc.InlineStream(address, (tls_root or b"").decode(), 256 << 20, connect_timeout_s,
                                                    KEEPALIVE_MS)
        except tandem_grpc.RpcFailure as exc:
            code, details = exc.args
            raise ExpertBackendError(-1, f"Compute stream to {address}: {details or code}", code) from exc

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, trace: str = "",
               each: bool = False):
        xw, _ = to_wire(x)
        try:
            self._stream.submit(layer, xw, host_array(ids, torch.int64), host_array(weights, torch.float32), trace,
                                each, self.timeout_s)
        except self._failure as exc:
            raise self._error(layer, exc) from exc
        except ValueError as exc:  # not a [T, D] / [T, K] call: nothing was sent
            raise ExpertBackendError(layer, str(exc), "INVALID_ARGUMENT") from exc
        return layer, x.dtype, x.device

    def wait(self, handle) -> tuple[torch.Tensor, float]:
        """([T, D] result, seconds the server computed)."""
        layer, dtype, device = handle
        try:
            out, compute_s = self._stream.wait(self.timeout_s)
        except self._failure as exc:
            raise self._error(layer, exc) from exc
        return from_wire(out, dtype, device), compute_s

    def _error(self, layer: int, exc) -> ExpertBackendError:
        code, details = exc.args
        if self._stream.dead:
            self.dead.set()
        return ExpertBackendError(layer, details or code, code)

    def close(self) -> None:
        self.dead.set()
        self._stream.close()


class GrpcioInlineTransport:
    PARKS_POOLS = False  # RemoteExperts parks the pools around a wait

    def __init__(self, stub, timeout_s: float):
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.Compute(iter(self._queue.get, None))
        self._deadline: float | None = None
        self._timed_out = self._pending = False
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
        if self._pending:  # an answer nobody waited for is read and dropped
            self._next(layer)
        request = pb.ComputeRequest(layer=layer, traceparent=trace, trace_each=each)
        wire.encode(request.x, *to_wire(x))
        wire.encode(request.ids, host_array(ids, torch.int64), pb.INT64)
        wire.encode(request.weights, host_array(weights, torch.float32), pb.FLOAT32)
        self._deadline = time.monotonic() + self.timeout_s
        self._pending = True
        self._queue.put(request)
        return layer, x.dtype, x.device

    def wait(self, handle) -> tuple[torch.Tensor, float]:
        """([T, D] result, seconds the server computed)."""
        layer, dtype, device = handle
        response = self._next(layer)
        out = wire.decode("out", response.out, (pb.FLOAT32, pb.BFLOAT16), 2)
        return from_wire(out.copy(), dtype, device), response.compute_s

    def _next(self, layer: int) -> pb.ComputeResponse:
        self._pending = False
        try:
            return next(self._call)
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

    def close(self) -> None:
        self.dead.set()
        self._queue.put(None)
        self._call.cancel()


def inline_transport(stub, timeout_s: float, address: str | None = None, tls_root: bytes | None = None,
                    connect_timeout_s: float = 30.0, native: bool | None = None):
    """The inline transport: on grpc++ where tandem_grpc was built (and address is known), else on
    grpcio's stream from stub; native=False forces grpcio's."""
    if address is not None and (native if native is not None else native_grpc()):
        return NativeInlineTransport(address, timeout_s, tls_root, connect_timeout_s)
    return GrpcioInlineTransport(stub, timeout_s)
