"""`tandem serve` as a child process for the end-to-end tests: started on a free port, read until
ready, stopped with Ctrl-C; its output lines kept for the assertions."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading

from tests.expert_server.servers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    def __init__(self, port: int):
        self.port, self.lines, self.code, self.proc = port, [], None, None
        self.url = f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def serve(*args: str, env: dict | None = None, ready_s: float = 300):
    """Runs `tandem serve --port P *args` until the block ends, then Ctrl-C; .code is its exit code."""
    run = Launched(free_port())
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher", "serve", "--port", str(run.port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run.proc = proc
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            run.lines.append(line)
            if "tandem: ready at" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(ready_s), "".join(run.lines[-30:])
        yield run
    finally:
        proc.send_signal(signal.SIGINT)
        run.code = proc.wait(120)
