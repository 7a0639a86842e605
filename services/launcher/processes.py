"""The three child processes of `tandem serve`: started in order, each waited for until healthy,
their output prefixed with their name, supervised (a child that dies is started again on the same
port, after a backoff that doubles, up to a number of restarts within a window; then the stack
stops), and stopped in reverse order (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.healthcheck import serving

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"ready on port (\d+)")
MAX_BACKOFF_S = 30.0


class Child:
    def __init__(self, name: str, argv: list[str]):
        self.name, self.port = name, None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # Ctrl-C reaches the launcher only
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        for line in self.proc.stdout:
            match = READY.search(line)
            if match:
                self.port = int(match.group(1))
                self._ready.set()
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()

    def wait_port(self, timeout: float, stop: threading.Event) -> int:
        end = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting")
            if stop.is_set() or time.monotonic() > end:
                raise RuntimeError(f"{self.name} did not start within {timeout:g} s")
        return self.port

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def grpc_serving(port: int) -> bool:
    return serving(f"127.0.0.1:{port}", timeout_s=1.0)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until(check, child: Child, timeout: float, stop: threading.Event) -> None:
    end = time.monotonic() + timeout
    while not check():
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}")
        if stop.is_set() or time.monotonic() > end:
            raise RuntimeError(f"{child.name} was not healthy within {timeout:g} s")
        time.sleep(0.2)


@dataclass
class Part:
    """One supervised child: how to start it (listen: it takes --listen, on the port it first got)."""

    name: str
    module: str
    args: list[str]
    healthy: Callable[[Part], bool]
    listen: bool = True
    port: int = 0
    child: Child | None = None
    restarts: list[float] = field(default_factory=list)  # when it was restarted (time.monotonic)

    def argv(self) -> list[str]:
        listen = ["--listen", f"127.0.0.1:{self.port}"] if self.listen else []
        return [sys.executable, "-m", self.module, *self.args, *listen]


class Stack:
    def __init__(self, cfg):
        self.cfg = cfg
        self.parts: list[Part] = []
        self.clean_exit = True

    @property
    def children(self) -> list[Child]:
        return [p.child for p in self.parts if p.child is not None]

    def _run(self, part: Part, stop: threading.Event) -> None:
        """Starts the part's process and waits until it is healthy."""
        timeout = self.cfg.startup_timeout_s
        part.child = Child(part.name, part.argv())
        print(f"tandem: {part.name} started (pid {part.child.proc.pid})", flush=True)
        if part.listen:
            part.port = part.child.wait_port(timeout, stop)
        wait_until(lambda: part.healthy(part), part.child, timeout, stop)

    def _add(self, part: Part, stop: threading.Event) -> Part:
        self.parts.append(part)
        self._run(part, stop)
        return part

    def start(self, stop: threading.Event) -> None:
        c = self.cfg
        grpc_ok = lambda part: grpc_serving(part.port)  # noqa: E731
        expert = self._add(Part("expert", "expert_server", [
            "--model", str(c.model), "--format", c.format, "--threads", str(c.threads)], grpc_ok), stop)
        dense = self._add(Part("dense", "services.dense", [
            "--model", str(c.model), "--dtype", c.dtype, "--dense-format", c.dense_format, "--threads", str(c.threads),
            "--experts", "remote", "--transport", "shm", "--expert-servers", f"127.0.0.1:{expert.port}",
            "--served-model-name", c.served_model_name,
            "--keep-cpus-awake" if c.keep_cpus_awake else "--no-keep-cpus-awake"], grpc_ok), stop)
        args = ["--dense", f"127.0.0.1:{dense.port}", "--host", c.host, "--port", str(c.port),
                "--tool-parser", c.tool_parser, "--reasoning-parser", c.reasoning_parser]
        env_key = {"TANDEM_API_KEY": c.api_key} if c.api_key else {}
        os.environ.update(env_key)  # the key goes to the gateway by environment, never on a command line
        gateway = self._add(Part("gateway", "gateway", args, lambda part: http_ok(self.url + "/health/live"),
                                 listen=False), stop)
        wait_until(lambda: http_ok(self.url + "/health"), gateway.child, c.startup_timeout_s, stop)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def announce(self) -> None:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        with urllib.request.urlopen(urllib.request.Request(self.url + "/v1/models", headers=headers), timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
        auth = f' -H "Authorization: Bearer {self.cfg.api_key}"' if self.cfg.api_key else ""
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 32, "temperature": 0})
        print(f"\ntandem: ready at {self.url}  (OpenAI API under {self.url}/v1; Ctrl-C stops everything)\n"
              f"  curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n",
              flush=True)

    def watch(self, stop: threading.Event) -> None:
        """Restarts children that die; returns on Ctrl-C/SIGTERM, or when a child has died more often
        than the restart limit allows (then the exit is not clean)."""
        while not stop.wait(0.5):
            for part in self.parts:
                code = part.child.proc.poll()
                if code is not None and not stop.is_set() and not self._restart(part, code, stop):
                    self.clean_exit = False
                    return

    def _restart(self, part: Part, code: int, stop: threading.Event) -> bool:
        """Starts a dead part again after its backoff; False once it has used up its restarts."""
        c, now = self.cfg, time.monotonic()
        part.restarts = [t for t in part.restarts if now - t < c.restart_window_s]
        if len(part.restarts) >= c.max_restarts:
            print(f"tandem: {part.name} exited with code {code} after {len(part.restarts)} restarts within "
                  f"{c.restart_window_s:g} s (--max-restarts {c.max_restarts}); stopping", file=sys.stderr, flush=True)
            return False
        delay = min(c.restart_backoff_s * 2 ** len(part.restarts), MAX_BACKOFF_S)
        part.restarts.append(now)
        print(f"tandem: {part.name} exited with code {code}; restarting it in {delay:g} s on port "
              f"{part.port or c.port} (restart {len(part.restarts)} of {c.max_restarts} within "
              f"{c.restart_window_s:g} s)", flush=True)
        if stop.wait(delay):
            return True
        try:
            self._run(part, stop)
        except RuntimeError as exc:
            print(f"tandem: {part.name} did not come back: {exc}", flush=True)
            part.child.stop(5)  # seen dead on the next pass: restarted again or given up on
            return True
        print(f"tandem: {part.name} is back", flush=True)
        return True

    def stop(self) -> None:
        for child in reversed(self.children):
            code = child.stop()
            if code not in (0, -signal.SIGTERM):
                self.clean_exit = False
            print(f"tandem: {child.name} stopped (code {code})", flush=True)

