"""The gateway's one frozen configuration, built in __main__ from flags."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.parsing.output import REASONING_PARSERS, TOOL_PARSERS
from services.common.errors import ConfigError
from services.common.telemetry import TracingConfig


@dataclass(frozen=True)
class GatewayConfig:
    dense: str = "127.0.0.1:50051"  # the dense services' gRPC addresses, comma-separated
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* and /tokenize, /detokenize need "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    drain_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    retry_after_s: int = 1  # told to clients when the dense service is full
    tracing: TracingConfig = TracingConfig()
    tool_parser: str = "auto"  # the tool-call format (auto: recognised from the chat template)
    reasoning_parser: str = "auto"  # think: split <think>...</think>; none; auto: when the template writes <think>

    @property
    def dense_addresses(self) -> list[str]:
        return self.dense.split(",")

    def __post_init__(self):
        addresses = self.dense_addresses
        if any(a.rpartition(":")[0] == "" or not a.rpartition(":")[2].isdigit() for a in addresses):
            raise ConfigError(f"--dense: expected HOST:PORT[,HOST:PORT...], got {self.dense!r}")
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"--dense: an address is listed twice in {self.dense!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port: {self.port} is not a port")
        if self.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-parser: must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser: must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes: must be >= 1024, got {self.max_body_bytes}")
