"""The three child processes of `tandem serve`: started in order, each waited for until healthy,
their output prefixed with their name, stopped in reverse order (SIGTERM, then SIGKILL)."""

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
from pathlib import Path

from services.common.healthcheck import serving

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"ready on port (\d+)")


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


class Stack:
    def __init__(self, cfg):
        self.cfg = cfg
        self.children: list[Child] = []
        self.clean_exit = True

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        child = Child(name, [sys.executable, "-m", module, *args])
        self.children.append(child)
        return child

    def start(self, stop: threading.Event) -> None:
        c, timeout = self.cfg, self.cfg.startup_timeout_s
        expert = self._spawn("expert", "expert_server", [
            "--model", str(c.model), "--format", c.format, "--threads", str(c.threads), "--listen", "127.0.0.1:0"])
        expert_port = expert.wait_port(timeout, stop)
        wait_until(lambda: grpc_serving(expert_port), expert, timeout, stop)
        dense = self._spawn("dense", "services.dense", [
            "--model", str(c.model), "--dtype", c.dtype, "--dense-format", c.dense_format, "--threads", str(c.threads),
            "--experts", "remote", "--transport", "shm",
            "--expert-servers", f"127.0.0.1:{expert_port}", "--listen", "127.0.0.1:0",
            "--served-model-name", c.served_model_name])
        dense_port = dense.wait_port(timeout, stop)
        wait_until(lambda: grpc_serving(dense_port), dense, timeout, stop)
        args = ["--dense", f"127.0.0.1:{dense_port}", "--host", c.host, "--port", str(c.port)]
        env_key = {"TANDEM_API_KEY": c.api_key} if c.api_key else {}
        os.environ.update(env_key)  # the key goes to the gateway by environment, never on a command line
        gateway = self._spawn("gateway", "gateway", args)
        wait_until(lambda: http_ok(self.url + "/health"), gateway, timeout, stop)

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
        """Returns on Ctrl-C/SIGTERM, or when a child dies (then the exit is not clean)."""
        while not stop.wait(0.5):
            for child in self.children:
                if child.proc.poll() is not None:
                    print(f"tandem: {child.name} exited with code {child.proc.returncode}; stopping", flush=True)
                    self.clean_exit = False
                    return

    def stop(self) -> None:
        for child in reversed(self.children):
            code = child.stop()
            if code not in (0, -signal.SIGTERM):
                self.clean_exit = False
            print(f"tandem: {child.name} stopped (code {code})", flush=True)

