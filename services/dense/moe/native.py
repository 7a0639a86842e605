"""The in-process native expert backend: the C++ kernels of tandem_native, in this process.

This runs a whole model on any CPU, and is the baseline the expert server is measured against.
T tokens, D hidden size, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.checkpoint import Checkpoint
from services.common.errors import ExpertBackendError
from services.common.expert_weights import pack_layer
from services.common.model_config import ModelConfig
from services.dense.moe.experts import ExpertBackend
from services.dense.pool import shared_pool


class NativeExperts(ExpertBackend):
    def __init__(self, cfg: ModelConfig, checkpoint: Checkpoint, fmt: str, threads: int, group_size: int = 32):
        import tandem_native

        self._tn = tandem_native
        self.pool = shared_pool(threads)
        self.layers = {
            layer: tandem_native.MoeLayer(pack_layer(checkpoint, cfg, layer, fmt, group_size, self.pool))
            for layer in range(cfg.num_layers)
            if cfg.is_moe(layer)
        }

    def submit(self, layer, x, ids, weights):
        """With the dense path on the CPU the call runs here and now, on this thread and the pool's
        helpers (the cores have nothing else to do meanwhile: the shared experts wait for the same
        pool); with it on a GPU the call is started and the GPU works on while it runs."""
        if layer not in self.layers:
            raise ExpertBackendError(layer, "not a MoE layer of this model")
        x32 = np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())  # [T, D]
        ids64 = np.ascontiguousarray(ids.detach().to("cpu", torch.int64).numpy())  # [T, K]
        w32 = np.ascontiguousarray(weights.detach().to("cpu", torch.float32).numpy())  # [T, K]
        out = np.empty_like(x32)
        try:
            if x.device.type == "cpu":
                self._tn.moe_forward(self.layers[layer], x32, ids64, w32, out, self.pool)
                return None, out, x.dtype, x.device
            job = self._tn.moe_submit(self.layers[layer], x32, ids64, w32, out, self.pool)
        except ValueError as exc:
            raise ExpertBackendError(layer, str(exc)) from exc
        return job, out, x.dtype, x.device

    def wait(self, handle):
        job, out, dtype, device = handle
        if job is not None:
            job.wait()
        return torch.from_numpy(out).to(device=device, dtype=dtype)
