"""How much memory and time does converting a real-sized FP8 checkpoint take?

The bench checkpoint (bench/checkpoint.py) is copied as DeepSeek's block-scaled FP8 (fp8_copy below:
every linear weight float8_e4m3fn with float32 128x128 scales, embeddings, norms and routers as they
are), then `python -m expert_server convert --format int4` runs on the copy in a child process. The
child's peak RSS (VmHWM, as convert reports it) is judged against the issue's bound, one layer's experts in bf16 plus
1 GiB, and its read throughput (source GB/s, as convert reports it) is printed beside the machine's
streaming-read bandwidth measured in the same run.

    python -m bench.convert [--format int4] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench import _machine
from bench.checkpoint import REPO, bench_checkpoint

BENCH = Path(__file__).resolve().parent
BLOCK = 128
FP8_MAX = 448.0
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> q float8_e4m3fn [O, I] and float32 scales [ceil(O/128), ceil(I/128)], W = q * s."""
    o, i = w.shape
    bo, bi = math.ceil(o / BLOCK), math.ceil(i / BLOCK)
    padded = torch.zeros(bo * BLOCK, bi * BLOCK)
    padded[:o, :i] = w.float()
    tiles = padded.view(bo, BLOCK, bi, BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view(bo * BLOCK, bi * BLOCK)[:o, :i].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def fp8_copy(src: Path) -> Path:
    """The checkpoint as block-scaled FP8, one shard per source shard; cached next to it."""
    from services.common.checkpoint import Checkpoint

    out = src.parent / f"{src.name}-fp8"
    if (out / "config.json").exists():
        return out
    ckpt = Checkpoint(src)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    weight_map = {}
    for shard in ckpt.source.files.paths:
        names = [n for n, info in ckpt.source.files.tensors.items() if info.file == shard]
        tensors = {}
        for name in names:
            w = ckpt.get(name)
            if w.dim() == 2 and not any(k in name for k in KEEP):
                tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(w)
            else:
                tensors[name] = w
        save_file(tensors, str(tmp / shard.name), metadata={"format": "pt"})
        weight_map.update({n: shard.name for n in tensors})
        _machine.progress(f"fp8 copy: {shard.name}")
    config = {**ckpt.config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                      "weight_block_size": [BLOCK, BLOCK]}}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            (tmp / f.name).write_bytes(f.read_bytes())
    tmp.rename(out)
    return out


def run_convert(model: Path, fmt: str, threads: int, store: Path) -> dict:
    """The convert child: its report line, wall time and peak RSS (its own VmHWM, which it reports:
    wait4's maxrss would start from this process's, which Linux carries across fork and exec)."""
    cmd = [sys.executable, "-m", "expert_server", "convert", "--model", str(model), "--format", fmt,
           "--threads", str(threads), "--out", str(store)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"convert failed:\n{output[-3000:]}")
    wall = time.perf_counter() - start
    line = next(x for x in output.splitlines() if x.startswith("wrote "))
    gbps = float(re.search(r"\(([\d.]+) GB/s\)", line)[1])
    return {"report": line, "wall_s": wall, "peak_rss_gib": float(re.search(r"peak RSS ([\d.]+) GiB", line)[1]),
            "source_gbps": gbps}


def main(argv=None) -> None:
    from services.dense.loader import open_checkpoint

    p = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.splitlines()[0])
    p.add_argument("--format", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=BENCH / "results" / "convert.json")
    a = p.parse_args(argv)
    src = bench_checkpoint()
    fp8 = fp8_copy(src)
    _, cfg = open_checkpoint(src)
    m = cfg.moe
    layer_bf16 = m.num_experts * 3 * cfg.hidden_size * m.intermediate_size * 2
    bound = layer_bf16 / 2**30 + 1.0
    load = _machine.ForeignLoad()
    before = _machine.read_bandwidth(3)
    store = fp8.parent / f"{fp8.name}-{a.format}.tandem"
    result = run_convert(fp8, a.format, a.threads, store)
    after = _machine.read_bandwidth(3)
    store.unlink(missing_ok=True)
    read = (before + after) / 2
    rows = {
        "checkpoint": f"{fp8.name} ({sum(f.stat().st_size for f in fp8.glob('*.safetensors')) / 1e9:.2f} GB FP8)",
        "format": a.format,
        "peak RSS GiB": f"{result['peak_rss_gib']:.2f} (bound {bound:.2f}: one layer's experts in bf16 "
                        f"{layer_bf16 / 2**30:.2f} + 1) -> {'met' if result['peak_rss_gib'] < bound else 'MISSED'}",
        "source GB/s": f"{result['source_gbps']:.2f} against the machine's read {read:.1f} GB/s "
                       f"({result['source_gbps'] / read:.3f}x)",
        "wall s": f"{result['wall_s']:.1f}",
        "convert said": result["report"],
        "other processes' CPU share": f"{load.share():.1%}",
    }
    for k, v in rows.items():
        print(f"{k:>28}  {v}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": _machine.machine_info(a.threads), "bound_gib": bound,
                                 "read_gbps": read, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
