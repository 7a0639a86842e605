"""Reading one layer's routed experts from a checkpoint, and packing them for the native kernels.

Shared by the dense side's in-process backends and the expert server.
E experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable

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


def pack_layer(checkpoint: Checkpoint, cfg: ModelConfig, layer: int, fmt: str, group_size: int, pool,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
    """The layer's experts packed into one flat tandem_native buffer (uint8), one expert at a time
    (progress gets each expert's stored bytes once it is in).

    Experts whose stored codes are already `fmt`'s (see sources.base.QuantizedWeight) are copied in
    as they are, with the checkpoint's group size and levels; the rest are quantized from floats.
    """
    import tandem_native

    if fmt not in FORMATS:
        raise ConfigError(f"expert format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    m, d = cfg.moe, cfg.hidden_size
    names = [cfg.expert_tensor_names(layer, e) for e in range(m.num_experts)]
    first = _importable(checkpoint, names[0], fmt, d, m.intermediate_size)
    group = first[0].group if first else group_size
    levels = list(first[0].levels) if first and fmt == "int4" else None
    buf = tandem_native.new_layer(fmt, m.num_experts, d, m.intermediate_size, group, levels)
    for e, expert in enumerate(names):
        codes = _importable(checkpoint, expert, fmt, d, m.intermediate_size)
        if codes and all(q.group == group and (levels is None or list(q.levels) == levels) for q in codes):
            _put(buf, e, codes, m.intermediate_size)
        else:
            w13, w2 = _float_expert(checkpoint, expert, d, m.intermediate_size)
            tandem_native.pack_into(buf, e, w13[None], w2[None], pool)
        if progress:
            progress(sum(checkpoint.stored_bytes(n) for n in expert))
    return buf


def _importable(checkpoint: Checkpoint, expert: tuple[str, str, str], fmt: str, d: int, i: int):
    """The expert's (gate, up, down) stored codes when all three are in `fmt` with a group the
    kernels take; None otherwise."""
    if fmt == "bf16":
        return None
    gate, up, down = expert
    codes = (checkpoint.quantized(gate, (i, d)), checkpoint.quantized(up, (i, d)), checkpoint.quantized(down, (d, i)))
    ok = all(q is not None and q.format == fmt for q in codes)
    group = codes[0].group if ok else 0
    if not ok or any(q.group != group for q in codes) or group % 32 or d % group or i % group:
        return None
    return codes


def _put(buf: np.ndarray, e: int, codes, i: int) -> None:
    import tandem_native

    gate, up, down = codes
    tandem_native.put_codes(buf, e, "w13", 0, gate.codes, gate.scales)
    tandem_native.put_codes(buf, e, "w13", i, up.codes, up.scales)
    tandem_native.put_codes(buf, e, "w2", 0, down.codes, down.scales)


def _float_expert(checkpoint: Checkpoint, expert: tuple[str, str, str], d: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert as float32 w13 [2I, D] and w2 [D, I]."""
    gate, up, down = expert
    w13 = torch.cat((checkpoint.get(gate, (i, d)), checkpoint.get(up, (i, d)))).float().contiguous()
    return w13.numpy(), checkpoint.get(down, (d, i)).float().contiguous().numpy()


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
