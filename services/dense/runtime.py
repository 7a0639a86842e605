"""Where and in what precision the dense path runs; built once by the caller and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DenseRuntime:
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when present, else CPU

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
