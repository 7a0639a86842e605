"""A checkpoint: config.json plus its weights from one source (sources/), read a tensor at a time.

Every source yields float tensors under their Hugging Face names, so the dense path and the expert
packing never see how a checkpoint is stored. Opening reads headers only; shapes are checked on
every read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.errors import CheckpointError
from services.common.sources import QuantizedWeight, TensorSource, open_safetensors


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


class Checkpoint:
    """A validated view of a checkpoint directory; tensors are read lazily by name."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"missing checkpoint directory: {self.dir}")
        self.config = read_config(self.dir)
        self.source: TensorSource = open_safetensors(self.dir, self.config)
        self._names = set(self.source.names())
        self.loaded: list[str] = []  # names read so far, in order: lets tests see what was touched

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def names(self) -> Iterable[str]:
        return self.source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._names:
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {self.dir}")
        return tuple(self.source.shape(name))

    def stored_bytes(self, name: str) -> int:
        """Bytes the tensor takes in the checkpoint's files (scales included)."""
        self.shape(name)
        return self.source.stored_bytes(name)

    def _checked(self, name: str, shape: tuple[int, ...] | None) -> None:
        actual = self.shape(name)
        if shape is not None and actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.dir.name} has shape {list(actual)}, expected {list(shape)}")
        self.loaded.append(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor as floats, checking its shape when one is expected."""
        self._checked(name, shape)
        return self.source.read(name)

    def quantized(self, name: str, shape: tuple[int, ...] | None = None) -> QuantizedWeight | None:
        """The tensor's stored codes when they are a packed format's (see sources.base), else None."""
        self._checked(name, shape)
        return self.source.quantized(name)

    def fingerprint(self) -> str:
        """A digest of config.json and the stored weights' names, sizes and headers (not the data)."""
        h = hashlib.sha256((self.dir / "config.json").read_bytes())
        self.source.fingerprint(h)
        return h.hexdigest()
