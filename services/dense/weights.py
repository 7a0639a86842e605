"""Loads named checkpoint tensors onto the dense side's device and dtype, checking shapes; the
dense linears in the runtime's weight format (float, or packed for the native kernels).

Shapes: M rows (tokens), I input features, O output features (of several linears, side by side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from services.common.checkpoint import Checkpoint
from services.common.expert_weights import DEFAULT_GROUP_SIZE
from services.dense.layers import native_ops


ROW_BLOCK = 4
# (requested dense format, the format a linear is packed in) -> stored code formats imported as they are
TAKES = {("int4", "int4"): ("int4", "int4_asym"), ("int4", "int8"): ("int8", "int4", "int4_asym"),
         ("int4_asym", "int8"): ("int8", "int4", "int4_asym"), ("int8", "bf16"): ("int8",)}
# The format one step finer than a packed dense format: lm_head's, and the key and value projections'
FINER = {"int8": "bf16", "int4": "int8", "int4_asym": "int8"}
# Bytes per weight of each packed format, scales included (group of 32), for memory estimates.
PACKED_BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0625, "int4": 0.5625, "int4_asym": 0.625}


def kv_format(weights: str, routed_experts: int) -> str:
    """The key and value projections' packed format under a dense format request: the next finer one
    under int8 (bf16), and under a 4-bit request where the model has 8 routed experts, as llama.cpp's
    4-bit types give attn_k and attn_v Q8_0 there only (llama-quant.cpp): small tensors whose rounding
    the cache holds for every later token. Elsewhere the request's own."""
    if weights == "int8" or (weights in ("int4", "int4_asym") and routed_experts == 8):
        return FINER[weights]
    return weights


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is independent of the batch around it (batch invariance).

    CPU BLAS picks kernels by the row count, so a token's result would change with its batch-mates;
    rows padded to a multiple of ROW_BLOCK always take the same kernels (checked in the tests).
    x [M, I], weight [O, I] -> [M, O].
    """
    m = x.shape[0]
    pad = -m % ROW_BLOCK
    if x.device.type != "cpu" or x.dim() != 2 or not pad:
        return F.linear(x, weight, bias)
    return F.linear(torch.cat((x, x.new_zeros(pad, x.shape[1]))), weight, bias)[:m]


@dataclass(frozen=True)
class Linear:
    weight: torch.Tensor  # [O, I]
    bias: torch.Tensor | None = None  # [O]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# Up to this many rows a packed linear's call is a decode step's (WarmChain); the first bytes of each
# matrix the chain reads ahead (about what a decode step's small ops between two calls give time for).
WARM_ROWS = 16
WARM_MAX_BYTES = 4 << 20


class WarmChain:
    """Reads the next packed linear's weights into the caches while a decode step's small ops run
    between two native calls (norms, rope, attention, routing: the memory idles meanwhile, and the
    next call would read its weights from DRAM): an idle helper of the pool reads them
    (ThreadPool.warm) until that call starts. A step calls its linears in the same order every
    time; the chain follows the latest order it saw."""

    def __init__(self, pool):
        self.pool = pool
        # id(linear) -> (the linear called after it, that one's ranges to read ahead, capped)
        self.following: dict[int, tuple[object, tuple[tuple[int, int], ...]]] = {}
        self.last = None

    def after(self, linear) -> None:
        """Called as `linear` (PackedLinear or PackedLinears) returns from a decode-sized call."""
        if self.last is not None and self.following.get(id(self.last), (None,))[0] is not linear:
            self.following[id(self.last)] = (linear, tuple((a, min(n, WARM_MAX_BYTES)) for a, n in linear.ranges()))
        self.last = linear
        for address, nbytes in self.following.get(id(linear), (None, ()))[1]:
            self.pool.warm(address, nbytes)


def _packed_forward(linears: tuple, width: int, pool, x: torch.Tensor) -> torch.Tensor:
    """x [M, I] -> the linears' outputs side by side [M, width], in one native call on float32
    activations, returned in x's dtype."""
    x32 = x.detach().to(torch.float32).contiguous()
    out = torch.empty((x.shape[0], width), dtype=torch.float32)
    native_ops.tandem_native.linears_forward(list(linears), x32.numpy(), out.numpy(), pool)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


@dataclass(frozen=True)
class PackedLinear:
    """A dense linear held in a packed format and computed by the native kernels (one always-active
    expert's matrix): float32 activations in, float32 out, returned in x's dtype."""

    packed: object  # tandem_native.Linear
    pool: object    # tandem_native.ThreadPool
    chain: WarmChain | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, I] -> [M, O]
        out = self.forward(x)
        if self.chain is not None and x.shape[0] <= WARM_ROWS:
            self.chain.after(self)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_forward((self.packed,), self.packed.out_features, self.pool, x)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.packed.address, self.packed.nbytes),)


@dataclass(frozen=True)
class PackedLinears:
    """Packed linears of one input in different formats, their outputs side by side (one native call)."""

    parts: tuple[PackedLinear, ...]
    chain: WarmChain | None = None
    packed: tuple = field(init=False)  # the parts' tandem_native.Linear, in order
    width: int = field(init=False)  # sum O

    def __post_init__(self):
        object.__setattr__(self, "packed", tuple(p.packed for p in self.parts))
        object.__setattr__(self, "width", sum(p.packed.out_features for p in self.parts))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, I] -> [M, sum O]
        out = _packed_forward(self.packed, self.width, self.parts[0].pool, x)
        if self.chain is not None and x.shape[0] <= WARM_ROWS:
            self.chain.after(self)
        return out

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(r for p in self.parts for r in p.ranges())


@dataclass(frozen=True)
class ExactLinear:
    """A small float32 linear the native pool computes row by row, every value summed in one fixed
    order (a row's result does not depend on the batch around it, without padding the rows as
    `linear` does for BLAS): a router's, whose top-k a rounding difference could flip. Joins the
    decode step's WarmChain, so its weights are read ahead while the small ops before it run."""

    weight: torch.Tensor  # [O, I] float32, contiguous
    bias: torch.Tensor | None  # [O] float32
    pool: object
    chain: WarmChain | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, I] -> [M, O] float32
        x32 = x.detach().to(torch.float32).contiguous()
        out = torch.empty((x.shape[0], self.weight.shape[0]), dtype=torch.float32)
        native_ops.tandem_native.linear_f32(x32.numpy(), self.weight.numpy(), None if self.bias is None else self.bias.numpy(),
                                 out.numpy(), self.pool)
        if self.chain is not None and x.shape[0] <= WARM_ROWS:
            self.chain.after(self)
        return out

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.weight.data_ptr(), self.weight.nbytes),)


class WeightLoader:
    """weights: "float" keeps linears as dtype tensors; a packed format ("bf16", "int8", "int4",
    "int4_asym") packs them for the native kernels on `pool`, importing a checkpoint's stored codes
    as they are where they are that format (an int4 request also takes stored int4_asym codes)."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, weights: str = "float",
                 pool=None, routed_experts: int = 0):
        self.checkpoint = checkpoint
        self.routed_experts = routed_experts  # the model's, for kv_format
        self.dtype = dtype
        self.device = device
        self.weights = weights
        self.pool = pool
        self.chain = WarmChain(pool) if weights != "float" and pool is not None else None

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        raw = self.checkpoint.get(name, shape)
        return raw.to(device=self.device, dtype=dtype or self.dtype)

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear | PackedLinear:
        return self.linears([prefix], [out_features], in_features, bias)

    def linears(self, prefixes: list[str], outs: list[int], in_features: int, bias: bool = False,
                fmt: str | None = None) -> Linear | PackedLinear | PackedLinears:
        """Linears of one input as one: their weights' rows stacked ([sum O, I]), outputs side by side
        (packed, the runs of parts that get one format each make one native linear)."""
        if self.weights != "float":
            formats = [fmt or self.part_format(p) for p in prefixes]
            runs = [(f, [i for i, g in enumerate(formats) if g == f]) for f in dict.fromkeys(formats)]
            if len(runs) == 1:
                return PackedLinear(self._pack(prefixes, outs, in_features, bias, formats[0]), self.pool, self.chain)
            assert all(ix == list(range(ix[0], ix[-1] + 1)) for _, ix in runs), "parts of one format must be adjacent"
            return PackedLinears(tuple(PackedLinear(self._pack([prefixes[i] for i in ix], [outs[i] for i in ix], in_features,
                                                               bias, f), self.pool) for f, ix in runs), self.chain)
        weights = [self.tensor(f"{p}.weight", (o, in_features)) for p, o in zip(prefixes, outs)]
        biases = [self.tensor(f"{p}.bias", (o,)) for p, o in zip(prefixes, outs)] if bias else None
        join = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
        return Linear(join(weights), join(biases) if biases else None)

    def part_format(self, prefix: str) -> str:
        """A dense linear's packed format: the request's, the key and value projections' kv_format."""
        if prefix.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
            return kv_format(self.weights, self.routed_experts)
        return self.weights

    def output_linear(self, prefix: str, out_features: int, in_features: int) -> Linear | PackedLinear:
        """lm_head in the next finer format: int8 under a 4-bit request (as llama.cpp's 4-bit types keep
        output.weight in 6 or 8 bits: its logits carry every token's rounding, and a small model's
        perplexity shows it), bf16 under int8 (as vLLM leaves lm_head unquantized: the int8 rounding of
        the final hidden state's outlier channels was most of the default model's int8 increase),
        unless the checkpoint stores it in codes the request takes, which import as they are."""
        return self.linears([prefix], [out_features], in_features, fmt=FINER.get(self.weights, self.weights))

    def float_linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear:
        """A linear kept as dtype tensors whatever the weight format (its weight is used as a tensor)."""
        weight = self.tensor(f"{prefix}.weight", (out_features, in_features))
        return Linear(weight, self.tensor(f"{prefix}.bias", (out_features,)) if bias else None)

    def router(self, prefix: str, out_features: int, in_features: int, bias: bool = False) -> Linear | ExactLinear:
        """A router's linear in float32 (as the reference models compute it): native and exact where
        the dense linears are packed on the CPU, else a torch Linear."""
        weight = self.tensor(f"{prefix}.weight", (out_features, in_features), torch.float32).contiguous()
        b = self.tensor(f"{prefix}.bias", (out_features,), torch.float32) if bias else None
        if self.pool is None or self.device.type != "cpu":
            return Linear(weight, b)
        return ExactLinear(weight, b, self.pool, self.chain)

    def norm(self, prefix: str, size: int) -> torch.Tensor:
        return self.tensor(f"{prefix}.weight", (size,)).contiguous()

    def _pack(self, prefixes: list[str], outs: list[int], in_features: int, bias: bool, fmt: str):
        import tandem_native

        names = [f"{p}.weight" for p in prefixes]
        stored = self._stored_codes(names, outs, in_features, fmt)
        if stored:
            first = stored[0]
            packed = tandem_native.Linear(first.format, sum(outs), in_features, first.group, list(first.levels) or None)
        else:
            packed = tandem_native.Linear(fmt, sum(outs), in_features, DEFAULT_GROUP_SIZE)
        row0 = 0
        for i, (name, out) in enumerate(zip(names, outs)):
            if stored:
                q = stored[i]
                packed.put_codes(row0, q.codes, q.scales, q.mins)
            else:
                w = self.checkpoint.get(name, (out, in_features)).to(torch.float32).contiguous()
                packed.pack(w.numpy(), self.pool, row0)
            row0 += out
        if bias:
            b = [self.checkpoint.get(f"{p}.bias", (o,)).to(torch.float32) for p, o in zip(prefixes, outs)]
            packed.set_bias(np.ascontiguousarray(torch.cat(b).numpy()))
        return packed

    def _stored_codes(self, names: list[str], outs: list[int], in_features: int, fmt: str) -> list | None:
        """Every part's stored codes when they are all of one packed format the request keeps (the
        same group and levels), else None: the weights are quantized from floats. An int4 request
        also takes int4_asym codes; the next finer format (FINER) takes the request's own and finer."""
        if fmt == "bf16" and (self.weights, fmt) not in TAKES:
            return None
        takes = TAKES.get((self.weights, fmt), (fmt,))
        codes = [self.checkpoint.quantized(n, (o, in_features)) for n, o in zip(names, outs)]
        if any(q is None for q in codes):
            return None
        first = codes[0]
        same = all((q.format, q.group, tuple(q.levels)) == (first.format, first.group, tuple(first.levels)) for q in codes)
        fits = first.format in takes and first.group % 32 == 0 and in_features % first.group == 0
        return codes if same and fits else None
