"""MXFP4 safetensors (gpt-oss's release): config.json's quantization_config quant_method "mxfp4".

A quantized expert tensor X is stored as X_blocks uint8 [E, N, G, 16] (N output rows, G blocks of 32
inputs, two E2M1 values a byte, the low nibble first) and X_scales uint8 [E, N, G], the block's
scale 2^(s - 127). The Hugging Face tensor X is [E, G * 32, N], applied as x @ X[e] (transformers'
own layout after its MXFP4 dequantization); everything else is stored in a float dtype.
E2M1 values times 2 are integers, so a block is the int4 format's 16 levels (MXFP4_LEVELS) times
2^(s - 128): exact in the packed layer where that power of two is an fp16 (s - 128 in [-24, 15]);
a tensor with a scale outside that range is quantized again from its floats instead.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.errors import CheckpointError
from services.common.sources.base import QuantizedWeight
from services.common.sources.plain import PlainSource
from services.common.sources.safetensors import SafetensorsFiles

BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# 2 x the E2M1 values, sorted (both zeros are one level), and 16: a level no code uses (the int4
# format takes 16 strictly increasing levels).
MXFP4_LEVELS = (-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12, 16)
_CODE = np.array([MXFP4_LEVELS.index(int(2 * v)) for v in E2M1], dtype=np.uint8)  # nibble -> level index
_LUT = torch.tensor(E2M1, dtype=torch.float32)
FP16_EXPONENTS = range(-24, 16)  # powers of two an fp16 holds exactly (subnormals included)


class Mxfp4Source(PlainSource):
    kind = "mxfp4 safetensors"

    def __init__(self, files: SafetensorsFiles, qcfg: dict):
        super().__init__(files)
        self._packed = {n[: -len(BLOCKS)]: n[: -len(BLOCKS)] for n in files.tensors if n.endswith(BLOCKS)}
        self._names = [n for n in files.tensors if not n.endswith((BLOCKS, SCALES))] + list(self._packed)

    def names(self):
        return self._names

    def _parts(self, name: str):
        blocks, scales = self.files.info(name + BLOCKS), self.files.tensors.get(name + SCALES)
        if scales is None:
            raise CheckpointError(f"MXFP4 tensor {name + BLOCKS!r} in {blocks.file.name} has no {name + SCALES!r}")
        if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[-1] != 16:
            raise CheckpointError(f"tensor {name + BLOCKS!r} must be uint8 [E, N, G, 16], got {blocks.dtype} {list(blocks.shape)}")
        if scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise CheckpointError(
                f"scale tensor {name + SCALES!r} in {scales.file.name} is {scales.dtype} {list(scales.shape)}, "
                f"expected U8 {list(blocks.shape[:-1])} (one per block of 32)"
            )
        return blocks, scales

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._packed:
            return super().shape(name)
        e, n, g, _ = self._parts(name)[0].shape
        return e, 32 * g, n

    def stored_bytes(self, name: str) -> int:
        if name not in self._packed:
            return super().stored_bytes(name)
        return sum(part.nbytes for part in self._parts(name))

    def read(self, name: str) -> torch.Tensor:
        if name not in self._packed:
            return super().read(name)
        self._parts(name)
        blocks, scales = self.files.raw(name + BLOCKS), self.files.raw(name + SCALES)  # [E, N, G, 16], [E, N, G]
        values = torch.stack((_LUT[(blocks & 0x0F).long()], _LUT[(blocks >> 4).long()]), dim=-1).flatten(-2)
        w = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)  # [E, N, G, 32]
        return w.flatten(-2).transpose(1, 2).contiguous()  # [E, K, N]

    def quantized(self, name: str, index: int | None = None) -> QuantizedWeight | None:
        """Expert `index` of a stacked MXFP4 tensor as int4 codes [N, K] with power-of-two fp16 scales
        [N, G] (rows are output features: the kernels' layout)."""
        if name not in self._packed or index is None:
            return None
        self._parts(name)
        blocks = self.files.raw(name + BLOCKS)[index].numpy()  # [N, G, 16]
        exponents = self.files.raw(name + SCALES)[index].numpy().astype(np.int32) - 128  # [N, G]
        if exponents.min() < FP16_EXPONENTS.start or exponents.max() >= FP16_EXPONENTS.stop:
            return None
        n = blocks.shape[0]
        codes = np.stack((_CODE[blocks & 0x0F], _CODE[blocks >> 4]), axis=-1).reshape(n, -1)
        scales = np.ldexp(np.float32(1), exponents).astype(np.float16).view(np.uint16)
        return QuantizedWeight("int4", codes, scales, 32, MXFP4_LEVELS)
