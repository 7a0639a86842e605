"""The shared-memory segment of a co-located expert session: one fixed, versioned binary layout.

The dense side creates the segment and writes requests; the expert server maps it after the gRPC
handshake and writes results. All integers little-endian. Byte offsets:

    0    magic b"TNDSHM01", u32 layout version, u32 header bytes, u64 segment bytes, u32 max tokens
    32   u32 prewake count (futex word): the client adds one as a call's routing starts, waking the
         server's helpers, which wait on it between calls
    64   request line: u32 request sequence (futex word), then the descriptor (REQUEST below);
         at 120, u32 count of the request word's sleepers
    128  response line: u32 response sequence (futex word), u32 status, u32 message length, u32 0,
         f64 seconds the server computed; at 152, u32 count of the response word's sleepers
    192  response message (UTF-8, MESSAGE_BYTES at most)
    448  trace context of the call: u8 flags (1: trace this call on its own), u8 length, then the
         W3C traceparent (ASCII, 55 bytes; length 0: not traced)
    512  data: slots for x [T, D], ids [T, K], weights [T, K], out [T, D], each 64-byte aligned

A call: write the data and the descriptor, then publish the request sequence and ring (a futex
wake only when the word has sleepers); the server reads with acquire ordering, computes, writes out, status and
message, then publishes the response sequence (equal to the request's) and rings back.
Every offset and size read from the other side is checked against the segment before use.

This module creates, names and maps segments and is the layout's reference; the calls themselves
are read and written by tandem_native.ShmClient / ShmServer (native/src/expert_session.cpp), whose
numbers a test compares with these.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import uuid
from dataclasses import dataclass

import math

import numpy as np

from services.common.errors import InvalidRequestError

MAGIC = b"TNDSHM01"
LAYOUT_VERSION = 4
HEADER_BYTES = 512
MESSAGE_BYTES = 448 - 192
ALIGN = 64
SHM_DIR = "/dev/shm"
NAME_PREFIX = "tandem-"
_NAME_RE = re.compile(r"^tandem-[A-Za-z0-9_-]{1,64}$")

_HEADER = struct.Struct("<8sIIQI")
PREWAKE = 32
REQUEST_SEQ = 64
RESPONSE_SEQ = 128
# layer, tokens, hidden, top_k, x dtype code, then byte offsets of x, ids, weights, out
_REQUEST = struct.Struct("<IIIIIQQQQ")
_REQUEST_AT = REQUEST_SEQ + 4
_RESPONSE = struct.Struct("<IIId")
_RESPONSE_AT = RESPONSE_SEQ + 4
REQUEST_SLEEPERS = 120
RESPONSE_SLEEPERS = 152
_MESSAGE_AT = 192
_TRACE_AT = 448
_TRACE = struct.Struct("<BB62s")
TRACE_EACH = 1

X_DTYPE_CODES = {"float32": 1, "bfloat16": 2}


@dataclass(frozen=True)
class Request:
    layer: int
    tokens: int
    hidden: int
    top_k: int
    x_dtype: int
    x_offset: int
    ids_offset: int
    weights_offset: int
    out_offset: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slots:
    """Where each tensor of a call lives, for a session of max_tokens tokens."""

    x: int
    ids: int
    weights: int
    out: int
    end: int

    @staticmethod
    def plan(max_tokens: int, hidden: int, top_k: int) -> "Slots":
        x = HEADER_BYTES
        ids = x + _align(max_tokens * hidden * 4)
        weights = ids + _align(max_tokens * top_k * 8)
        out = weights + _align(max_tokens * top_k * 4)
        return Slots(x, ids, weights, out, out + _align(max_tokens * hidden * 4))


class Segment:
    """One mapped segment. The creator owns the name and unlinks it; an attacher only maps it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name, self.mm, self.owner = name, mm, owner
        self.buf = memoryview(mm)

    @property
    def size(self) -> int:
        return len(self.mm)

    @staticmethod
    def create(byte_size: int, max_tokens: int) -> "Segment":
        name = f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, byte_size)
            mm = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, HEADER_BYTES, byte_size, max_tokens)
        return Segment(name, mm, owner=True)

    @staticmethod
    def attach(name: str, byte_size: int, layout_version: int, max_tokens: int) -> "Segment":
        """Maps a segment another process created; every disagreement is an InvalidRequestError."""
        if not _NAME_RE.match(name):
            raise InvalidRequestError(f"segment_name: {name!r} is not a tandem segment name")
        if layout_version != LAYOUT_VERSION:
            raise InvalidRequestError(f"layout_version: server speaks {LAYOUT_VERSION}, client sent {layout_version}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise InvalidRequestError(f"segment_name: cannot open {name!r}: {exc.strerror}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual != byte_size or byte_size < HEADER_BYTES:
                raise InvalidRequestError(f"byte_size: segment has {actual} bytes, session says {byte_size}")
            mm = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        magic, version, header, size, tokens = _HEADER.unpack_from(mm, 0)
        if (magic, version, header, size, tokens) != (MAGIC, LAYOUT_VERSION, HEADER_BYTES, byte_size, max_tokens):
            mm.close()
            raise InvalidRequestError("segment header disagrees with the session (magic, version, size or max_tokens)")
        return Segment(name, mm, owner=False)

    def unlink(self) -> None:
        """Removes the name (mappings stay valid); safe to call twice."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmaps (once no view of it is left; otherwise when the last one goes) and, for the
        creator, unlinks."""
        if self.owner:
            self.unlink()
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            pass

    def array(self, field: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A view of the segment, after checking that it lies inside the data area and is aligned."""
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < HEADER_BYTES or offset + nbytes > self.size or offset % dtype.itemsize:
            raise InvalidRequestError(
                f"{field}: {nbytes} bytes at offset {offset} fall outside the data area "
                f"[{HEADER_BYTES}, {self.size}) or are misaligned"
            )
        return np.frombuffer(self.buf, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def host_id() -> str:
    """Equal for two processes on one host (same kernel boot): shared memory can join them."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}/{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def leftover_segments() -> list[str]:
    """Names of tandem segments present in /dev/shm (for tests and cleanup checks)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
