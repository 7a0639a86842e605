"""The dense service's one frozen configuration, built in __main__ from flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError
from services.common.telemetry import TracingConfig
from services.common.expert_weights import FORMATS
from services.dense.engine import EngineConfig
from services.dense.moe.remote import RemoteConfig
from services.dense.runtime import DenseRuntime

EXPERTS = ("native", "reference", "remote")


@dataclass(frozen=True)
class DenseConfig:
    model: Path
    runtime: DenseRuntime
    experts: str = "native"
    expert_format: str = "int4"
    threads: int = 1
    remote: RemoteConfig | None = None  # with experts == "remote"
    kv_tokens: int = 0  # 0: size the KV cache from kv_memory_fraction
    kv_memory_fraction: float = 0.2  # of the device's free memory after the weights are loaded
    block_size: int = 16
    max_batch_tokens: int = 512
    max_running: int = 64
    max_queue: int = 256
    prefix_caching: bool = True
    keep_cpus_awake: bool = True  # while decoding (services/common/cpu_wake.py)
    listen: str = "127.0.0.1:50051"
    generate_port: int | None = 0  # the grpc++ Generate server's port on listen's host (0: any free one); None: none
    served_model_name: str = ""
    tracing: TracingConfig = TracingConfig()

    def __post_init__(self):
        if self.experts not in EXPERTS:
            raise ConfigError(f"--experts: expected one of {', '.join(EXPERTS)}, got {self.experts!r}")
        if self.expert_format not in FORMATS:
            raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {self.expert_format!r}")
        if (self.experts == "remote") != (self.remote is not None):
            raise ConfigError("--expert-servers goes with --experts remote (and only with it)")
        if self.threads < 1:
            raise ConfigError(f"--threads: must be >= 1, got {self.threads}")
        if self.kv_tokens < 0 or not 0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError("--kv-tokens must be >= 0 and --kv-memory-fraction in (0, 0.95]")
        for name in ("block_size", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.generate_port is not None and not 0 <= self.generate_port <= 65535:
            raise ConfigError(f"--generate-port: expected a port in [0, 65535] or 'off', got {self.generate_port}")
        if self.max_queue < 0:
            raise ConfigError(f"--max-queue: must be >= 0, got {self.max_queue}")

    def engine(self, kv_blocks: int) -> EngineConfig:
        return EngineConfig(kv_blocks=kv_blocks, block_size=self.block_size, max_batch_tokens=self.max_batch_tokens,
                            max_running=self.max_running, max_queue=self.max_queue,
                            prefix_caching=self.prefix_caching, keep_cpus_awake=self.keep_cpus_awake)
