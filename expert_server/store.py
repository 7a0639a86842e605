"""Where the expert server's packed experts come from: the checkpoint (packed at load) or a store.

A packed store is one file written by `convert`:
    0      magic b"TNDSTORE", u32 version, u32 length of the JSON header that follows
    16     JSON header: source fingerprint, model type, format, group size asked for, and per layer
           its offset (from 1 MiB) and byte count
    1 MiB  each layer's packed buffer (tandem_native's own layout, with its own header: a layer
           imported from a quantized checkpoint keeps that checkpoint's group size and levels),
           4 KiB aligned; the layers are written as they are packed and the header last
It is memory-mapped back read-only: the kernels read the pages in place, nothing is copied.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from services.common.checkpoint import Checkpoint
from services.common.errors import CheckpointError, ConfigError
from services.common.expert_weights import LayerExperts, pack_layer
from services.common.model_config import ModelConfig

STORE_MAGIC = b"TNDSTORE"
STORE_VERSION = 2
_PREFIX = struct.Struct("<8sII")
_PAGE = 4096
_MAX_HEADER = 1 << 20  # the header's room: the layers start after it
ERROR_SAMPLES = 8  # experts a layer whose quantization error convert measures


@dataclass
class ExpertLayers:
    """The packed layers a server holds: layer index -> tandem_native.MoeLayer."""

    layers: dict
    format: str
    nbytes: int
    keep: object = None  # the mapping behind the layers, when they come from a store


def moe_layers(cfg: ModelConfig, layer_range: tuple[int, int] | None) -> list[int]:
    lo, hi = layer_range if layer_range else (0, cfg.num_layers - 1)
    if hi >= cfg.num_layers:
        raise ConfigError(f"--layers: {lo}-{hi} goes past the model's {cfg.num_layers} layers")
    layers = [i for i in range(lo, hi + 1) if cfg.is_moe(i)]
    if not layers:
        raise ConfigError(f"--layers: {lo}-{hi} holds no MoE layer")
    return layers


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def check_memory(need: int, available: int) -> None:
    if need > available:
        raise ConfigError(
            f"the experts need {need / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is available; "
            "serve fewer layers (--layers) or pick a smaller --format"
        )


def source_bytes(checkpoint: Checkpoint, cfg: ModelConfig, layers: list[int]) -> int:
    """Bytes of the routed experts' stored tensors in these layers: what packing them reads."""
    experts = (LayerExperts(checkpoint, cfg, layer) for layer in layers)
    return sum(x.stored_bytes(e) for x in experts for e in range(cfg.moe.num_experts))


def _bar(checkpoint: Checkpoint, cfg: ModelConfig, layers: list[int], desc: str) -> tqdm:
    """A progress bar over the bytes read (rate and ETA), on stderr."""
    return tqdm(total=source_bytes(checkpoint, cfg, layers), desc=desc, unit="B", unit_scale=True,
                unit_divisor=1024, file=sys.stderr, mininterval=1.0)


def pack_from_checkpoint(checkpoint: Checkpoint, cfg: ModelConfig, layers: list[int], fmt: str, group: int, pool):
    """Quantizes (or imports) and packs each layer on the pool's threads, with a progress bar."""
    import tandem_native

    packed = {}
    with _bar(checkpoint, cfg, layers, f"packing experts ({fmt})") as bar:
        for layer in layers:
            packed[layer] = tandem_native.MoeLayer(pack_layer(checkpoint, cfg, layer, fmt, group, pool, bar.update))
    return ExpertLayers(packed, fmt, sum(layer.nbytes for layer in packed.values()))


@dataclass(frozen=True)
class ConvertReport:
    read_bytes: int
    written_bytes: int
    seconds: float
    peak_rss: int  # of this process, bytes
    errors: dict   # tensor kind -> relative error of the tensors quantized from floats (imported ones have none)

    def __str__(self) -> str:
        gb = 1e9
        kinds = ", ".join(f"{k} {v:.2e}" for k, v in self.errors.items()) or "none (every tensor imported as stored)"
        return (f"read {self.read_bytes / gb:.2f} GB in {self.seconds:.1f} s ({self.read_bytes / gb / self.seconds:.2f} GB/s), "
                f"wrote {self.written_bytes / gb:.2f} GB, peak RSS {self.peak_rss / 2**30:.2f} GiB; relative error of "
                f"the tensors quantized again (on up to {ERROR_SAMPLES} experts a layer): {kinds}")


def peak_rss() -> int:
    """This process's peak resident memory: VmHWM (getrusage's maxrss would count the parent's, since
    Linux keeps it across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def convert(checkpoint: Checkpoint, cfg: ModelConfig, layers: list[int], fmt: str, group: int, pool,
            out: Path) -> ConvertReport:
    """Writes a packed store for these layers, one layer in memory at a time (atomically: a
    temporary file, then a rename)."""
    start = time.monotonic()
    buffers, errors = {}, {}
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f, _bar(checkpoint, cfg, layers, f"converting experts ({fmt})") as bar:
        for layer in layers:  # each layer's own group size and levels may differ (imported ones keep theirs)
            buf = pack_layer(checkpoint, cfg, layer, fmt, group, pool, bar.update, errors, ERROR_SAMPLES)
            f.seek(max(_MAX_HEADER, -(-f.tell() // _PAGE) * _PAGE))
            buffers[layer] = {"layer": layer, "offset": f.tell() - _MAX_HEADER, "nbytes": len(buf)}
            f.write(buf.data)
        header = json.dumps({
            "source": checkpoint.fingerprint(), "family": cfg.family, "format": fmt, "group_size": group,
            "layers": list(buffers.values()),
        }).encode()
        if _PREFIX.size + len(header) > _MAX_HEADER:
            raise ConfigError(f"{out}: the store header ({len(header)} bytes) outgrew its {_MAX_HEADER} bytes")
        f.seek(0)
        f.write(_PREFIX.pack(STORE_MAGIC, STORE_VERSION, len(header)) + header)
        read = bar.n
    os.replace(tmp, out)
    relative = {kind: (err / ref) ** 0.5 if ref else 0.0 for kind, (err, ref) in errors.items()}
    return ConvertReport(read, out.stat().st_size, time.monotonic() - start, peak_rss(), relative)


def read_header(mm: mmap.mmap, path: Path) -> tuple[dict, int]:
    if len(mm) < _PREFIX.size:
        raise CheckpointError(f"{path}: too short to be a packed store")
    magic, version, n = _PREFIX.unpack_from(mm, 0)
    if magic != STORE_MAGIC or version != STORE_VERSION:
        raise CheckpointError(f"{path}: not a version-{STORE_VERSION} packed store (magic {magic!r}, version {version})")
    try:
        header = json.loads(bytes(mm[_PREFIX.size:_PREFIX.size + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt store header: {exc}") from exc
    return header, _MAX_HEADER


def open_store(path: Path, checkpoint: Checkpoint, cfg: ModelConfig, layers: list[int], fmt: str,
               group_size: int | None = None) -> ExpertLayers:
    """Maps a packed store and checks it against the checkpoint, the format and the layers asked for."""
    import tandem_native

    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot map the packed store: {exc}") from exc
    header, start = read_header(mm, path)
    if header["source"] != checkpoint.fingerprint():
        raise CheckpointError(f"{path}: packed from a different checkpoint than {checkpoint.dir}")
    if header["format"] != fmt:
        raise ConfigError(f"--format {fmt} but the store {path} holds {header['format']}")
    if group_size is not None and fmt != "bf16" and header["group_size"] != group_size:
        raise ConfigError(f"--group-size {group_size} but the store {path} was packed with {header['group_size']}")
    entries = {e["layer"]: e for e in header["layers"]}
    missing = [layer for layer in layers if layer not in entries]
    if missing:
        raise ConfigError(f"{path}: the store lacks layers {missing}")
    view = np.frombuffer(mm, dtype=np.uint8)
    packed = {}
    for layer in layers:
        e = entries[layer]
        lo = start + e["offset"]
        if lo + e["nbytes"] > len(mm):
            raise CheckpointError(f"{path}: layer {layer} runs past the end of the file (truncated?)")
        try:
            packed[layer] = tandem_native.MoeLayer(view[lo:lo + e["nbytes"]])
        except ValueError as exc:
            raise CheckpointError(f"{path}: layer {layer}: {exc}") from exc
    return ExpertLayers(packed, fmt, sum(e["nbytes"] for e in entries.values() if e["layer"] in packed), keep=mm)
