"""Block-scaled FP8 safetensors (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2, Qwen3 "-FP8").

config.json's quantization_config: quant_method "fp8", fmt "e4m3", weight_block_size [B0, B1], an
optional scale_fmt "ue8m0" and modules_to_not_convert. A quantized weight q [O, I] is float8_e4m3fn
with `<name>_scale_inv` s [ceil(O / B0), ceil(I / B1)] (float32, bfloat16 or float8_e8m0fnu):
W[o, i] = q[o, i] * s[o // B0, i // B1]; partial edge blocks are the normal case. Everything else
(embeddings, norms, router, lm_head, modules_to_not_convert) is stored in a float dtype and read as
it is. Each weight is dequantized on its own, a block of rows at a time.
"""

from __future__ import annotations

import math

import torch

from services.common.errors import CheckpointError, ConfigError
from services.common.sources.base import check_scale_shape
from services.common.sources.plain import PlainSource
from services.common.sources.safetensors import FLOAT_DTYPES, SafetensorsFiles

FORMATS = ("e4m3", "float8_e4m3fn")
SCALE_DTYPES = frozenset({"F32", "BF16", "F16", "F8_E8M0"})
SCALE_SUFFIX = "_scale_inv"


def block_size(qcfg: dict) -> tuple[int, int]:
    """Validates an fp8 quantization_config and returns its weight block size."""
    fmt = qcfg.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise ConfigError(f"config.json: FP8 fmt {fmt!r} is not supported (only {', '.join(FORMATS)})")
    block = qcfg.get("weight_block_size")
    if block is None:
        raise ConfigError(
            "config.json: FP8 without weight_block_size (per-tensor or per-channel scales) is not supported; "
            "only block-scaled FP8 (DeepSeek's layout) is read"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json: weight_block_size must be two positive integers, got {block!r}")
    if qcfg.get("scale_fmt") not in (None, "ue8m0"):
        raise ConfigError(f"config.json: FP8 scale_fmt {qcfg['scale_fmt']!r} is not supported (only ue8m0)")
    return block[0], block[1]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [O, I] float8, scale [ceil(O / B0), ceil(I / B1)] -> W [O, I] float32, B0 rows at a time."""
    rows, b1 = block[0], block[1]
    o, i = q.shape
    per_column = scale.float().repeat_interleave(b1, dim=1)[:, :i]  # [ceil(O / B0), I]
    out = torch.empty(o, i, dtype=torch.float32)
    for r in range(per_column.shape[0]):
        torch.mul(q[r * rows:(r + 1) * rows].float(), per_column[r], out=out[r * rows:(r + 1) * rows])
    return out


class Fp8Source(PlainSource):
    kind = "fp8 safetensors"

    def __init__(self, files: SafetensorsFiles, qcfg: dict):
        super().__init__(files)
        self.block = block_size(qcfg)
        self._names = [n for n in files.tensors if not n.endswith(SCALE_SUFFIX)]

    def names(self):
        return self._names

    def stored_bytes(self, name: str) -> int:
        scale = self.files.tensors.get(name + SCALE_SUFFIX)
        return self.files.info(name).nbytes + (scale.nbytes if scale else 0)

    def read(self, name: str) -> torch.Tensor:
        info = self.files.info(name)
        if info.dtype in FLOAT_DTYPES:
            return self.files.raw(name)
        if info.dtype != "F8_E4M3":
            raise CheckpointError(f"tensor {name!r} in {info.file.name} has dtype {info.dtype}; FP8 weights must be F8_E4M3")
        if len(info.shape) != 2:
            raise CheckpointError(f"FP8 tensor {name!r} in {info.file.name} has shape {list(info.shape)}; block scales need a matrix")
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.files.tensors:
            raise CheckpointError(f"FP8 tensor {name!r} in {info.file.name} has no scale tensor {scale_name!r}")
        scale = self.files.info(scale_name)
        if scale.dtype not in SCALE_DTYPES:
            raise CheckpointError(f"scale tensor {scale_name!r} in {scale.file.name} has unsupported dtype {scale.dtype}")
        (o, i), (b0, b1) = info.shape, self.block
        check_scale_shape(scale_name, scale.file.name, scale.shape, (math.ceil(o / b0), math.ceil(i / b1)),
                          f"one per {b0}x{b1} block of {[o, i]}")
        return dequantize_blocks(self.files.raw(name), self.files.raw(scale_name), self.block)
