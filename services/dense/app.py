"""Assembles the dense service from its config: model and expert backend, KV budget, engine, gRPC."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.checkpoint import Checkpoint
from services.common.errors import ConfigError
from services.common.expert_weights import packed_bytes
from services.common.model_config import parse_model_config
from services.dense import native_generate
from services.dense.config import DenseConfig
from services.dense.engine import Engine
from services.dense.kv_cache import bytes_per_token
from services.dense.loader import load_model, open_checkpoint
from services.dense.server import DenseServicer, ModelInfo
from services.dense.tokenizer import Tokenizer
from services.dense.weights import FINER, PACKED_BYTES_PER_WEIGHT, kv_format
from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["DenseService"].full_name
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def _layer(name: str) -> int:
    m = _LAYER.match(name)
    return int(m[1]) if m else -1


def _packed_linear(name: str) -> bool:
    """A weight --dense-format packs (an estimate: every projection but MLA's kv_b, and lm_head)."""
    return (name.endswith(".weight") and "_proj" in name and "kv_b_proj" not in name) or name == "lm_head.weight"


def _packed_format(name: str, fmt: str, routed_experts: int) -> str:
    """The format a linear is packed in under --dense-format fmt (lm_head one finer, the key and value
    projections weights.kv_format's)."""
    if name == "lm_head.weight":
        return FINER.get(fmt, fmt)
    return kv_format(fmt, routed_experts) if name.endswith(("k_proj.weight", "v_proj.weight")) else fmt


def check_memory(cfg: DenseConfig) -> None:
    """Prints what loading will take (dense weights on the device, the KV cache when --kv-tokens
    fixes it, in-process experts in host RAM) and refuses, naming the numbers and what to change,
    when the device or the host lacks it. MTP layers (past num_hidden_layers) are never loaded."""
    checkpoint = Checkpoint(cfg.model)
    model_cfg = parse_model_config(checkpoint.config)
    device, dtype = cfg.runtime.torch_device, cfg.runtime.torch_dtype
    size = torch.empty((), dtype=dtype).element_size()
    loaded = [n for n in checkpoint.names() if _layer(n) < model_cfg.num_layers]
    routed = [n for n in loaded if model_cfg.is_routed_expert_tensor(n)]
    dense = [n for n in loaded if n not in set(routed) or cfg.experts == "reference"]
    fmt = cfg.runtime.weights
    packed = {n: PACKED_BYTES_PER_WEIGHT[_packed_format(n, fmt, model_cfg.moe.num_experts)]
              for n in dense if fmt != "float" and _packed_linear(n)}
    weights = sum(math.prod(checkpoint.shape(n)) * packed.get(n, size) for n in dense)
    kv = cfg.kv_tokens * bytes_per_token(model_cfg, dtype)
    experts = packed_bytes(model_cfg, cfg.expert_format) if cfg.experts == "native" else 0
    gib = 2**30
    kinds = cfg.runtime.dtype if cfg.runtime.weights == "float" else f"{cfg.runtime.weights} linears, {cfg.runtime.dtype}"
    parts = f"{weights / gib:.2f} GiB of weights ({kinds})" + (f", {kv / gib:.2f} GiB of KV cache" if kv else "")
    host = f"{experts / gib:.2f} GiB of {cfg.expert_format} experts in host RAM" if experts else ""
    print(f"dense service: needs {parts} on {device}" + (f", {host}" if host else ""), file=sys.stderr, flush=True)
    needs = {device.type: weights + kv}
    needs["cpu"] = needs.get("cpu", 0) + experts
    for kind, need in needs.items():
        free = free_memory(device if kind == device.type else torch.device("cpu"))
        if need > free:
            raise ConfigError(
                f"dense service: needs {need / gib:.2f} GiB on {kind} ({parts}{', ' + host if host and kind == 'cpu' else ''}) "
                f"but only {free / gib:.2f} GiB is free; use --dtype bfloat16, fewer --kv-tokens, a smaller --dense-format "
                "or --format, or --experts remote"
            )


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
    generate: object | None = None  # tandem_grpc.GenerateServer, serving the servicer's open_stream

    def stop(self, grace: float | None = None) -> None:
        self.stopping.set()
        stopped = self.server.stop(grace)
        if self.generate is not None:
            self.generate.stop(grace or 0.0)
        stopped.wait()
        self.engine.stop()
        if self.experts is not None:
            self.experts.close()


def start(cfg: DenseConfig, experts=None) -> RunningDense:
    """Loads, sizes the KV cache, starts the engine and serves; `experts` overrides the backend the
    config names (tests use it to slow calls down)."""
    check_memory(cfg)
    model, experts = load_model(cfg.model, cfg.runtime, experts or make_experts(cfg))
    engine = Engine(model, cfg.engine(kv_blocks(cfg, model)))
    tokens = engine.pool.num_blocks * engine.pool.block_size
    print(f"dense service: KV cache of {tokens} tokens ({engine.pool.num_blocks} blocks)", file=sys.stderr, flush=True)
    engine.start()
    info = ModelInfo(cfg.served_model_name or cfg.model.name, cfg.experts,
                     cfg.remote.addresses if cfg.remote else (), cfg.runtime.dtype, str(model.device))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(16, cfg.max_running + cfg.max_queue // 4)))
    servicer = DenseServicer(engine, Tokenizer(cfg.model), info)
    generate = native_generate.start(cfg, servicer)
    if generate is not None:
        servicer.info = dataclasses.replace(info, generate_port=generate.port)
    pb_grpc.add_DenseServiceServicer_to_server(servicer, server)
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
    return RunningDense(server, engine, port, experts, stopping, generate)
