"""Reading a Hugging Face checkpoint: config.json plus safetensors, single file or sharded.

Every safetensors header is validated when the checkpoint is opened (sizes, offsets, dtypes), so a
truncated or corrupt file is reported by name before any tensor is used. Tensors are memory-mapped
and read one at a time on request; nothing copies the whole checkpoint into RAM.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.common.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
# Tags the header may carry that we can size but not compute with (e.g. FP8 checkpoints).
OTHER_SIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return config


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
    return {name: _tensor_info(path, name, entry, data_bytes) for name, entry in header.items()}


def _tensor_info(path: Path, name: str, entry: object, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from exc
    itemsize = DTYPES[dtype][1] if dtype in DTYPES else OTHER_SIZES.get(dtype)
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
    return TensorInfo(path, dtype, shape)


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


class Checkpoint:
    """A validated view of a checkpoint directory; tensors are read lazily by name."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"missing checkpoint directory: {self.dir}")
        self.config = read_config(self.dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in _shard_files(self.dir):
            self.tensors.update(_read_header(path))
        self._handles: dict[Path, object] = {}
        self.loaded: list[str] = []  # names read so far, in order: lets tests see what was touched

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {self.dir}")
        return self.tensors[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one floating-point tensor, checking its shape when one is expected."""
        info = self.info(name)
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has shape {list(info.shape)}, expected {list(shape)}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {info.file.name} has unsupported dtype {info.dtype}")
        self.loaded.append(name)
        return self._handle(info.file).get_tensor(name)

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: cannot open safetensors file: {exc}") from exc
        return self._handles[path]
