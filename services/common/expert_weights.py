"""Reading one layer's routed experts from a checkpoint, and packing them for the native kernels.

Shared by the dense side's in-process backends and the expert server.
E experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.checkpoint import Checkpoint
from services.common.errors import ConfigError
from services.common.model_config import ModelConfig

FORMATS = ("bf16", "int8", "int4")
DEFAULT_GROUP_SIZE = 32


def load_expert_stacks(checkpoint: Checkpoint, cfg: ModelConfig, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's routed experts as w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I]."""
    d, i = cfg.hidden_size, cfg.moe.intermediate_size
    w13, w2 = [], []
    for e in range(cfg.moe.num_experts):
        gate, up, down = cfg.expert_tensor_names(layer, e)
        w13.append(torch.cat((checkpoint.get(gate, (i, d)), checkpoint.get(up, (i, d)))))
        w2.append(checkpoint.get(down, (d, i)))
    return torch.stack(w13), torch.stack(w2)


def pack_layer(checkpoint: Checkpoint, cfg: ModelConfig, layer: int, fmt: str, group_size: int, pool) -> np.ndarray:
    """The layer's experts quantized and packed into one flat tandem_native buffer (uint8)."""
    import tandem_native

    if fmt not in FORMATS:
        raise ConfigError(f"expert format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    w13, w2 = load_expert_stacks(checkpoint, cfg, layer)
    return tandem_native.pack_experts(
        w13.float().contiguous().numpy(), w2.float().contiguous().numpy(), fmt, group_size, pool
    )


def default_threads() -> int:
    """Physical cores available to this process (SMT siblings counted once)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))
