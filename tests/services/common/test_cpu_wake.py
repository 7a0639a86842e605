"""The CPU wake-up latency request: held open with a binary 0 while there is work, closed when idle,
and where the device cannot be written, nothing but one log line."""

import logging
import os
import struct

from services.common.cpu_wake import CpuWake


def open_on(path) -> bool:
    """Whether this process holds a descriptor on path."""
    return any(os.path.realpath(f"/proc/self/fd/{fd}") == str(path) for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_hold_writes_a_zero_microsecond_limit_and_keeps_it_open_until_release(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = CpuWake(device=str(device))
    wake.hold()
    wake.hold()  # idempotent: one request, not two
    assert wake.held and open_on(device)
    assert struct.unpack("i", device.read_bytes()) == (0,)
    wake.release()
    wake.release()
    assert not wake.held and not open_on(device)


def test_as_a_context_it_releases_on_the_way_out(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    with CpuWake(device=str(device)) as wake:
        assert wake.held
    assert not open_on(device)


def test_disabled_it_never_opens_the_device(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = CpuWake(enabled=False, device=str(device))
    wake.hold()
    assert not wake.held and device.read_bytes() == b""


def test_a_device_it_cannot_open_is_one_log_line_and_no_retries(tmp_path, caplog):
    wake = CpuWake(device=str(tmp_path / "missing" / "cpu_dma_latency"))
    with caplog.at_level(logging.INFO, logger="services.common.cpu_wake"):
        for _ in range(3):
            wake.hold()
    assert not wake.held and not wake.enabled
    assert len([r for r in caplog.records if "not held" in r.message]) == 1


def test_a_device_that_refuses_the_write_is_closed_again(tmp_path, monkeypatch):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")

    def refuse(fd, data):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "write", refuse)
    wake = CpuWake(device=str(device))
    wake.hold()
    monkeypatch.undo()
    assert not wake.held and not wake.enabled and not open_on(device)
