"""Python run in a child process from the repository root, for what must not touch the test's own
process (a thread's CPU affinity, thousands of pool rounds that might hang), and what such a child
measures: the share of one core a busy thread gets."""

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, timeout=timeout, capture_output=True,
                          text=True)


def pin_to_one_cpu() -> None:
    """This thread, and the threads it starts afterwards, on one CPU."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def busy_share(seconds: float = 0.05) -> float:
    """CPU time over wall time of this thread while it keeps busy for `seconds`."""
    start, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        pass
    return (time.thread_time() - cpu) / (time.perf_counter() - start)
