"""GGUF files (llama.cpp's format) through gguf-py: metadata, and tensors by their GGUF name.

A model may be split over `<name>-00001-of-0000N.gguf` files; naming the first opens all of them.
Tensors stay memory-mapped: an expert of a merged `[E, ...]` tensor is a view of its bytes, and
only the slice asked for is dequantized (gguf-py's numpy code, run on several threads).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from services.common.errors import CheckpointError

# What gguf-py dequantizes and this reader accepts: every type of Q4_K_M, Q5_K_M, Q6_K, Q8_0 and the
# "UD" mixes, and the plain ones.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ4_NL", "IQ4_XS")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_ROWS_PER_TASK = 256


def split_paths(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF model, first to last."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF is missing {', '.join(missing)}")
    return paths


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from exc


class GgufFile:
    """Metadata and tensors of one GGUF model (all its split files)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.paths = split_paths(self.path)
        self.readers = [_open(p) for p in self.paths]
        self.meta: dict[str, object] = {}
        self.tensors: dict[str, object] = {}
        for path, reader in zip(self.paths, self.readers):
            for key, field in reader.fields.items():
                if not key.startswith("GGUF.") and key not in self.meta:
                    self.meta[key] = _value(field)
            for t in reader.tensors:
                self._check(path, t)
                self.tensors[t.name] = t

    def _check(self, path: Path, t) -> None:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        if t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"{path}: truncated GGUF: tensor {t.name!r} needs {t.n_bytes} bytes")

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def key(self, name: str, default=None, *, arch: bool = True):
        """Metadata value `<arch>.<name>` (or `name` with arch=False)."""
        return self.meta.get(f"{self.arch}.{name}" if arch else name, default)

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def raw(self, name: str, index: int | None = None) -> np.ndarray:
        """The stored bytes (or values, for float types) of a tensor, or of slice `index` of its first
        dimension, as a view of the mapping."""
        data = self.tensors[name].data
        return data if index is None else data[index]

    def dequantize(self, name: str, index: int | None = None) -> np.ndarray:
        """float32 values of a tensor, or of slice `index` of its first dimension, rows in parallel."""
        import gguf

        t = self.tensors[name]
        data = self.raw(name, index)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data[None]
        if rows.shape[0] <= _ROWS_PER_TASK:
            out = gguf.quants.dequantize(rows, t.tensor_type)
        else:
            chunks = [rows[i:i + _ROWS_PER_TASK] for i in range(0, rows.shape[0], _ROWS_PER_TASK)]
            with ThreadPoolExecutor(4) as pool:
                out = np.concatenate(list(pool.map(lambda c: gguf.quants.dequantize(c, t.tensor_type), chunks)))
        shape = self.shape(name)[0 if index is None else 1:]
        return np.array(out, dtype=np.float32).reshape(shape)  # a copy: never a view of the mapping

    def nbytes(self, name: str, index: int | None = None) -> int:
        return self.raw(name, index).nbytes

    def fingerprint(self, h) -> None:
        """Each file's name and size and its metadata and tensor table (not the tensor data)."""
        for path, reader in zip(self.paths, self.readers):
            start = min((t.data_offset for t in reader.tensors), default=path.stat().st_size)
            h.update(f"{path.name}:{path.stat().st_size}:".encode())
            h.update(bytes(reader.data[:start]))


def _value(field):
    """A metadata value as Python; float32 ones as the shortest decimal that is that float32 (1e-06,
    not 9.99999997e-07: the value the converter was given)."""
    import gguf

    try:
        value = field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value.item() if isinstance(value, np.generic) else value
