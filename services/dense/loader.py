"""Builds the dense-path model from a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from services.common.checkpoint import Checkpoint
from services.common.model_config import ModelConfig, parse_model_config
from services.dense.models.decoder import MoeDecoder
from services.dense.moe.experts import ExpertBackend
from services.dense.moe.reference import TorchExperts
from services.dense.pool import shared_pool
from services.dense.runtime import DenseRuntime
from services.dense.weights import WeightLoader


def open_checkpoint(model_dir: str | Path) -> tuple[Checkpoint, ModelConfig]:
    checkpoint = Checkpoint(model_dir)
    return checkpoint, parse_model_config(checkpoint.config)


def load_model(
    model_dir: str | Path, runtime: DenseRuntime, experts: ExpertBackend | None = None
) -> tuple[MoeDecoder, ExpertBackend]:
    """The decoder and its expert backend; with no backend given, the in-process torch reference.

    A backend passed in owns the routed experts: the dense side then never reads their tensors.
    """
    checkpoint, cfg = open_checkpoint(model_dir)
    if experts is None:
        experts = TorchExperts(cfg, checkpoint, runtime.torch_dtype, runtime.torch_device)
    pool = shared_pool(runtime.threads, runtime.spin_us) if runtime.weights != "float" else None
    loader = WeightLoader(checkpoint, runtime.torch_dtype, runtime.torch_device, runtime.weights, pool,
                          cfg.moe.num_experts)
    return MoeDecoder(cfg, loader, experts), experts
