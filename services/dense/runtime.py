"""Where and in what precision the dense path runs; built once by the caller and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import ConfigError
from services.dense.pool import DECODE_SPIN_US

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The dense linears' weights: "float" (tensors in the dtype, the reference), or a packed format
# computed on the CPU by the native kernels (activations stay in the dtype between them).
DENSE_FORMATS = ("float", "bf16", "int8", "int4", "int4_asym")


@dataclass(frozen=True)
class DenseRuntime:
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when present, else CPU
    weights: str = "float"  # DENSE_FORMATS
    threads: int = 1  # native kernel threads of packed dense linears
    spin_us: int = DECODE_SPIN_US  # how long their idle threads poll for the next call (services/dense/pool.py)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in DENSE_FORMATS:
            raise ConfigError(f"--dense-format: expected one of {', '.join(DENSE_FORMATS)}, got {self.weights!r}")
        if self.threads < 1:
            raise ConfigError(f"--threads: must be >= 1, got {self.threads}")
        if not 0 <= self.spin_us <= 100_000:
            raise ConfigError(f"spin_us: must be in [0, 100000], got {self.spin_us}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        if self.weights != "float" and self.torch_device.type != "cpu":
            raise ConfigError(f"--dense-format {self.weights}: packed dense weights run on the CPU; "
                              f"on {self.torch_device} use --dense-format float (with --dtype bfloat16)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
