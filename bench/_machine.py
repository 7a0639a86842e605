"""The machine's own limits and state, measured in the same run as the kernels: streaming read
bandwidth, fp32 matmul peak, and how much of the CPUs other processes took meanwhile."""

from __future__ import annotations

import functools
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np
import torch

from services.common.grpc_defaults import apply as apply_grpc_defaults

apply_grpc_defaults()  # every bench process, before anything loads grpc (the JSON records the value)

READ_FLOATS = 400 * 2**20  # 1.68 GB of float32, far beyond any cache
PEAK_N = 2048
START = time.perf_counter()


def progress(what: str) -> None:
    """A progress line on stderr, stamped with the seconds since the bench started."""
    print(f"[{time.perf_counter() - START:5.0f} s] {what}", file=sys.stderr, flush=True)


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile")


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.cache
def read_buffer() -> torch.Tensor:
    """The 1.68 GB the read bandwidth is measured on, made once per process; written here, so every
    page is mapped before any timing. Allocated by numpy, as the packed expert weights are: numpy
    asks for transparent huge pages (madvise) on large buffers and torch does not, and on the 2-core
    bench machine a streaming read over huge pages was about 7% faster (16.6 against 15.5 GB/s,
    medians of alternating reads), so the yardstick reads the kind of pages the kernels read."""
    return torch.from_numpy(np.ones(READ_FLOATS, np.float32))


def transparent_hugepages() -> str:
    """The kernel's THP mode (the bracketed word of /sys/kernel/mm/transparent_hugepage/enabled)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def read_bandwidth(reps: int) -> float:
    """GB/s of a streaming read: torch.sum over 1.68 GB of float32 on all threads."""
    a = read_buffer()
    return a.nbytes / median_seconds(a.sum, reps) / 1e9


PROBE_REST_S = 0.05


def read_probe() -> float:
    """A short read-bandwidth sample (two timed sums), taken next to a measurement; it returns once
    torch's OpenMP threads have stopped spinning. libgomp's default wait policy keeps them spinning
    for several milliseconds after a parallel region, and on a 2-core machine they take the cores
    from whatever runs next: measured here, a qwen3 int4 decode call right after a probe ran 1.8x
    slower than its steady state and the 7th to 18th calls (the first timed ones) still 5% slower;
    after a 50 ms rest only the first call differs (the settle calls take it)."""
    gbps = read_bandwidth(2)
    time.sleep(PROBE_REST_S)
    return gbps


def matmul_peak(reps: int) -> float:
    """GFLOP/s of a 2048^3 float32 matmul (MKL through PyTorch) on all threads."""
    a, b = torch.randn(PEAK_N, PEAK_N), torch.randn(PEAK_N, PEAK_N)
    return 2 * PEAK_N**3 / median_seconds(lambda: a @ b, reps) / 1e9


def machine_limits(reps: int) -> dict:
    return {"read_gbps": read_bandwidth(reps), "peak_gflops": matmul_peak(2 * reps)}


def combined_limits(start: dict, end: dict, read_samples: list[float]) -> dict:
    """The run's yardsticks. Read bandwidth: the median of every sample of the run (start, end and
    read_samples, those taken next to the rows), with the best one kept too; on a shared VM it moves
    by 10-50% within minutes, so a median over the whole run, not its luckiest moment, is what a
    kernel could have had. Matmul peak: the better of start and end."""
    samples = [start["read_gbps"], end["read_gbps"], *read_samples]
    return {
        "read_gbps": statistics.median(samples),
        "read_gbps_max": max(samples),
        "read_samples": len(samples),
        "peak_gflops": max(start["peak_gflops"], end["peak_gflops"]),
        "start": start,
        "end": end,
    }


def busy_cpu_seconds() -> float:
    """CPU-seconds every process (and, as steal, other VMs) has used since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class ForeignLoad:
    """The share of the machine's CPUs that other processes used while the bench ran: on a 2-core
    box any of it slows the rows down, so a run with more than a few percent is worth repeating."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()

    def share(self) -> float:
        wall = (time.perf_counter() - self.t0) * os.cpu_count()
        return max(0.0, (busy_cpu_seconds() - self.busy0) - (own_cpu_seconds() - self.own0)) / wall


def cpuinfo_field(name: str) -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), "?")


def machine_info(threads: int) -> dict:
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    flags = cpuinfo_field("flags").split()
    return {
        "cpu": cpuinfo_field("model name"),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),  # services/common/grpc_defaults.py
        "transparent_hugepages": transparent_hugepages(),  # numpy buffers (weights, read_buffer) madvise them
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
