"""The routed experts are reached only through the ExpertBackend interface."""

import pytest
import torch

from services.common.checkpoint import Checkpoint
from services.common.errors import ExpertBackendError
from services.common.model_config import parse_model_config
from services.dense.loader import open_checkpoint
from services.dense.models.decoder import MoeDecoder
from services.dense.moe.block import MoeBlock
from services.dense.moe.experts import ExpertBackend
from services.dense.moe.reference import TorchExperts
from services.dense.moe.router import route
from services.dense.weights import WeightLoader
from tests import checkpoints
from tests.conftest import load_fp32


class CountingExperts(ExpertBackend):
    """Records every call, then delegates to the reference backend (built from its own checkpoint view)."""

    def __init__(self, path):
        ckpt = Checkpoint(path)
        self.inner = TorchExperts(parse_model_config(ckpt.config), ckpt, torch.float32, torch.device("cpu"))
        self.calls = []

    def submit(self, layer, x, ids, weights):
        self.calls.append((layer, tuple(x.shape), tuple(ids.shape), tuple(weights.shape), ids.dtype, weights.dtype))
        return self.inner.submit(layer, x, ids, weights)

    def wait(self, handle):
        return self.inner.wait(handle)


def test_every_moe_layer_calls_the_backend_once_per_forward_with_right_shapes(family_checkpoint, prompt_ids):
    _, path = family_checkpoint
    counting = CountingExperts(path)
    model, backend = load_fp32(path, counting)
    assert backend is counting
    cfg = model.cfg
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    cache = model.new_cache(len(prompt_ids) + 1)
    model.forward(torch.tensor(prompt_ids), cache)
    model.forward(torch.tensor([5]), cache)
    d, k = cfg.hidden_size, cfg.moe.top_k
    expected = [(i, (t, d), (t, k), (t, k), torch.int64, torch.float32) for t in (len(prompt_ids), 1) for i in moe_layers]
    assert counting.calls == expected


class RecordingExperts(CountingExperts):
    """Also records the entry points the MoE block uses, in order (forward's default goes on to submit)."""

    def __init__(self, path):
        super().__init__(path)
        self.used = []

    def expect(self, layer):
        self.used.append("expect")

    def forward(self, layer, x, ids, weights):
        self.used.append("forward")
        return super().forward(layer, x, ids, weights)

    def submit(self, layer, x, ids, weights):
        self.used.append("submit")
        return super().submit(layer, x, ids, weights)

    def wait(self, handle):
        self.used.append("wait")
        return super().wait(handle)


@pytest.mark.parametrize("name, shared", [("qwen3_moe", False), ("deepseek_v3", True)])
def test_the_moe_block_hints_the_routing_it_runs_and_splits_the_call_only_around_shared_experts(name, shared):
    """expect() comes only where the block routes (a caller that routed, NativeLayer, has the call
    follow at once); a block with shared experts computes them between submit and wait, one without
    makes the call in one forward. The result is the same either way."""
    path = checkpoints.checkpoint(name)
    recording = RecordingExperts(path)
    model, _ = load_fp32(path, recording)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoeBlock))
    assert (block.shared is not None) == shared
    x = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    call = ["submit", "wait"] if shared else ["forward", "submit", "wait"]
    routed_here = block(x)
    assert recording.used == ["expect", *call]
    recording.used.clear()
    logits = block.gate(x.float())
    assert torch.equal(block(x, logits, route(block.router, logits, block.bias)), routed_here)
    assert recording.used == call


def test_dense_side_never_reads_routed_expert_tensors_with_a_non_local_backend(family_checkpoint):
    _, path = family_checkpoint
    checkpoint, cfg = open_checkpoint(path)
    MoeDecoder(cfg, WeightLoader(checkpoint, torch.float32, torch.device("cpu")), CountingExperts(path))
    read = set(checkpoint.loaded)
    assert read, "the dense side loaded nothing at all"
    assert not [n for n in read if cfg.is_routed_expert_tensor(n)]
    dense_tensors = {n for n in checkpoint.names() if not cfg.is_routed_expert_tensor(n)}
    assert read == dense_tensors  # and it reads everything else


def test_reference_backend_output_is_the_weighted_sum_of_expert_mlps(family_checkpoint):
    _, path = family_checkpoint
    checkpoint, cfg = open_checkpoint(path)
    backend = TorchExperts(cfg, checkpoint, torch.float32, torch.device("cpu"))
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    ids = torch.randint(0, cfg.moe.num_experts, (3, cfg.moe.top_k), generator=gen)
    w = torch.rand(3, cfg.moe.top_k, generator=gen)
    x_before, ids_before, w_before = x.clone(), ids.clone(), w.clone()
    out = backend.forward(layer, x, ids, w)
    expected = torch.zeros_like(x)
    for t in range(3):
        for k in range(cfg.moe.top_k):
            expected[t] += w[t, k] * expert_mlp(checkpoint, cfg, layer, int(ids[t, k]), x[t])
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(ids, ids_before) and torch.equal(w, w_before)


def expert_mlp(checkpoint, cfg, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert on one token x [D], from the checkpoint's tensors as the family stores them."""
    if not cfg.moe.stacked:
        gate, up, down = (checkpoint.get(n) for n in cfg.expert_tensor_names(layer, e))
        return down @ (torch.nn.functional.silu(gate @ x) * (up @ x))
    base = f"model.layers.{layer}.mlp.experts"  # gpt-oss: x @ W, gate and up interleaved, clamped
    gate_up = x @ checkpoint.get(f"{base}.gate_up_proj")[e] + checkpoint.get(f"{base}.gate_up_proj_bias")[e]
    limit, alpha = cfg.moe.swiglu_limit, cfg.moe.swiglu_alpha
    gate, up = gate_up[0::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
    h = (up + 1) * gate * torch.sigmoid(alpha * gate)
    return h @ checkpoint.get(f"{base}.down_proj")[e] + checkpoint.get(f"{base}.down_proj_bias")[e]


def test_reference_backend_rejects_a_bad_layer_or_expert_id(family_checkpoint):
    _, path = family_checkpoint
    checkpoint, cfg = open_checkpoint(path)
    backend = TorchExperts(cfg, checkpoint, torch.float32, torch.device("cpu"))
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    x, w = torch.zeros(1, cfg.hidden_size), torch.ones(1, 1)
    with pytest.raises(ExpertBackendError, match="out of range"):
        backend.forward(layer, x, torch.tensor([[cfg.moe.num_experts]]), w)
    with pytest.raises(ExpertBackendError, match=f"layer {cfg.num_layers}"):
        backend.forward(cfg.num_layers, x, torch.tensor([[0]]), w)
