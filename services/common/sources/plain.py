"""Unquantized safetensors: bf16 / fp16 / fp32 tensors, read as they are."""

from __future__ import annotations

import torch

from services.common.errors import CheckpointError
from services.common.sources.base import TensorSource
from services.common.sources.safetensors import FLOAT_DTYPES, SafetensorsFiles


class PlainSource(TensorSource):
    kind = "safetensors"

    def __init__(self, files: SafetensorsFiles):
        self.files = files

    def names(self):
        return self.files.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.info(name).shape

    def stored_bytes(self, name: str) -> int:
        return self.files.info(name).nbytes

    def read(self, name: str) -> torch.Tensor:
        info = self.files.info(name)
        if info.dtype not in FLOAT_DTYPES:
            hint = " (a quantized checkpoint needs its quantization_config in config.json)" if info.dtype.startswith("F8") else ""
            raise CheckpointError(f"tensor {name!r} in {info.file.name} has unsupported dtype {info.dtype}{hint}")
        return self.files.raw(name)

    def fingerprint(self, h) -> None:
        self.files.fingerprint(h)
