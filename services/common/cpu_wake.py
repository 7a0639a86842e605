"""Keeps the CPUs from sleeping deeper than a poll while a process decodes: the kernel's PM QoS
request for a CPU wake-up latency of 0 us, which lasts while /dev/cpu_dma_latency is held open with
that value written (as tuned's latency-performance profile and DPDK hold it).

Why: a decode step through the stack hands the cores from one process to the other twice per MoE
layer (the layer call to the expert server, its answer back). Where an idle CPU halts (a VM's
haltpoll idle driver with its poll window at 0, a bare-metal deep C-state), every hand-off also pays
for waking the halted CPU. With the request held the idle CPUs poll instead. It is held only while
there is work (the engine holds it between its first step and going idle), so an idle server keeps
the machine's power policy. It needs write access to the device (root, or a udev rule granting it);
where there is none nothing changes and one log line says so.
"""

from __future__ import annotations

import logging
import os
import struct

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"


def available() -> bool:
    """Whether this process may hold the request (the device exists and is writable)."""
    return os.access(DEVICE, os.W_OK)


class CpuWake:
    """hold() while there is work, release() when idle; both idempotent, neither raises."""

    def __init__(self, enabled: bool = True, device: str | None = None):
        self.enabled = enabled
        self.device = device or DEVICE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self) -> None:
        if not self.enabled or self._fd is not None:
            return
        try:
            fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._give_up(exc)
            return
        try:
            os.write(fd, struct.pack("i", 0))  # a binary int32: the latency limit in microseconds
        except OSError as exc:
            os.close(fd)
            self._give_up(exc)
            return
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _give_up(self, exc: OSError) -> None:
        self.enabled = False
        log.info("CPU wake-up latency not held (%s: %s): idle CPUs keep the machine's sleep states",
                 self.device, exc.strerror or exc)

    def __enter__(self) -> "CpuWake":
        self.hold()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
