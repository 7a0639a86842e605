"""The safetensors files of a Hugging Face checkpoint directory, single file or sharded.

Every header is validated when the files are opened (sizes, offsets, dtypes), so a truncated or
corrupt file is reported by name before any tensor is used. Tensors are read one at a time with
positioned reads into a buffer of their own, in whatever dtype they are stored (the sources above
turn them into float weights): no mapping of the files stays resident, so converting a checkpoint
larger than memory holds only the tensors in hand.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from services.common.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header against the file's real size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header (length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    return {name: _tensor_info(path, name, entry, 8 + header_len, data_bytes) for name, entry in header.items()}


def _tensor_info(path: Path, name: str, entry: object, data_start: int, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from exc
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else None
    if itemsize is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {list(shape)}")
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid offsets [{start}, {end}]")
    if end - start != math.prod(shape) * itemsize:
        raise CheckpointError(f"{path}: tensor {name!r} byte size does not match its shape and dtype")
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end}, data holds {data_bytes}"
        )
    return TensorInfo(path, dtype, shape, data_start + start, end - start)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: corrupt index ({exc})") from exc
        paths = [model_dir / name for name in files]
    elif (model_dir / SINGLE_FILE).is_file():
        paths = [model_dir / SINGLE_FILE]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(f"missing file: no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"missing file: {path} (named by {INDEX_FILE})")
    return paths


class SafetensorsFiles:
    """Every tensor of a directory's safetensors files by its stored name, read lazily."""

    def __init__(self, model_dir: Path):
        self.paths = _shard_files(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.paths:
            self.tensors.update(_read_header(path))
        self._files: dict[Path, object] = {}

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor as it is (any dtype), in memory of its own."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        try:
            f = self._files.get(info.file) or self._files.setdefault(info.file, open(info.file, "rb"))
            while done < info.nbytes:
                n = os.preadv(f.fileno(), [view[done:]], info.offset + done)
                if n <= 0:
                    raise CheckpointError(f"{info.file}: truncated while reading tensor {name!r}")
                done += n
        except OSError as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r}: {exc}") from exc
        return buf.view(DTYPES[info.dtype]).reshape(info.shape)

    def fingerprint(self, h) -> None:
        """Adds every file's name, size and header (not its data) to the hash h."""
        for path in sorted(self.paths):
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f"{path.name}:{path.stat().st_size}:".encode())
                h.update(f.read(min(n, MAX_HEADER_BYTES)))
