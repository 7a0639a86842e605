"""compressed-tensors "pack-quantized" INT4 safetensors (Kimi-K2-Thinking's routed experts).

A quantized weight X.weight is stored as X.weight_packed int32 [O, I / 8] (8 nibbles per word,
least significant first, value = nibble - 8), X.weight_scale [O, I / G] and X.weight_shape [2];
symmetric, one scale per G columns. Modules on the config's `ignore` list are stored in a float
dtype under their plain names. Uniform 4-bit with a scale per group is the packed int4 format with
levels -8..7, so these weights import exactly (quantized()).
"""

from __future__ import annotations

import torch

from services.common.errors import CheckpointError, ConfigError
from services.common.sources.base import QuantizedWeight, fp16_bits
from services.common.sources.plain import PlainSource
from services.common.sources.safetensors import FLOAT_DTYPES, SafetensorsFiles

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
UNSUPPORTED = (".weight_zero_point", ".weight_g_idx")
UNIFORM_LEVELS = tuple(range(-8, 8))
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def check_config(qcfg: dict) -> None:
    """Accepts weight-only, symmetric, grouped 4-bit int pack-quantized configs."""
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("config.json: compressed-tensors quantization_config has no config_groups")
    for key, group in groups.items():
        fmt = group.get("format") or qcfg.get("format")
        weights = group.get("weights") or {}
        scheme = (weights.get("num_bits"), weights.get("type"), weights.get("symmetric"), weights.get("strategy"))
        if fmt != "pack-quantized" or scheme != (4, "int", True, "group") or group.get("input_activations"):
            raise ConfigError(
                f"config.json: compressed-tensors group {key!r} ({fmt}, {weights.get('num_bits')}-bit "
                f"{weights.get('type')}, symmetric={weights.get('symmetric')}, strategy={weights.get('strategy')}, "
                f"activations {'quantized' if group.get('input_activations') else 'float'}) is not supported: "
                "only weight-only pack-quantized symmetric 4-bit int with group scales"
            )


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [O, W] -> the nibbles uint8 [O, 8W], column 8w + k from bits 4k .. 4k + 3 of word w."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8).reshape(packed.shape[0], -1)


class CompressedInt4Source(PlainSource):
    kind = "compressed-tensors int4 safetensors"

    def __init__(self, files: SafetensorsFiles, qcfg: dict):
        super().__init__(files)
        check_config(qcfg)
        self._packed = {n[: -len(PACKED)] + ".weight": n[: -len(PACKED)] for n in files.tensors if n.endswith(PACKED)}
        parts = (PACKED, SCALE, SHAPE, *UNSUPPORTED)
        plain = [n for n in files.tensors if not n.endswith(parts)]
        self._names = plain + list(self._packed)

    def names(self):
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._packed:
            return super().shape(name)
        o, w = self.files.info(self._packed[name] + PACKED).shape
        return o, 8 * w

    def stored_bytes(self, name: str) -> int:
        if name not in self._packed:
            return super().stored_bytes(name)
        parts = (self._packed[name] + suffix for suffix in (PACKED, SCALE, SHAPE))
        return sum(self.files.tensors[p].nbytes for p in parts if p in self.files.tensors)

    def _codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The weight's nibbles [O, I], its scales [O, I / G] and G, checked against each other."""
        base = self._packed[name]
        packed = self.files.info(base + PACKED)
        if packed.dtype != "I32" or len(packed.shape) != 2:
            raise CheckpointError(f"tensor {base + PACKED!r} in {packed.file.name} must be int32 [O, I / 8]")
        for suffix in UNSUPPORTED:
            if base + suffix in self.files.tensors:
                raise CheckpointError(f"tensor {base + suffix!r}: asymmetric or act-order int4 is not supported")
        for suffix in (SCALE, SHAPE):
            if base + suffix not in self.files.tensors:
                raise CheckpointError(f"int4 tensor {base + PACKED!r} has no {base + suffix!r}")
        o, i = self.shape(name)
        stored = tuple(int(v) for v in self.files.raw(base + SHAPE).tolist())
        if stored != (o, i):
            raise CheckpointError(f"tensor {base + SHAPE!r} says {list(stored)}, but {base + PACKED!r} holds {[o, i]}")
        scale = self.files.info(base + SCALE)
        if scale.dtype not in FLOAT_DTYPES or len(scale.shape) != 2 or scale.shape[0] != o or not scale.shape[1] \
                or i % scale.shape[1]:
            raise CheckpointError(
                f"scale tensor {base + SCALE!r} in {scale.file.name} is {scale.dtype} {list(scale.shape)}, expected a "
                f"float [{o}, {i} / G] (one scale per group of G columns of each row)"
            )
        group = i // scale.shape[1]
        return unpack_int4(self.files.raw(base + PACKED)), self.files.raw(base + SCALE), group

    def read(self, name: str) -> torch.Tensor:
        if name not in self._packed:
            return super().read(name)
        codes, scale, group = self._codes(name)
        values = codes.to(torch.int32) - 8
        return (values.view(codes.shape[0], -1, group) * scale.float()[:, :, None]).view(codes.shape).float()

    def quantized(self, name: str, index: int | None = None) -> QuantizedWeight | None:
        if name not in self._packed:
            return None
        codes, scale, group = self._codes(name)
        bits = fp16_bits(scale)
        if bits is None:
            return None
        return QuantizedWeight("int4", codes.numpy(), bits, group, UNIFORM_LEVELS)
