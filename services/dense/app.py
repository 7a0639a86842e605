"""Assembles the dense service from its config: model and expert backend, KV budget, engine, gRPC."""

from __future__ import annotations

import logging
import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ConfigError
from services.dense.config import DenseConfig
from services.dense.engine import Engine
from services.dense.kv_cache import bytes_per_token
from services.dense.loader import load_model, open_checkpoint
from services.dense.server import DenseServicer, ModelInfo
from services.dense.tokenizer import Tokenizer
from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["DenseService"].full_name


def make_experts(cfg: DenseConfig):
    if cfg.experts == "reference":
        return None
    checkpoint, model_cfg = open_checkpoint(cfg.model)
    if cfg.experts == "remote":
        from services.dense.moe.remote import RemoteExperts

        return RemoteExperts(model_cfg, cfg.remote, trace_each=cfg.tracing.each_expert_call)
    from services.dense.moe.native import NativeExperts

    return NativeExperts(model_cfg, checkpoint, cfg.expert_format, cfg.threads)


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo")


def kv_blocks(cfg: DenseConfig, model) -> int:
    """Blocks of the paged KV cache: --kv-tokens, or a fraction of the free memory (capped at what
    max_running sequences of full context length could use)."""
    per_block = bytes_per_token(model.cfg, model.dtype) * cfg.block_size
    if cfg.kv_tokens:
        return -(-cfg.kv_tokens // cfg.block_size)
    useful = cfg.max_running * -(-model.cfg.max_position_embeddings // cfg.block_size)
    blocks = min(int(free_memory(model.device) * cfg.kv_memory_fraction) // per_block, useful)
    if blocks < 1:
        raise ConfigError("no memory left for the KV cache; lower the expert memory or raise --kv-memory-fraction")
    return blocks


def watch_experts(health_servicer, experts, stop: threading.Event, period_s: float = 2.0) -> None:
    """Keeps this service's health NOT_SERVING while any of its expert servers is not serving."""
    check = getattr(experts, "serving", None)
    while check is not None and not stop.wait(period_s):
        status = health_pb2.HealthCheckResponse.SERVING if check() else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            health_servicer.set(name, status)


@dataclass
class RunningDense:
    server: grpc.Server
    engine: Engine
    port: int
    experts: object
    stopping: threading.Event

    def stop(self, grace: float | None = None) -> None:
        self.stopping.set()
        self.server.stop(grace).wait()
        self.engine.stop()
        if self.experts is not None:
            self.experts.close()


def start(cfg: DenseConfig, experts=None) -> RunningDense:
    """Loads, sizes the KV cache, starts the engine and serves; `experts` overrides the backend the
    config names (tests use it to slow calls down)."""
    model, experts = load_model(cfg.model, cfg.runtime, experts or make_experts(cfg))
    engine = Engine(model, cfg.engine(kv_blocks(cfg, model)))
    tokens = engine.pool.num_blocks * engine.pool.block_size
    print(f"dense service: KV cache of {tokens} tokens ({engine.pool.num_blocks} blocks)", file=sys.stderr, flush=True)
    engine.start()
    info = ModelInfo(cfg.served_model_name or cfg.model.name, cfg.experts,
                     cfg.remote.addresses if cfg.remote else (), cfg.runtime.dtype, str(model.device))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(16, cfg.max_running + cfg.max_queue // 4)))
    pb_grpc.add_DenseServiceServicer_to_server(DenseServicer(engine, Tokenizer(cfg.model), info), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(cfg.listen)
    if port == 0:
        raise OSError(f"--listen: cannot bind {cfg.listen}")
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stopping = threading.Event()
    threading.Thread(target=watch_experts, args=(health_servicer, experts, stopping), daemon=True).start()
    return RunningDense(server, engine, port, experts, stopping)
