"""Checkpoint sources: readers behind one interface (base.TensorSource) that yield named tensors."""

from __future__ import annotations

from pathlib import Path

from services.common.errors import ConfigError
from services.common.sources.base import QuantizedWeight, TensorSource
from services.common.sources.compressed_tensors import CompressedInt4Source
from services.common.sources.fp8 import Fp8Source
from services.common.sources.plain import PlainSource
from services.common.sources.safetensors import SafetensorsFiles

QUANT_METHODS = ("fp8", "compressed-tensors")

__all__ = ["QuantizedWeight", "TensorSource", "open_safetensors"]


def open_safetensors(model_dir: Path, config: dict) -> TensorSource:
    """The directory's safetensors, read as config.json's quantization_config says."""
    files = SafetensorsFiles(model_dir)
    qcfg = config.get("quantization_config")
    if not qcfg:
        return PlainSource(files)
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method == "fp8":
        return Fp8Source(files, qcfg)
    if method == "compressed-tensors":
        return CompressedInt4Source(files, qcfg)
    raise ConfigError(
        f"config.json: quantization_config quant_method {method!r} is not supported (supported: {', '.join(QUANT_METHODS)})"
    )
