"""Checkpoint sources: readers behind one interface (base.TensorSource) that yield named tensors."""

from __future__ import annotations

from pathlib import Path

from services.common.errors import CheckpointError, ConfigError
from services.common.sources.base import QuantizedWeight, TensorSource
from services.common.sources.compressed_tensors import CompressedInt4Source
from services.common.sources.fp8 import Fp8Source
from services.common.sources.gguf import GgufSource
from services.common.sources.gguf_file import GgufFile
from services.common.sources.gguf_meta import check_agrees
from services.common.sources.mxfp4 import Mxfp4Source
from services.common.sources.plain import PlainSource
from services.common.sources.safetensors import SafetensorsFiles

QUANT_METHODS = ("fp8", "compressed-tensors", "mxfp4")

__all__ = ["QuantizedWeight", "TensorSource", "gguf_in", "open_source"]


def open_source(model_dir: Path, config: dict) -> TensorSource:
    """The directory's weights: its GGUF model if it holds one instead of safetensors, else its
    safetensors, read as config.json's quantization_config says."""
    gguf = gguf_in(model_dir)
    return _gguf_source(gguf, config, model_dir) if gguf else open_safetensors(model_dir, config)


def gguf_in(model_dir: Path) -> Path | None:
    """The GGUF model a directory holds instead of safetensors (its first file when split), if any."""
    if any(model_dir.glob("*.safetensors")):
        return None
    files = sorted(model_dir.glob("*.gguf"))
    firsts = [f for f in files if "-of-" not in f.name or "-00001-of-" in f.name]
    if len(firsts) > 1:
        raise CheckpointError(f"{model_dir} holds several GGUF models ({', '.join(f.name for f in firsts)}); pick one with --gguf")
    return firsts[0] if firsts else None


def _gguf_source(path: Path, config: dict, model_dir: Path) -> TensorSource:
    g = GgufFile(path.resolve())
    check_agrees(g, config, model_dir / "config.json")
    return GgufSource(g, config)


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
    if method == "mxfp4":
        return Mxfp4Source(files, qcfg)
    raise ConfigError(
        f"config.json: quantization_config quant_method {method!r} is not supported (supported: {', '.join(QUANT_METHODS)})"
    )
