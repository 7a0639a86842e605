"""The expert server's one frozen configuration, built in __main__ from flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError
from services.common.expert_weights import FORMATS


def parse_layers(text: str | None, shard: int | None = None) -> tuple[int, int] | None:
    """'A-B' (inclusive) or a single 'A' into a range; None means every layer. A comma list of
    ranges, one per server (as a StatefulSet gives its pods one argument list), takes the shard-th."""
    if text is None:
        return None
    ranges = text.split(",")
    if shard is not None:
        if not 0 <= shard < len(ranges):
            raise ConfigError(f"--shard: {shard} is not an index into the {len(ranges)} ranges of --layers {text!r}")
        text = ranges[shard]
    elif len(ranges) > 1:
        raise ConfigError(f"--layers: a list of ranges ({text!r}) needs --shard to pick one")
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 0 or hi < lo:
        raise ConfigError(f"--layers: expected A-B with 0 <= A <= B, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    format: str = "int4"
    layers: tuple[int, int] | None = None
    threads: int = 1
    listen: str = "127.0.0.1:50061"
    store: Path | None = None
    group_size: int = 32
    max_tokens: int = 8192         # most tokens one call (and one shared-memory session) may carry
    tls_cert: Path | None = None
    tls_key: Path | None = None
    echo: bool = False             # return x unchanged instead of computing (transport benchmarks)
    drain_s: float = 10.0          # the longest SIGTERM keeps answering open streams
    spin_us: float = 50.0          # how long a session's thread spins for the next call before sleeping
    compute_port: int | None = 0   # the grpc++ Compute server's port (0: any free one); None: none

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.threads < 1:
            raise ConfigError(f"--threads: must be >= 1, got {self.threads}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.spin_us <= 1e6:
            raise ConfigError(f"--spin-us: must be within [0, 1000000], got {self.spin_us:g}")
        if self.compute_port is not None and not 0 <= self.compute_port <= 65535:
            raise ConfigError(f"--compute-port: expected a port in [0, 65535] or 'off', got {self.compute_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
