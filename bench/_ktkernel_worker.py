"""kt-kernel 0.7.2 measurements for bench/kernels.py, run with bench/.venv-kt's python (kt-kernel's
declared dependencies pull a CUDA torch, so it lives in its own venv; bench/setup_ktkernel.sh):

    bench/.venv-kt/bin/python -m bench._ktkernel_worker --shape qwen3-30b-a3b --formats BF16,Q4_0 \
        --threads 1,2 --out rows.json

Writes a JSON list of result rows, one per format, phase and thread count, to --out (kt-kernel
prints to stdout itself). Same workload, routing and timing as the other rows (bench/_moe_cases.py); kt-kernel
takes bf16 activations, so its error includes rounding the input to bf16.

Legend: T tokens, K experts per token, E experts, n distinct experts, N output rows, C input
columns, G group size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import kt_kernel
import torch

from bench import _machine, _moe_cases as mc

K = kt_kernel.kt_kernel_ext
GGML = K.kvcache.ggml_type
# weight format -> the sizing class that decides how many experts a case holds
SIZE_CLASS = {"BF16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "RAWINT4": "int4", "AMXRAWINT4": "int4",
              "AMXBF16": "bf16", "AMXINT8": "int8", "AMXINT4": "int4"}
# kt-kernel's AMX-family classes (its best on AMX CPUs; an AVX-512 path on CPUs without AMX), where
# the installed variant has them
AMX_CLASSES = {"AMXBF16": "AMXBF16_MOE", "AMXINT8": "AMXInt8_MOE", "AMXINT4": "AMXInt4_MOE"}
# Formats handed to kt-kernel as bf16 and quantized at load: their case holds as many experts as the
# bf16 source fits in the budget (quantizing 64 DeepSeek-shaped experts online took 22 GB and the
# OOM killer; 32 peak at 8.1 GB with the workload, 12.9 GB for both classes in one worker, each
# expert still streamed from DRAM per call).
LOADED_AS_BF16 = {"AMXINT8", "AMXINT4"}
RAWINT4_GROUP = 32
MAX_LEN = 512  # the most tokens one call passes (kt-kernel sizes its buffers by it)


@dataclass
class KtWeights:
    cls: type  # the kt-kernel MoE class
    configure: Callable  # (MOEConfig) -> None: weight pointers and format fields
    tensors: list  # kept alive while kt-kernel reads them
    experts: int

    @property
    def bytes_per_expert(self) -> float:
        return sum(t.nbytes for t in self.tensors) / self.experts


def projections(wl: mc.Workload) -> list[torch.Tensor]:
    """The distinct experts' gate [n, I, D], up [n, I, D] and down [n, D, I], float32; each format
    converts these and then tiles them to E experts."""
    I = wl.shape.inter
    return [wl.w13d[:, :I].contiguous(), wl.w13d[:, I:].contiguous(), wl.w2d]


def bf16_weights(wl: mc.Workload, experts: int) -> KtWeights:
    tensors = [mc.tile(t.bfloat16(), experts) for t in projections(wl)]

    def configure(c):
        c.gate_proj, c.up_proj, c.down_proj = (t.data_ptr() for t in tensors)

    return KtWeights(K.moe.AVX2BF16_MOE, configure, tensors, experts)


def quantize_ggml(t: torch.Tensor, kind) -> torch.Tensor:
    """[n, N, C] float32 -> [n, bytes] uint8 of ggml blocks, by kt-kernel's own converter."""
    return K.utils.from_float(t.data_ptr(), t.numel(), kind).view(t.shape[0], -1)


def ggml_weights(wl: mc.Workload, experts: int, name: str) -> KtWeights:
    kind = getattr(GGML, name)
    tensors = [mc.tile(quantize_ggml(t, kind), experts) for t in projections(wl)]

    def configure(c):
        c.gate_proj, c.up_proj, c.down_proj = (t.data_ptr() for t in tensors)
        c.gate_type = c.up_type = c.down_type = kind
        c.hidden_type = GGML.BF16
        # as kt-kernel's LlamafileMoEWrapper sets them: one-token path below 10 tokens
        c.m_block, c.group_min_len, c.group_max_len = 32, 10, MAX_LEN

    return KtWeights(K.moe.MOE, configure, tensors, experts)


def quantize_rawint4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, N, C] float32 -> codes [n, N, C/2] uint8 and scales [n, N, C/G] bf16: symmetric groups of
    G along C, scale amax / 7, code q + 8 for q in [-8, 7], two per byte, low nibble first. This is
    RAWINT4 as kt-kernel's compressed-tensors loader hands it over; the error column checks it."""
    codes, scales = [], []
    for w in t:  # one expert at a time bounds the temporaries
        g = w.reshape(w.shape[0], -1, RAWINT4_GROUP)  # [N, C/G, G]
        s = (g.abs().amax(-1, keepdim=True) / 7).bfloat16()
        q = (torch.round(g / s.float().clamp_min(1e-30)).clamp(-8, 7) + 8).to(torch.uint8).reshape(w.shape[0], -1)
        codes.append(q[:, 0::2] | (q[:, 1::2] << 4))
        scales.append(s.reshape(w.shape[0], -1))
    return torch.stack(codes), torch.stack(scales)


def rawint4_weights(wl: mc.Workload, experts: int, cls: str = "AVX2RawInt4_MOE") -> KtWeights:
    """RAWINT4 on the given class: AVX2RawInt4_MOE, or AMXInt4_KGroup_MOE (what kt-kernel's RAWINT4
    wrapper picks on AMX CPUs: group-wise int4 on the tiles)."""
    packed = [[mc.tile(a, experts) for a in quantize_rawint4(t)] for t in projections(wl)]

    def configure(c):
        for name, (codes, scales) in zip(("gate", "up", "down"), packed):
            setattr(c, f"{name}_projs", [[e.data_ptr() for e in codes]])  # [numa node][expert]
            setattr(c, f"{name}_scales", [[e.data_ptr() for e in scales]])
        q = c.quant_config
        q.bits, q.group_size, q.zero_point = 4, RAWINT4_GROUP, False

    return KtWeights(getattr(K.moe, cls), configure, [t for p in packed for t in p], experts)


def amx_weights(wl: mc.Workload, experts: int, name: str) -> KtWeights:
    """bf16 gate/up/down that the class quantizes to its own format at load (int8 / int4 online,
    written to and kept in a scratch directory, as KTransformers' AMX backends do)."""
    tensors = [mc.tile(t.bfloat16(), experts) for t in projections(wl)]
    scratch = tempfile.mkdtemp(prefix="kt-amx-")

    def configure(c):
        c.gate_proj, c.up_proj, c.down_proj = (t.data_ptr() for t in tensors)
        c.save, c.load, c.path = True, False, scratch

    return KtWeights(getattr(K.moe, AMX_CLASSES[name]), configure, tensors, experts)


BUILDERS = {
    "BF16": bf16_weights,
    "Q8_0": lambda wl, e: ggml_weights(wl, e, "Q8_0"),
    "Q4_0": lambda wl, e: ggml_weights(wl, e, "Q4_0"),
    "RAWINT4": rawint4_weights,
    **({"AMXRAWINT4": lambda wl, e: rawint4_weights(wl, e, "AMXInt4_KGroup_MOE")}
       if hasattr(K.moe, "AMXInt4_KGroup_MOE") else {}),
    **{name: (lambda wl, e, n=name: amx_weights(wl, e, n)) for name, cls in AMX_CLASSES.items() if hasattr(K.moe, cls)},
}


def make_pool(threads: int):
    wc = K.WorkerPoolConfig()
    wc.subpool_count, wc.subpool_numa_map, wc.subpool_thread_count = 1, [0], [threads]
    return K.CPUInfer(wc)


def load_moe(shape: mc.MoeShape, kw: KtWeights, cpu) -> tuple:
    """The MoE object, and what must outlive it (kt-kernel keeps raw pointers)."""
    on_gpu = torch.zeros(kw.experts, dtype=torch.bool)  # no expert on a GPU
    c = K.moe.MOEConfig(kw.experts, shape.top_k, shape.hidden, shape.inter, on_gpu.data_ptr())
    c.layer_idx, c.pool, c.max_len = 0, cpu.backend_, MAX_LEN
    kw.configure(c)
    moe = kw.cls(c)
    physical_to_logical = torch.arange(kw.experts, dtype=torch.int64)
    cpu.submit(moe.load_weights_task(physical_to_logical.data_ptr()))
    cpu.sync()
    return moe, (on_gpu, c, physical_to_logical)


def kt_impl(cpu, moe, kw: KtWeights) -> mc.Impl:
    def prepare(x, ids, w):  # tokens as int32 [1], ids [T, K] int64, weights [T, K], bf16 x and out
        T, D = x.shape
        return torch.tensor([T], dtype=torch.int32), ids, w, x.bfloat16(), torch.empty(T, D, dtype=torch.bfloat16)

    def forward(chunk, a):
        bsz, ids, w, x, out = a
        ptrs = (ids.data_ptr(), w.data_ptr(), x.data_ptr(), out.data_ptr())
        cpu.submit(moe.forward_task(bsz.data_ptr(), ids.shape[1], *ptrs, False))  # False: no deferred experts
        cpu.sync()
        return out

    return mc.Impl(prepare, forward, kw.experts, 1, kw.bytes_per_expert)


def trial(wl: mc.Workload, fmt: str, kw: KtWeights, threads: int, timing: mc.Timing) -> list[dict]:
    cpu = make_pool(threads)
    moe, keep = load_moe(wl.shape, kw, cpu)
    name = "llamafile MOE" if kw.cls is K.moe.MOE else kw.cls.__name__
    fields = dict(impl="kt-kernel", format=fmt, threads=threads, note=name, kt_variant=kt_kernel.__cpu_variant__)
    rows = mc.measure(wl, kt_impl(cpu, moe, kw), timing, _machine.read_probe, **fields)
    del moe, keep  # before the pool it runs on
    del cpu
    return rows


def format_rows(wl: mc.Workload, fmt: str, threads: list[int], timing: mc.Timing) -> list[dict]:
    """Rows for every thread count, or one saying why there are none; a thread count that fails
    costs only its own rows."""
    if fmt not in BUILDERS:
        note = f"{AMX_CLASSES.get(fmt, fmt)}: not in kt-kernel's {kt_kernel.__cpu_variant__} variant"
        return [mc.failed_row(wl.shape, "kt-kernel", fmt, note)]
    try:
        held = "bf16" if fmt in LOADED_AS_BF16 else SIZE_CLASS[fmt]
        kw = BUILDERS[fmt](wl, mc.expert_count(wl.shape, held))
    except (RuntimeError, ValueError, TypeError) as e:  # what pybind11 raises for a bad call
        return [mc.failed_row(wl.shape, "kt-kernel", fmt, f"{type(e).__name__}: {e}")]
    rows = []
    for n in threads:
        try:
            rows += trial(wl, fmt, kw, n, timing)
        except (RuntimeError, ValueError, TypeError) as e:
            rows.append(mc.failed_row(wl.shape, "kt-kernel", fmt, f"{n} threads: {type(e).__name__}: {e}"))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kt-kernel rows for bench/kernels.py")
    p.add_argument("--shape", choices=list(mc.SHAPES), required=True)
    p.add_argument("--formats", type=lambda s: s.split(","), default=list(BUILDERS))
    p.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1])
    p.add_argument("--decode-calls", type=int, default=12)
    p.add_argument("--prefill-calls", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=4.0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if not set(a.formats) <= set(SIZE_CLASS):
        p.error(f"--formats: choose from {','.join(SIZE_CLASS)}")
    return a


def main(argv=None) -> None:
    """Writes --out after each format, so a crash in one leaves the rows of those before it."""
    a = parse_args(argv)
    timing = mc.Timing(a.decode_calls, a.prefill_calls, a.warmup, a.budget)
    torch.set_num_threads(max(a.threads))
    wl, rows = mc.make_workload(mc.SHAPES[a.shape]), []
    for fmt in a.formats:
        rows += format_rows(wl, fmt, a.threads, timing)
        a.out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
