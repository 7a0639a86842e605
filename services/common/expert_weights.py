"""Reading one layer's routed experts from a checkpoint, and packing them for the native kernels.

Shared by the dense side's in-process backends and the expert server.
E experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.common.checkpoint import Checkpoint
from services.common.sources import QuantizedWeight
from services.common.errors import ConfigError
from services.common.model_config import ModelConfig

FORMATS = ("bf16", "int8", "int4", "int4_asym")
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class ExpertTensors:
    """One routed expert as the kernels take it: w13 [2I, D] (gate rows, then up rows), w2 [D, I],
    and (gpt-oss) the biases b13 [2I] and b2 [D]."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None


class LayerExperts:
    """A layer's routed experts in float32, expert by expert; gpt-oss's stacked tensors, which hold
    every expert ([E, D, 2I] gate_up_proj with gate and up columns interleaved and [E, I, D]
    down_proj, both applied as x @ W, with biases [E, 2I] and [E, D]), are read once."""

    def __init__(self, checkpoint: Checkpoint, cfg: ModelConfig, layer: int):
        self.checkpoint, self.cfg, self.layer = checkpoint, cfg, layer
        self._stacked = self._biases = None

    def __getitem__(self, e: int) -> ExpertTensors:
        d, i = self.cfg.hidden_size, self.cfg.moe.intermediate_size
        if not self.cfg.moe.stacked:
            gate, up, down = self.cfg.expert_tensor_names(self.layer, e)
            w13 = torch.cat((self.checkpoint.get(gate, (i, d)), self.checkpoint.get(up, (i, d)))).float()
            return ExpertTensors(w13, self.checkpoint.get(down, (d, i)).float())
        gate_up, down = self._stacked or self._read_stacked()
        w13 = torch.cat((gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T)).contiguous()
        return ExpertTensors(w13, down[e].T.contiguous(), *self.biases(e))

    def biases(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked experts' biases b13 [2I] (gate, then up) and b2 [D], read without the weights."""
        d, i, n = self.cfg.hidden_size, self.cfg.moe.intermediate_size, self.cfg.moe.num_experts
        if self._biases is None:
            gate_up, _, down = self.cfg.expert_tensor_names(self.layer, 0)
            self._biases = (self.checkpoint.get(gate_up + "_bias", (n, 2 * i)).float(),
                            self.checkpoint.get(down + "_bias", (n, d)).float())
        b_gate_up, b_down = self._biases
        return torch.cat((b_gate_up[e][0::2], b_gate_up[e][1::2])), b_down[e].contiguous()

    def _read_stacked(self):
        d, i, n = self.cfg.hidden_size, self.cfg.moe.intermediate_size, self.cfg.moe.num_experts
        gate_up, _, down = self.cfg.expert_tensor_names(self.layer, 0)
        self._stacked = (self.checkpoint.get(gate_up, (n, d, 2 * i)).float(), self.checkpoint.get(down, (n, i, d)).float())
        return self._stacked

    def stored_bytes(self, e: int) -> int:
        """What expert e takes in the checkpoint's files (its share of stacked tensors)."""
        names = self.cfg.expert_tensor_names(self.layer, e)
        if not self.cfg.moe.stacked:
            return sum(self.checkpoint.stored_bytes(n) for n in names)
        gate_up, _, down = names
        parts = (gate_up, down, gate_up + "_bias", down + "_bias")
        return sum(self.checkpoint.stored_bytes(n) for n in parts) // self.cfg.moe.num_experts


def load_expert_stacks(checkpoint: Checkpoint, cfg: ModelConfig, layer: int) -> ExpertTensors:
    """One layer's routed experts stacked: w13 [E, 2I, D], w2 [E, D, I] (and biases [E, 2I], [E, D])."""
    layer_experts = LayerExperts(checkpoint, cfg, layer)
    experts = [layer_experts[e] for e in range(cfg.moe.num_experts)]
    stack = lambda name: torch.stack([getattr(x, name) for x in experts]) if getattr(experts[0], name) is not None else None  # noqa: E731
    return ExpertTensors(stack("w13"), stack("w2"), stack("b13"), stack("b2"))


KINDS = ("gate", "up", "down")


def pack_layer(checkpoint: Checkpoint, cfg: ModelConfig, layer: int, fmt: str, group_size: int, pool,
               progress: Callable[[int], None] | None = None, errors: dict | None = None,
               error_samples: int = 0) -> np.ndarray:
    """The layer's experts packed into one flat tandem_native buffer (uint8), one expert at a time
    (progress gets each expert's stored bytes once it is in).

    Tensors whose stored codes are already `fmt`'s (see sources.base.QuantizedWeight) are copied in
    as they are, with the checkpoint's group size and levels; the rest are quantized from floats, and
    with `errors` given, errors[kind] accumulates [squared error, squared norm] of each kind of those,
    over `error_samples` experts spread across the layer (all of them if 0).
    """
    import tandem_native

    if fmt not in FORMATS:
        raise ConfigError(f"expert format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    m, d, i = cfg.moe, cfg.hidden_size, cfg.moe.intermediate_size
    names = [cfg.expert_tensor_names(layer, e) for e in range(m.num_experts)]
    known = next((q for q in _stored_codes(checkpoint, names[0], fmt, d, i, m.stacked, 0) if q), None)
    group = known.group if known else group_size
    levels = list(known.levels) if known and fmt == "int4" else None
    buf = tandem_native.new_layer(fmt, m.num_experts, d, i, group, levels, m.activation, m.swiglu_alpha,
                                  m.swiglu_limit, m.expert_bias)
    floats = LayerExperts(checkpoint, cfg, layer)
    step = max(1, m.num_experts // error_samples) if error_samples else 1
    for e, expert in enumerate(names):
        codes = [q if q and q.group == group and (levels is None or list(q.levels) == levels) else None
                 for q in _stored_codes(checkpoint, expert, fmt, d, i, m.stacked, e)]
        if not all(codes):
            x = floats[e]
            w13, w2 = x.w13.numpy(), x.w2.numpy()
            tandem_native.pack_into(buf, e, w13[None], w2[None], pool)
            if errors is not None and e % step == 0:
                _add_errors(errors, buf, e, codes, w13, w2)
        if m.expert_bias:
            tandem_native.put_biases(buf, e, *(b.numpy() for b in floats.biases(e)))
        _put(buf, e, codes, i)
        if progress:
            progress(floats.stored_bytes(e))
    return buf


def _stored_codes(checkpoint: Checkpoint, expert: tuple[str, str, str], fmt: str, d: int, i: int,
                  stacked: bool = False, e: int = 0) -> list:
    """Each of expert e's (gate, up, down) stored codes when they are in `fmt` with a group the
    kernels take, else None. Stacked (gpt-oss) gate_up codes are rows of gate and up interleaved."""
    if fmt == "bf16":
        return [None, None, None]
    if stacked:
        gate_up = checkpoint.quantized(expert[0], index=e)
        codes = [_rows(gate_up, 0), _rows(gate_up, 1), checkpoint.quantized(expert[2], index=e)]
    else:
        shapes = ((i, d), (i, d), (d, i))
        codes = [checkpoint.quantized(name, shape) for name, shape in zip(expert, shapes)]
    return [q if q is not None and q.format == fmt and q.group % 32 == 0 and d % q.group == 0 and i % q.group == 0
            else None for q in codes]


def _rows(q: QuantizedWeight | None, first: int) -> QuantizedWeight | None:
    """Every other row of q from `first` (one half of interleaved gate and up rows)."""
    if q is None:
        return None
    take = lambda a: None if a is None else np.ascontiguousarray(a[first::2])  # noqa: E731
    return QuantizedWeight(q.format, take(q.codes), take(q.scales), q.group, q.levels, take(q.mins))


def _put(buf: np.ndarray, e: int, codes: list, i: int) -> None:
    import tandem_native

    for q, (matrix, row0) in zip(codes, (("w13", 0), ("w13", i), ("w2", 0))):
        if q is not None:
            tandem_native.put_codes(buf, e, matrix, row0, q.codes, q.scales, q.mins)


def _add_errors(errors: dict, buf: np.ndarray, e: int, codes: list, w13: np.ndarray, w2: np.ndarray) -> None:
    import tandem_native

    i = w13.shape[0] // 2
    packed13, packed2 = tandem_native.dequantize(buf, e, "w13"), tandem_native.dequantize(buf, e, "w2")
    parts = ((packed13[:i], w13[:i]), (packed13[i:], w13[i:]), (packed2, w2))
    for kind, q, (got, want) in zip(KINDS, codes, parts):
        if q is None:
            acc = errors.setdefault(kind, [0.0, 0.0])
            acc[0] += float(np.square(got - want, dtype=np.float64).sum())
            acc[1] += float(np.square(want, dtype=np.float64).sum())


def packed_bytes(cfg: ModelConfig, fmt: str, group_size: int = DEFAULT_GROUP_SIZE, layers: list[int] | None = None) -> int:
    """Bytes of the packed experts of these MoE layers (default: all of them)."""
    import tandem_native

    m = cfg.moe
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)] if layers is None else layers
    return len(layers) * tandem_native.packed_bytes(fmt, m.num_experts, cfg.hidden_size, m.intermediate_size, group_size,
                                                    m.expert_bias)


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
