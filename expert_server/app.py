"""Assembles an expert server from its config: memory check, server up, weights in, Compute's grpc++
server up, then SERVING."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from expert_server import native_compute, store
from expert_server.config import ServerConfig
from expert_server.executor import ExpertExecutor
from expert_server.server import ExpertServicer, build_server, set_serving
from services.common.checkpoint import Checkpoint
from services.common.expert_weights import packed_bytes
from services.common.model_config import parse_model_config

log = logging.getLogger(__name__)
# The pool's helpers spin this long for work before sleeping: within a call, and after a co-located
# client's prewake until the call it announces arrives (the dense side's routing, then the session
# thread's wake-up). A shared-memory session parks them after each call, so no spin runs between calls.
POOL_SPIN_US = 300


@dataclass
class RunningServer:
    server: object
    servicer: ExpertServicer
    health: object
    port: int
    experts: store.ExpertLayers

    def stop(self, grace: float | None = None) -> None:
        """Drains: NOT_SERVING, no new streams or sessions, the open ones answered until quiet (at most
        grace seconds); then ends them and stops the gRPC server."""
        deadline = time.monotonic() + (grace or 0.0)
        set_serving(self.health, False)
        self.server.stop(grace)
        self.servicer.drain(deadline)
        self.server.stop(None).wait()


def announce(cfg: ServerConfig, checkpoint: Checkpoint, model_cfg) -> list[int]:
    """Prints what will be loaded and the memory it needs; refuses if the machine lacks it."""
    layers = store.moe_layers(model_cfg, cfg.layers)
    need = packed_bytes(model_cfg, cfg.format, cfg.group_size, layers)
    source = f"store {cfg.store}" if cfg.store else f"checkpoint {checkpoint.dir}"
    print(f"expert server: {len(layers)} MoE layers ({layers[0]}-{layers[-1]}) in {cfg.format} from {source}: "
          f"needs {need / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    store.check_memory(need, store.available_memory())
    return layers


def load_experts(cfg: ServerConfig, checkpoint: Checkpoint, model_cfg, layers: list[int], pool) -> store.ExpertLayers:
    if cfg.store:
        return store.open_store(cfg.store, checkpoint, model_cfg, layers, cfg.format, cfg.group_size)
    return store.pack_from_checkpoint(checkpoint, model_cfg, layers, cfg.format, cfg.group_size, pool)


def start(cfg: ServerConfig) -> RunningServer:
    """Validates the checkpoint and memory, starts listening (NOT_SERVING), loads, then serves."""
    import tandem_native

    checkpoint = Checkpoint(cfg.model)
    model_cfg = parse_model_config(checkpoint.config)
    pool = tandem_native.ThreadPool(cfg.threads, POOL_SPIN_US)
    servicer = ExpertServicer(cfg, checkpoint.config.get("model_type", model_cfg.family), model_cfg.moe.top_k)
    layers = announce(cfg, checkpoint, model_cfg)
    server, health_servicer, port = build_server(cfg, servicer)
    try:
        experts = load_experts(cfg, checkpoint, model_cfg, layers, pool)
        executor = ExpertExecutor(experts.layers, pool, model_cfg.hidden_size, model_cfg.moe.num_experts,
                                  cfg.max_tokens, cfg.echo)
        compute = native_compute.start(cfg, executor, servicer.activity)
    except BaseException:
        server.stop(None)
        raise
    servicer.ready(executor, experts.nbytes, compute)
    set_serving(health_servicer, True)
    log.info("expert server serving layers %s", sorted(experts.layers))
    return RunningServer(server, servicer, health_servicer, port, experts)
