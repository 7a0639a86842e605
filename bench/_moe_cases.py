"""Shapes, inputs, routing, timing and the float32 reference shared by bench/kernels.py and its
kt-kernel worker (which runs in another venv, so this module needs nothing but torch).

Legend: T tokens, K experts per token, E experts in a layer, S experts in the float32 layer, n
distinct random experts, D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    inter: int
    top_k: int
    max_experts: int  # the most experts one case holds (DeepSeek-V3 has 256; memory caps us at 64)
    prefill_tokens: int  # 0: no prefill case for this shape


SHAPES = {
    s.name: s
    for s in (
        MoeShape("qwen3-30b-a3b", hidden=2048, inter=768, top_k=8, max_experts=128, prefill_tokens=512),
        MoeShape("deepseek-v3", hidden=7168, inter=2048, top_k=8, max_experts=64, prefill_tokens=0),
    )
}

# Bytes per weight, group-32 scales included; only used to choose how many experts a case holds.
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 34 / 32, "int4": 18 / 32, "int4_asym": 20 / 32}
# One case's expert weights stay under this, so a source copy plus a converted copy (and kt-kernel's
# own repacked copy) keep the process well under 14 GB.
WEIGHT_BUDGET = 3 * 2**30
# Random experts drawn per shape; a layer's other experts are copies of them, in their own memory,
# so just as cold in cache (drawing normals is far slower than copying them).
DISTINCT_EXPERTS = 8


def expert_count(shape: MoeShape, fmt: str) -> int:
    """Experts a case of this weight format holds: as many as the budget allows, a multiple of K."""
    per_expert = 3 * shape.hidden * shape.inter * BYTES_PER_WEIGHT[fmt]
    fit = int(WEIGHT_BUDGET // per_expert) // shape.top_k * shape.top_k
    return max(shape.top_k, min(shape.max_experts, fit))


def tile(t: torch.Tensor, experts: int) -> torch.Tensor:
    """[n, ...] -> [E, ...]: expert e is a copy of t[e % n], in its own memory."""
    return t[torch.arange(experts) % t.shape[0]].contiguous()


@dataclass
class Workload:
    """One shape's weights, inputs and prefill reference, identical for every implementation. Every
    layer built from it holds, as its expert e, a copy of distinct expert e % n."""

    shape: MoeShape
    w13d: torch.Tensor  # [n, 2I, D] float32 distinct experts, gate rows then up rows
    w2d: torch.Tensor  # [n, D, I] float32
    x: torch.Tensor  # [1, D] decode token
    weights: torch.Tensor  # [1, K] decode routing weights
    prefill_x: torch.Tensor | None  # [T, D]
    prefill_ids: torch.Tensor | None  # [T, K] int64, distinct per token
    prefill_weights: torch.Tensor | None  # [T, K]
    prefill_ref: torch.Tensor | None  # [T, D] float32 reference output

    @cached_property
    def w13(self) -> torch.Tensor:
        """[S, 2I, D] float32: the float32 layer, as many experts as the budget holds."""
        return tile(self.w13d, expert_count(self.shape, "fp32"))

    @cached_property
    def w2(self) -> torch.Tensor:
        """[S, D, I] float32."""
        return tile(self.w2d, expert_count(self.shape, "fp32"))

    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 output of the decode token routed to ids [1, K]."""
        return grouped_moe(self.x, ids % self.w13d.shape[0], self.weights, self.w13d, self.w2d)


def make_workload(shape: MoeShape, seed: int = 0) -> Workload:
    """Random weights with the spread of trained ones (std 1/sqrt(fan-in)) and random routing."""
    g = torch.Generator().manual_seed(seed)
    D, I, K, T = shape.hidden, shape.inter, shape.top_k, shape.prefill_tokens
    n = min(DISTINCT_EXPERTS, expert_count(shape, "fp32"))
    w13d = torch.empty(n, 2 * I, D).normal_(0, D**-0.5, generator=g)
    w2d = torch.empty(n, D, I).normal_(0, I**-0.5, generator=g)
    x, weights = torch.randn(1, D, generator=g), route_weights(1, K, g)
    if not T:
        return Workload(shape, w13d, w2d, x, weights, None, None, None, None)
    px, pw = torch.randn(T, D, generator=g), route_weights(T, K, g)
    pids = torch.rand(T, expert_count(shape, "fp32"), generator=g).argsort(dim=1)[:, :K].contiguous()
    return Workload(shape, w13d, w2d, x, weights, px, pids, pw, grouped_moe(px, pids % n, pw, w13d, w2d))


def route_weights(tokens: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    return (w / w.sum(dim=1, keepdim=True)).contiguous()


def decode_ids(per_chunk: int, chunks: int, top_k: int, calls: int, seed: int = 1) -> list:
    """(chunk, ids [1, K] int64) for each call. Call i uses chunk i % chunks and the next window of K
    experts of that chunk's fixed permutation, so an expert is read again only after every other
    expert of every chunk has been: each call's weights come from DRAM, not from cache."""
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(per_chunk, generator=g) for _ in range(chunks)]
    windows = per_chunk // top_k
    plan = []
    for i in range(calls):
        c, j = i % chunks, (i // chunks) % windows
        plan.append((c, perms[c][j * top_k : (j + 1) * top_k].view(1, top_k).contiguous()))
    return plan


def grouped_moe(x, ids, weights, w13, w2) -> torch.Tensor:
    """Tokens sorted by expert, one matmul per active expert for gate+up and one for down; math in
    the weights' dtype, sums in float32. x [T, D], ids/weights [T, K] -> [T, D] float32."""
    T, K = ids.shape
    I = w2.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*K] (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x[order // K].to(w13.dtype)  # [T*K, D]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gu = xs[start : start + n] @ w13[e].T  # [n, 2I]
            ys.append((F.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T)  # [n, D]
            start += n
    y = torch.cat(ys).float() * weights.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1]).index_add_(0, order // K, y)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def time_calls(fn, calls: int, warmup: int, budget_s: float) -> list[float]:
    """Seconds per call of fn(i), i counting from 0 through the warmup calls; stops early once the
    timed calls have used budget_s (after at least one)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(warmup, warmup + calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    return times


PROBE_BLOCKS = 4  # blocks of decode calls, with a read-bandwidth sample before, between and after
SETTLE_CALLS = 6  # untimed calls after each sample: the first few calls after a 1.7 GB torch read run slow


def time_with_probes(fn, timing: "Timing", probe: Callable[[], float], bytes_per_call: float) -> tuple[list, dict]:
    """Seconds per call of fn(i) as time_calls, made in blocks with a read-bandwidth sample (GB/s)
    before, between and after them; and the pairing: each block's GB/s over the mean of the samples
    on either side of it, and the median of those ratios (frac_read_bw_paired) - the machine's
    bandwidth drifts within a row, so each block is judged against its own minute. SETTLE_CALLS
    untimed calls follow each sample, as the warm-up follows the start."""
    for i in range(timing.warmup):
        fn(i)
    per, index = max(1, timing.decode_calls // PROBE_BLOCKS), itertools.count(timing.warmup)
    samples, blocks = [probe()], []
    while len(blocks) < PROBE_BLOCKS and sum(map(sum, blocks)) <= timing.budget_s:
        for _ in range(SETTLE_CALLS):
            fn(next(index))
        block = []
        for i in itertools.islice(index, per):
            t0 = time.perf_counter()
            fn(i)
            block.append(time.perf_counter() - t0)
        blocks.append(block)
        samples.append(probe())
    near = [(a + b) / 2 for a, b in zip(samples, samples[1:])]
    ratios = [bytes_per_call / statistics.median(b) / 1e9 / n for b, n in zip(blocks, near)]
    paired = {"read_gbps_near": statistics.median(near), "read_samples_near": samples,
              "frac_read_bw_paired": statistics.median(ratios)}  # fmt: skip
    return [t for b in blocks for t in b], paired


@dataclass(frozen=True)
class Timing:
    """How many calls each measurement makes, and the seconds it may spend."""

    decode_calls: int
    prefill_calls: int
    warmup: int
    budget_s: float


def measured(times: list[float], **fields) -> dict:
    """A result row: the fields given plus the median and fastest call in milliseconds."""
    return dict(fields, calls=len(times), ms=statistics.median(times) * 1e3, ms_min=min(times) * 1e3)


@dataclass(frozen=True)
class Impl:
    """One implementation in one weight format, as measure() drives it."""

    prepare: Callable  # (x [T, D], ids [T, K], weights [T, K]) -> call arguments, built untimed
    forward: Callable  # (chunk, arguments) -> output [T, D]
    per_chunk: int  # experts in each layer
    chunks: int  # layers the experts are spread over; decode calls rotate through them
    bytes_per_expert: float  # weight bytes one expert's gate, up and down take in this format


def decode_calls(wl: Workload, runner: Impl, n: int) -> list[tuple]:
    """(chunk, prepared arguments, ids [1, K]) of n decode calls on fresh experts (decode_ids)."""
    plan = decode_ids(runner.per_chunk, runner.chunks, wl.shape.top_k, n)
    return [(chunk, runner.prepare(wl.x, ids, wl.weights), ids) for chunk, ids in plan]


def measure(wl: Workload, runner: Impl, timing: Timing, probe: Callable[[], float], **fields) -> list[dict]:
    """The decode row (T=1, fresh experts every call) and, where the shape has one and the experts
    are in one layer, the prefill row; each with its error against the float32 reference. probe()
    samples the read bandwidth (GB/s) around blocks of the decode calls (time_with_probes)."""
    K = wl.shape.top_k
    calls = decode_calls(wl, runner, timing.warmup + timing.decode_calls + PROBE_BLOCKS * SETTLE_CALLS)
    err = rel_err(torch.as_tensor(runner.forward(*calls[0][:2])), wl.reference(calls[0][2]))
    fn, bytes_per_call = (lambda i: runner.forward(*calls[i][:2])), runner.bytes_per_expert * K
    fields = dict(fields, experts=runner.per_chunk * runner.chunks)
    times, paired = time_with_probes(fn, timing, probe, bytes_per_call)
    rows = [decode_row(wl.shape, times, bytes_per_call, err, **fields, **paired)]
    if wl.prefill_x is None or runner.chunks != 1:
        return rows
    args = runner.prepare(wl.prefill_x, wl.prefill_ids, wl.prefill_weights)
    # this first call, for the error, is the prefill warm-up
    err = rel_err(torch.as_tensor(runner.forward(0, args)), wl.prefill_ref)
    times = time_calls(lambda i: runner.forward(0, args), timing.prefill_calls, 0, timing.budget_s)
    return rows + [prefill_row(wl.shape, times, err, **fields)]


def decode_row(shape: MoeShape, times, bytes_per_call: float, err: float, **fields) -> dict:
    return measured(times, shape=shape.name, phase="decode", tokens=1, bytes_per_call=bytes_per_call, err=err, **fields)


def prefill_row(shape: MoeShape, times, err: float, **fields) -> dict:
    T, K, D, I = shape.prefill_tokens, shape.top_k, shape.hidden, shape.inter
    flops = 2 * T * K * 3 * D * I
    return measured(times, shape=shape.name, phase="prefill", tokens=T, flops_per_call=flops, err=err, **fields)


def failed_row(shape: MoeShape, impl: str, fmt: str, note: str) -> dict:
    return dict(shape=shape.name, phase="-", impl=impl, format=fmt, note=note)
