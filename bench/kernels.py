"""How fast are routed-expert kernels on this CPU, against its own limits and against other
implementations? One MoE layer, Qwen3-30B-A3B and DeepSeek-V3 shaped: decode (1 token, fresh
experts every call) judged by weight bytes read per second against the machine's read bandwidth,
and prefill (512 tokens) judged by GFLOP/s against its fp32 matmul peak, all measured in one run.

Rows: PyTorch (a naive per-expert float32 loop and a grouped implementation), kt-kernel 0.7.2 (in
its own venv, bench/.venv-kt, made by bench/setup_ktkernel.sh; run in a subprocess) and ours
(tandem_native). Prints one table and writes JSON. The issue's speed-up targets (decode int4 against
the naive loop, prefill int8 against grouped float32) are also measured head to head, in rounds that
take turns, since this VM's speed drifts between rows.

    python -m bench.kernels [--quick] [--threads 2] [--out bench/results/kernels.json] [--setup-kt]

Legend: T tokens, K experts per token, E experts in a layer, D hidden size, I expert intermediate.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench import _machine, _moe_cases as mc
from bench._machine import progress

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
KT_PYTHON = BENCH / ".venv-kt" / "bin" / "python"
# kt-kernel's AVX2 classes, llamafile's and its AMX-family classes (the worker leaves out those its
# installed variant lacks; on CPUs without AMX they run its AVX-512 path)
KT_FORMATS = ("BF16", "Q8_0", "Q4_0", "RAWINT4", "AMXRAWINT4", "AMXBF16", "AMXINT8", "AMXINT4")
KT_TIMEOUT_S = 900
OUR_FORMATS = ("bf16", "int8", "int4", "int4_asym")
# Our bf16 weights fed the activations rounded to bf16, as kt-kernel's classes take them (the rows
# above feed float32): exactly bf16 tokens skip vdpbf16ps's low-part products.
BF16_X = "bf16_bx"
GROUP_SIZE = 32
IMPLS = ("torch", "tandem", "kt")


@dataclass(frozen=True)
class BenchConfig:
    threads: int
    quick: bool
    out: Path
    impls: tuple[str, ...]
    setup_kt: bool
    timing: mc.Timing
    limit_reps: int


def parse_args(argv=None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for every implementation (default 2)")
    p.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "kernels.json", help="where the JSON goes")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of torch,tandem,kt")
    p.add_argument("--setup-kt", action="store_true", help="make bench/.venv-kt first if it is missing")
    a = p.parse_args(argv)
    impls = tuple(i for i in a.impls.split(",") if i)
    if a.threads < 1 or not set(impls) <= set(IMPLS):
        p.error(f"--threads must be >= 1 and --impls a subset of {','.join(IMPLS)}")
    quick = mc.Timing(decode_calls=12, prefill_calls=2, warmup=2, budget_s=4.0)
    full = mc.Timing(decode_calls=48, prefill_calls=5, warmup=3, budget_s=12.0)
    return BenchConfig(a.threads, a.quick, a.out, impls, a.setup_kt, quick if a.quick else full, 3 if a.quick else 7)


# ------------------------------------------------------------------ PyTorch baselines


def naive_moe(x, ids, weights, w13, w2) -> torch.Tensor:
    """What a first port writes (the Hugging Face loop): per active expert, float32 F.linear for
    gate, up and down on that expert's tokens, then index_add. x [T, D], ids/weights [T, K]."""
    I = w2.shape[2]
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok]  # [n, D]
        h = F.silu(F.linear(xe, w13[e, :I])) * F.linear(xe, w13[e, I:])  # [n, I]
        out.index_add_(0, tok, F.linear(h, w2[e]) * weights[tok, slot, None])
    return out


def torch_impl(fn, w13: torch.Tensor, w2: torch.Tensor) -> mc.Impl:
    return mc.Impl(
        prepare=lambda x, ids, w: (x, ids, w),
        forward=lambda chunk, a: fn(*a, w13, w2),
        per_chunk=w13.shape[0],
        chunks=1,
        bytes_per_expert=w13[0].nbytes + w2[0].nbytes,
    )


def measure(wl: mc.Workload, runner: mc.Impl, cfg: BenchConfig, **fields) -> list[dict]:
    progress(f"{wl.shape.name}: {fields['impl']} {fields['format']}")
    return mc.measure(wl, runner, cfg.timing, _machine.read_probe, threads=cfg.threads, **fields)


def torch_rows(wl: mc.Workload, cfg: BenchConfig) -> list[dict]:
    rows = measure(wl, torch_impl(naive_moe, wl.w13, wl.w2), cfg, impl="torch-naive", format="fp32")
    rows += measure(wl, torch_impl(mc.grouped_moe, wl.w13, wl.w2), cfg, impl="torch-grouped", format="fp32")
    E = mc.expert_count(wl.shape, "bf16")
    bf16 = torch_impl(mc.grouped_moe, mc.tile(wl.w13d.bfloat16(), E), mc.tile(wl.w2d.bfloat16(), E))
    return rows + measure(wl, bf16, cfg, impl="torch-grouped", format="bf16")


# ------------------------------------------------------------------ ours (tandem_native)


def tandem_impl(tn, wl: mc.Workload, fmt: str, pool, bf16_x: bool = False) -> tuple[mc.Impl, float]:
    """A layer of E experts, and the seconds packing took. Where E exceeds the float32 source (the
    DeepSeek shape), the layer is E / K copies of one packed chunk of K experts, and decode rotates
    through the chunks: every call still streams K experts from DRAM, while packing (slow for int4)
    and the float32 source stay small. pack_experts takes float32 [E, 2I, D] and [E, D, I]."""
    S, E, K = wl.w13.shape[0], mc.expert_count(wl.shape, fmt), wl.shape.top_k
    per_chunk = E if E <= S else K
    t0 = time.perf_counter()
    buf = tn.pack_experts(wl.w13[:per_chunk].numpy(), wl.w2[:per_chunk].numpy(), fmt, GROUP_SIZE, pool)
    pack_s = time.perf_counter() - t0
    layers = [tn.MoeLayer(buf)] + [tn.MoeLayer(buf.copy()) for _ in range(E // per_chunk - 1)]

    def prepare(x, ids, w):
        x = x.bfloat16().float() if bf16_x else x
        return x.numpy(), ids.numpy(), w.numpy(), np.empty(tuple(x.shape), np.float32)

    def forward(chunk, a):
        tn.moe_forward(layers[chunk], *a, pool)
        return a[3]

    return mc.Impl(prepare, forward, per_chunk, len(layers), buf.nbytes / per_chunk), pack_s


def tandem_format_rows(tn, wl: mc.Workload, fmt: str, pool, cfg: BenchConfig) -> list[dict]:
    try:
        runner, pack_s = tandem_impl(tn, wl, "bf16" if fmt == BF16_X else fmt, pool, bf16_x=fmt == BF16_X)
        note = f"{tn.active_isa()}, pack {pack_s:.1f} s"
        return measure(wl, runner, cfg, impl="tandem", format=fmt, pack_s=pack_s, isa=tn.active_isa(), note=note)
    except (ValueError, RuntimeError) as e:  # what the bindings raise
        return [mc.failed_row(wl.shape, "tandem", fmt, f"failed: {e}")]


def tandem_rows(wl: mc.Workload, cfg: BenchConfig) -> list[dict]:
    try:
        import tandem_native as tn
    except ImportError as e:
        return [mc.failed_row(wl.shape, "tandem", "-", f"not built: {e}")]
    pool = tn.ThreadPool(cfg.threads)
    return [r for fmt in (*OUR_FORMATS, BF16_X) for r in tandem_format_rows(tn, wl, fmt, pool, cfg)]


def local_rows(shape: mc.MoeShape, cfg: BenchConfig) -> tuple[list[dict], list[dict]]:
    """Every in-process implementation on one shape, and its head-to-head comparisons; the workload
    is freed on return."""
    progress(f"{shape.name}: random weights and inputs")
    wl = mc.make_workload(shape)
    rows = torch_rows(wl, cfg) if "torch" in cfg.impls else []
    rows += tandem_rows(wl, cfg) if "tandem" in cfg.impls else []
    both = {"torch", "tandem"} <= set(cfg.impls) and wl.prefill_x is not None
    return rows, [duel(wl, *d, cfg) for d in DUELS] if both else []


# ------------------------------------------------------------------ head to head

# The speed-up targets: (phase, our format, baseline name and function, target ratio).
DUELS = (
    ("decode", "int4", "torch-naive", naive_moe, 10.0),
    ("prefill", "int8", "torch-grouped", mc.grouped_moe, 2.0),
)


def runner(wl: mc.Workload, impl: mc.Impl, phase: str, calls: int):
    """fn(i) making call i of a phase: decode rotates through fresh experts, prefill repeats."""
    if phase == "prefill":
        args = impl.prepare(wl.prefill_x, wl.prefill_ids, wl.prefill_weights)
        return lambda i: impl.forward(0, args)
    prepared = mc.decode_calls(wl, impl, calls)
    return lambda i: impl.forward(*prepared[i % calls][:2])


def duel(wl: mc.Workload, phase: str, fmt: str, base_name: str, base_fn, target: float, cfg: BenchConfig) -> dict:
    """Ours against a baseline in rounds that take turns, so both see the same minutes of a machine
    whose speed drifts; the ratio of their median calls."""
    import tandem_native as tn

    progress(f"{wl.shape.name}: {phase} tandem {fmt} against {base_name}, alternating")
    ours, _ = tandem_impl(tn, wl, fmt, tn.ThreadPool(cfg.threads))
    rounds, (n_ours, n_base) = (5, (1, 1)) if phase == "prefill" else (6, (16, 4))
    base = torch_impl(base_fn, wl.w13, wl.w2)
    fns = {"ours": runner(wl, ours, phase, n_ours), "base": runner(wl, base, phase, n_base)}
    times: dict[str, list[float]] = {"ours": [], "base": []}
    for _ in range(2 if cfg.quick else rounds):
        for name, calls in (("ours", n_ours), ("base", n_base)):
            times[name] += mc.time_calls(fns[name], calls, 1, float("inf"))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return dict(shape=wl.shape.name, phase=phase, ours=f"tandem {fmt}", baseline=f"{base_name} fp32",
                ours_ms=ms["ours"], baseline_ms=ms["base"], ratio=ms["base"] / ms["ours"], target=target,
                calls=[len(times["ours"]), len(times["base"])])  # fmt: skip


def print_duels(duels: list[dict]) -> None:
    if duels:
        print("head to head, in alternating rounds (median call, ours vs baseline):")
    for d in duels:
        verdict = "met" if d["ratio"] >= d["target"] else "MISSED"
        print(f"  {d['shape']} {d['phase']}: {d['ours']} {d['ours_ms']:.2f} ms vs {d['baseline']} "
              f"{d['baseline_ms']:.2f} ms = {d['ratio']:.1f}x (target >= {d['target']:g}x: {verdict})")  # fmt: skip


# ------------------------------------------------------------------ kt-kernel, in its own venv


def kt_thread_counts(threads: int) -> list[int]:
    """kt-kernel's dispatcher and workers can oversubscribe small machines: try 1 and 2 threads."""
    return sorted({1, min(2, threads), threads})


def run_kt_worker(shape: mc.MoeShape, cfg: BenchConfig) -> list[dict]:
    """One subprocess per shape, all formats: its rows for every thread count tried, and a row saying
    why for each format it left without any (it saves its rows after each format, so a crash costs
    only the formats from there on)."""
    t = cfg.timing
    progress(f"{shape.name}: kt-kernel {', '.join(KT_FORMATS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [str(KT_PYTHON), "-m", "bench._ktkernel_worker", "--shape", shape.name, "--formats", ",".join(KT_FORMATS),
               "--threads", ",".join(map(str, kt_thread_counts(cfg.threads))), "--decode-calls", str(t.decode_calls),
               "--prefill-calls", str(t.prefill_calls), "--warmup", str(t.warmup), "--budget", str(t.budget_s),
               "--out", str(out)]  # fmt: skip
        why = worker_failure(cmd)
        rows = json.loads(out.read_text()) if out.exists() else []
    done = {r["format"] for r in rows}
    return rows + [mc.failed_row(shape, "kt-kernel", f, why) for f in KT_FORMATS if f not in done]


def worker_failure(cmd: list[str]) -> str:
    """Runs the worker; what went wrong with it, for the rows it did not write."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=KT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"worker timed out after {KT_TIMEOUT_S} s"
    if proc.returncode < 0:
        return f"worker killed by {signal.Signals(-proc.returncode).name}"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"worker exited with {proc.returncode}: {tail}"


def fastest(trials: list[dict]) -> list[dict]:
    """Per (shape, phase, format), the row of the thread count that ran fastest; failures as they are."""
    best: dict[tuple, dict] = {}
    for r in (r for r in trials if "ms" in r):
        key = (r["shape"], r["phase"], r["format"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    tried = ",".join(map(str, sorted({r["threads"] for r in trials if "ms" in r})))
    chosen = [dict(r, note=f"{r['note']}, best of {tried} thr") for r in best.values()]
    return chosen + [r for r in trials if "ms" not in r]


def fastest_threads(rows: list[dict]) -> dict:
    """'shape phase format' -> the thread count kt-kernel ran fastest with."""
    kt = (r for r in rows if r["impl"] == "kt-kernel" and "ms" in r)
    return {f"{r['shape']} {r['phase']} {r['format']}": r["threads"] for r in kt}


def kt_trials(cfg: BenchConfig) -> list[dict]:
    if not KT_PYTHON.exists():
        note = "not set up: run bench/setup_ktkernel.sh (or pass --setup-kt)"
        return [mc.failed_row(s, "kt-kernel", "-", note) for s in mc.SHAPES.values()]
    return [r for s in mc.SHAPES.values() for r in run_kt_worker(s, cfg)]


# ------------------------------------------------------------------ output


def with_rates(row: dict, limits: dict) -> dict:
    """Adds GB/s of weights and its fractions of the read bandwidth (decode: paired with the samples
    around its blocks, and of the run's median and best sample), or GFLOP/s and its fraction of the
    matmul peak (prefill)."""
    if "bytes_per_call" in row:
        gbps = row["bytes_per_call"] / row["ms"] / 1e6
        paired = row.get("frac_read_bw_paired", gbps / limits["read_gbps"])
        return dict(row, gbps=gbps, frac_read_bw=paired, frac_read_bw_run=gbps / limits["read_gbps"],
                    frac_read_bw_max=gbps / limits["read_gbps_max"])
    if "flops_per_call" in row:
        gflops = row["flops_per_call"] / row["ms"] / 1e6
        return dict(row, gflops=gflops, frac_peak=gflops / limits["peak_gflops"])
    return row


def display_order(rows: list[dict]) -> list[dict]:
    shapes, phases = list(mc.SHAPES), ["decode", "prefill", "-"]
    return sorted(rows, key=lambda r: (shapes.index(r["shape"]), phases.index(r["phase"])))


COLUMNS = (  # header, row key, number format (None: text, aligned left)
    ("shape", "shape", None), ("phase", "phase", None), ("impl", "impl", None), ("format", "format", None),
    ("E", "experts", "{}"), ("thr", "threads", "{}"), ("ms/call", "ms", "{:.2f}"), ("GB/s", "gbps", "{:.1f}"),
    ("BW near", "read_gbps_near", "{:.1f}"), ("frac BW", "frac_read_bw", "{:.2f}"),
    ("frac run", "frac_read_bw_run", "{:.2f}"), ("frac max", "frac_read_bw_max", "{:.2f}"),
    ("GFLOP/s", "gflops", "{:.1f}"), ("frac pk", "frac_peak", "{:.2f}"),
    ("rel err", "err", "{:.4f}"), ("note", "note", None),
)  # fmt: skip


LEGEND = """\
decode: 1 token, top-8, fresh experts every call; GB/s = the active experts' weight bytes / time.
BW near: median read bandwidth (GB/s) sampled before, between and after 4 blocks of the row's calls;
frac BW: median over the blocks of each block's GB/s / the mean of the samples either side of it;
frac run = GB/s / the median of the run's read samples; frac max = GB/s / the best of them.
prefill: 512 tokens, top-8; GFLOP/s = 2*T*K*3*D*I / time (integer kernels can pass the fp32 peak).
E: experts in the layer; rel err: L2 error against float32 on the same weights (kt-kernel takes
bf16 activations; our bf16_bx row feeds our bf16 weights the same, the bf16 row float32 ones);
thr for kt-kernel: the fastest of the thread counts tried."""


def cell(row: dict, key: str, fmt: str | None) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value) if fmt else str(value)


def print_table(rows: list[dict], limits: dict, info: dict) -> None:
    s, e = limits["start"], limits["end"]
    print(f"{info['cpu']} ({' '.join(info['isa'])}), {info['threads']} threads, torch {info['torch']}")
    print(f"read bandwidth {s['read_gbps']:.1f} / {e['read_gbps']:.1f} GB/s (start / end); median of the run's "
          f"{limits['read_samples']} samples {limits['read_gbps']:.1f}, best {limits['read_gbps_max']:.1f}; fp32 "
          f"matmul peak {s['peak_gflops']:.0f} / {e['peak_gflops']:.0f} GFLOP/s "
          f"(use {limits['peak_gflops']:.0f})")  # fmt: skip
    warn = "  WARNING: rows are slowed, run again on a quiet machine" if info["foreign_load"] > 0.05 else ""
    print(f"other processes used {info['foreign_load']:.0%} of the CPUs during the run{warn}")
    lines = [[h for h, _, _ in COLUMNS]] + [[cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(v) for v in col) for col in zip(*lines)]
    for values in lines:
        cells = (v.rjust(w) if fmt else v.ljust(w) for v, w, (_, _, fmt) in zip(values, widths, COLUMNS))
        print("  ".join(cells).rstrip())
    print(LEGEND)


# our format -> kt-kernel's classes of the nearest format
KT_NEAREST = {"bf16": ("BF16", "AMXBF16"), BF16_X: ("BF16", "AMXBF16"), "int8": ("Q8_0", "AMXINT8"),
              "int4": ("Q4_0", "RAWINT4", "AMXRAWINT4", "AMXINT4"), "int4_asym": ("Q4_0", "RAWINT4", "AMXRAWINT4", "AMXINT4")}
# kt-kernel's classes with one scale per weight row (ours have one per 32 weights): quantized at load,
# coarser (about twice our int4's error), and on the tiles they sum whole rows before scaling once
PER_ROW = ("AMXINT8", "AMXINT4")


def versus_kt(rows: list[dict]) -> list[dict]:
    """Per shape, phase and our format: kt-kernel's fastest class of the nearest format (AVX2,
    llamafile and AMX-family alike, its best thread count) and its time over ours (>= 1: ours is faster)."""
    ours = [r for r in rows if r["impl"] == "tandem" and "ms" in r]
    kt = [r for r in rows if r["impl"] == "kt-kernel" and "ms" in r]
    out = []
    for r in ours:
        rivals = [k for k in kt if (k["shape"], k["phase"]) == (r["shape"], r["phase"]) and k["format"] in KT_NEAREST.get(r["format"], ())]
        if rivals:
            best = min(rivals, key=lambda k: k["ms"])
            grouped = min((k for k in rivals if k["format"] not in PER_ROW), key=lambda k: k["ms"], default=best)
            out.append({"shape": r["shape"], "phase": r["phase"], "format": r["format"], "ms": r["ms"],
                        "kt_format": best["format"], "kt_ms": best["ms"], "ratio": best["ms"] / r["ms"],
                        "kt_grouped_format": grouped["format"], "grouped_ratio": grouped["ms"] / r["ms"]})
    return out


def print_versus_kt(pairs: list[dict]) -> None:
    if not pairs:
        return
    print("\nagainst kt-kernel's fastest class of the nearest format (kt ms / ours; >= 1.00: ours is faster);"
          "\nlast, against its fastest with a scale per 32 weights as ours (not per row: " + ", ".join(PER_ROW) + ")")
    for p in pairs:
        flag = "" if p["ratio"] >= 1 else "  SLOWER"
        print(f"  {p['shape']:>14} {p['phase']:>7} {p['format']:>9} {p['ms']:8.2f} ms | {p['kt_format']:>10} "
              f"{p['kt_ms']:8.2f} ms | {p['ratio']:5.2f}{flag:8} | {p['kt_grouped_format']:>10} {p['grouped_ratio']:5.2f}")


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    if cfg.setup_kt and not KT_PYTHON.exists():
        subprocess.run([str(BENCH / "setup_ktkernel.sh")], check=True)
    load = _machine.ForeignLoad()
    progress("machine limits")
    info, start = _machine.machine_info(cfg.threads), _machine.machine_limits(cfg.limit_reps)
    rows, duels = [], []
    for shape in mc.SHAPES.values():
        shape_rows, shape_duels = local_rows(shape, cfg)
        rows, duels = rows + shape_rows, duels + shape_duels
    trials = kt_trials(cfg) if "kt" in cfg.impls else []
    progress("machine limits, again")
    end = _machine.machine_limits(cfg.limit_reps)
    near = [v for r in rows + trials for v in r.get("read_samples_near", [])]
    limits = _machine.combined_limits(start, end, near)
    info["foreign_load"] = load.share()
    rows = display_order([with_rates(r, limits) for r in rows + fastest(trials)])
    print_table(rows, limits, info)
    print_duels(duels)
    pairs = versus_kt(rows)
    print_versus_kt(pairs)
    kt = {"threads_tried": kt_thread_counts(cfg.threads), "fastest_threads": fastest_threads(rows),
          "trials": [with_rates(r, limits) for r in trials]}  # fmt: skip
    report = {"machine": info, "quick": cfg.quick, "limits": limits, "rows": rows, "head_to_head": duels,
              "versus_kt": pairs}
    write_json(cfg.out, dict(report, kt_kernel=kt))


if __name__ == "__main__":
    main()
