"""tandem serve: the whole stack on one host (expert server, dense service, gateway), co-located over
shared memory, each in its own process; ready when all three are healthy; Ctrl-C stops all three.

    tandem serve [--model DIR] [--port 8000] [--format int4] [--dense-format int8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common import cpu_wake
from services.common.checkpoint import resolve_model
from services.common.errors import ConfigError, TandemError
from services.common.expert_weights import FORMATS, default_threads
from services.dense.runtime import DENSE_FORMATS, DTYPES
from services.launcher.processes import Stack


DEFAULT_NAME = "tandem-default"


@dataclass(frozen=True)
class LaunchConfig:
    model: Path | None  # None: the built-in default model
    host: str = "127.0.0.1"
    port: int = 8000
    format: str = "int4"
    dtype: str = "float32"
    dense_format: str = "float"
    threads: int = 1
    api_key: str | None = None
    served_model_name: str = ""  # "": the model directory's name
    tool_parser: str = "auto"  # the gateway's output parsers (auto: recognised from the chat template)
    reasoning_parser: str = "auto"
    keep_cpus_awake: bool = True  # the dense service's, while decoding (services/common/cpu_wake.py)
    startup_timeout_s: float = 600.0
    max_restarts: int = 5  # a child that dies is restarted at most this often within restart_window_s
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0  # before the first restart; doubles with each restart in the window

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {self.max_restarts}")


@dataclass(frozen=True)
class Defaults:
    dtype: str         # the dense path's activations, KV cache and float weights
    format: str        # routed experts
    dense_format: str  # dense linears
    why: str


def machine_defaults() -> Defaults:
    """What runs fastest here (bench/e2e.py measures the combinations): on a GPU bfloat16 with float
    dense weights and int4 experts; on a CPU the dense linears packed for the native kernels too (on
    a Sapphire Rapids class Xeon, 2 threads, int4 experts: int4 dense 91 tok/s, int8 80, bf16 65,
    float 26; float32 activations ahead of bfloat16 by 8-11%)."""
    if torch.cuda.is_available():
        return Defaults("bfloat16", "int4", "float", "a GPU: the dense path in bfloat16 on it")
    return Defaults("float32", "int4", "int4", "no GPU: dense linears and experts in int4 on the native kernels, "
                    "float32 activations between them: the fastest bench/e2e.py measured on a CPU")


# The built-in model's experts are small (0.16 GB in bf16), and bf16 computes what the float model
# does: its first answer token sits at a near-tie ("The" 25.33 against "L" 25.24) that the integer
# formats' 8-bit activations tip. Its dense linears stay float for the same reason.
DEFAULT_MODEL_FORMAT = "bf16"
DEFAULT_MODEL_DENSE_FORMAT = "float"


def parse(argv: list[str]) -> LaunchConfig:
    d = machine_defaults()
    p = argparse.ArgumentParser(prog="tandem", description="Tandem: serve a MoE model on one GPU plus a CPU.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start expert server, dense service and gateway on this host")
    s.add_argument("--model", type=Path, help="Hugging Face checkpoint directory, or a .gguf file (default: the "
                   "built-in model)")
    s.add_argument("--gguf", type=Path, help="weights from this GGUF file (the first of a split); --model DIR then "
                   "gives config.json and the tokenizer")
    s.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    s.add_argument("--port", type=int, default=8000, help="the gateway's port")
    s.add_argument("--format", choices=list(FORMATS),
                   help=f"expert format (default here: {d.format}; {DEFAULT_MODEL_FORMAT} for the built-in model)")
    s.add_argument("--dense-format", choices=list(DENSE_FORMATS),
                   help=f"dense linears' format (default here: {d.dense_format}; {DEFAULT_MODEL_DENSE_FORMAT} for the "
                        "built-in model)")
    s.add_argument("--dtype", choices=list(DTYPES), default=d.dtype, help=f"dense dtype (default here: {d.dtype})")
    s.add_argument("--threads", type=int, default=default_threads(), help="native kernel threads")
    s.add_argument("--api-key", help="require this bearer key at the gateway")
    s.add_argument("--tool-parser", default="auto", help="the gateway's tool-call format (auto: recognised from "
                   "the chat template; the names: python -m gateway --help)")
    s.add_argument("--max-restarts", type=int, default=5, help="restarts of a child that dies, within 10 minutes, "
                   "before the launcher gives up and stops (0: stop at the first death)")
    s.add_argument("--reasoning-parser", default="auto", help="the gateway's reasoning split (auto, think, none)")
    s.add_argument("--keep-cpus-awake", action=argparse.BooleanOptionalAction, default=True,
                   help="while requests run, hold the CPUs' wake-up latency at 0 us where /dev/cpu_dma_latency is "
                        "writable (default: on)")
    a = p.parse_args(argv)
    model = resolve_model(a.model, a.gguf) if a.model is not None or a.gguf is not None else None
    if model is not None and not (model / "config.json").is_file():
        raise ConfigError(f"--model: {a.model} has no config.json (a Hugging Face checkpoint directory is needed)")
    fmt = a.format or (d.format if model is not None else DEFAULT_MODEL_FORMAT)
    dense = a.dense_format or (d.dense_format if model is not None else DEFAULT_MODEL_DENSE_FORMAT)
    if dense != "float" and torch.cuda.is_available():
        raise ConfigError(f"--dense-format {dense}: packed dense linears run on the CPU; with a GPU keep float")
    print(f"tandem: defaults on this machine: --dtype {d.dtype} --dense-format {d.dense_format} --format {d.format} "
          f"({d.why}); {wake_line()}", flush=True)
    return LaunchConfig(model, a.host, a.port, fmt, a.dtype, dense, a.threads, a.api_key,
                        tool_parser=a.tool_parser, reasoning_parser=a.reasoning_parser, max_restarts=a.max_restarts,
                        keep_cpus_awake=a.keep_cpus_awake)


def wake_line() -> str:
    if cpu_wake.available():
        return f"--keep-cpus-awake (while decoding, {cpu_wake.DEVICE} holds idle CPUs polling)"
    return f"--keep-cpus-awake has no effect here ({cpu_wake.DEVICE} is not writable: idle CPUs may halt)"


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.model is None:
        from services.launcher.default_model import DESCRIPTION, default_model

        print(f"tandem: using the built-in default model, {DESCRIPTION}", flush=True)
        cfg = dataclasses.replace(cfg, model=default_model(), served_model_name=DEFAULT_NAME)
    print(f"tandem: {cfg}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(cfg)
    try:
        stack.start(stop)
        if not stop.is_set():
            stack.announce()
            stack.watch(stop)
    except RuntimeError as exc:
        print(f"tandem: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
    return 0 if stack.clean_exit else 1


if __name__ == "__main__":
    sys.exit(main())
