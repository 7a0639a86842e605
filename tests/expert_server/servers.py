"""Expert servers for tests: in this process on a free port, or as a real `python -m expert_server`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from expert_server.app import start
from expert_server.config import ServerConfig
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def in_process(path, fmt="int8", layers=None, threads=2, **kw):
    running = start(ServerConfig(model=path, format=fmt, layers=layers, threads=threads, listen="127.0.0.1:0", **kw))
    try:
        yield running
    finally:
        running.stop(0.5)


class Spawned:
    """A `python -m expert_server` child; its port is read from its 'ready on port' line (prefix: a
    command it runs under, as `ip netns exec NAME`; host: the address it listens on)."""

    def __init__(self, path, fmt="int8", layers=None, port=0, extra=(), timeout=120, prefix=(), host="127.0.0.1"):
        self.host = host
        cmd = [*prefix, sys.executable, "-m", "expert_server", "--model", str(path), "--format", fmt, "--threads", "2",
               "--listen", f"{host}:{port}", *extra]
        if layers:
            cmd += ["--layers", layers]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        self.lines: list[str] = []
        self.port = self._await_port(timeout)
        threading.Thread(target=self._drain, daemon=True).start()

    def _await_port(self, timeout) -> int:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stderr:
                self.lines.append(line)
                if "ready on port" in line:
                    return int(line.rsplit(" ", 1)[1])
        finally:
            timer.cancel()
        raise RuntimeError("expert server did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP, returning only once the process has stopped (no call it was spinning on slips through)."""
        self.proc.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: self._state() in ("T", "t"), timeout=10)

    def _state(self) -> str:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a stopped process dies too, without running on: no call slips through
        self.proc.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
