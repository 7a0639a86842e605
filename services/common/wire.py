"""Tensors on the expert wire: numpy arrays to and from the protos' Tensor, and bfloat16 bits.

The wire carries x and out as float32 or bfloat16, ids as int64 and weights as float32, always
row-major little-endian with the shape explicit. Decoding checks dtype, shape and byte count and
raises InvalidRequestError naming the field.
"""

from __future__ import annotations

import math

import numpy as np

from services.common.errors import InvalidRequestError
from tandem.v1 import expert_pb2 as pb

NUMPY_OF = {pb.FLOAT32: np.dtype("<f4"), pb.BFLOAT16: np.dtype("<u2"), pb.INT64: np.dtype("<i8")}


def encode(into: pb.Tensor, array: np.ndarray, dtype: int) -> None:
    """Fills a message's Tensor field in place (several times faster than building a Tensor with
    keyword arguments and copying it in, with upb, for tensors of tens of kilobytes)."""
    into.dtype = dtype
    into.shape[:] = array.shape
    into.data = np.ascontiguousarray(array).tobytes()


def decode(field: str, tensor: pb.Tensor, allowed: tuple[int, ...], rank: int) -> np.ndarray:
    """The tensor as a read-only numpy array of its wire dtype, after checking it."""
    if tensor.dtype not in allowed:
        names = ", ".join(pb.DType.Name(d) for d in allowed)
        raise InvalidRequestError(f"{field}.dtype: expected {names}, got {pb.DType.Name(tensor.dtype)}")
    shape = tuple(tensor.shape)
    if len(shape) != rank or any(n < 0 for n in shape):
        raise InvalidRequestError(f"{field}.shape: expected {rank} non-negative dims, got {list(shape)}")
    dtype = NUMPY_OF[tensor.dtype]
    data = tensor.data  # a copy on each access
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise InvalidRequestError(f"{field}.data: {len(data)} bytes do not hold a {list(shape)} tensor")
    return np.frombuffer(data, dtype=dtype).reshape(shape)
