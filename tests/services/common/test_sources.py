"""Quantized checkpoint sources: FP8 block-scaled and compressed-tensors INT4 against the same
weights dequantized (tests/quantized.py), and one clear error for each bad input."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.checkpoint import Checkpoint
from services.common.errors import CheckpointError, ConfigError
from services.common.expert_weights import pack_layer
from services.common.model_config import parse_model_config
from services.dense.generate import generate
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.conftest import PROMPT, load_fp32
from tests.quantized import dequantized, quantized
from tests.reference.hf_oracle import hf_greedy, hf_logits

TOL = 1e-4
EXPERT = "model.layers.1.mlp.experts.3.gate_proj"


def test_every_tensor_reads_as_its_dequantized_twin(kind):
    ours, ref = Checkpoint(quantized(kind)), load_file(dequantized(kind) / "model.safetensors")
    assert set(ours.names()) == set(ref)
    for name, want in ref.items():
        got = ours.get(name, tuple(want.shape))
        assert got.dtype.is_floating_point and torch.equal(got.float(), want), name


def test_logits_and_greedy_tokens_match_transformers_on_the_dequantized_checkpoint(kind):
    ids = Tokenizer(quantized(kind)).encode(PROMPT)
    model, _ = load_fp32(quantized(kind))
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    assert (ours - hf_logits(dequantized(kind), ids)).abs().max().item() <= TOL
    assert generate(model, ids, SamplingParams(temperature=0, max_tokens=32)).tokens == hf_greedy(dequantized(kind), ids, 32)


@pytest.fixture(params=["fp8", "fp8_ue8m0", "int4", "mxfp4"])
def kind(request):
    return request.param


@pytest.mark.native
def test_int4_experts_import_bit_exact():
    import tandem_native as tn

    ckpt = Checkpoint(quantized("int4"))
    cfg = parse_model_config(ckpt.config)
    ref = load_file(dequantized("int4") / "model.safetensors")
    layer = tn.MoeLayer(pack_layer(ckpt, cfg, 1, "int4", 64, tn.ThreadPool(1)))
    assert layer.levels == list(range(-8, 8)) and layer.group_size == 32  # the checkpoint's, not the flag's
    for e in range(cfg.moe.num_experts):
        gate, up, down = (ref[n] for n in cfg.expert_tensor_names(1, e))
        assert np.array_equal(tn.dequantize(layer, e, "w13"), torch.cat((gate, up)).numpy())
        assert np.array_equal(tn.dequantize(layer, e, "w2"), down.numpy())


@pytest.mark.native
def test_mxfp4_experts_import_bit_exact():
    """gpt-oss's MXFP4 experts into int4 with the E2M1 levels: the packed layer dequantized equals
    transformers' MXFP4 dequantization (gate and up rows de-interleaved, as the layer holds them)."""
    import tandem_native as tn

    ckpt = Checkpoint(quantized("mxfp4"))
    cfg = parse_model_config(ckpt.config)
    ref = load_file(dequantized("mxfp4") / "model.safetensors")
    layer = tn.MoeLayer(pack_layer(ckpt, cfg, 1, "int4", 64, tn.ThreadPool(1)))
    assert layer.levels == [-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12, 16] and layer.group_size == 32
    gate_up, down = ref["model.layers.1.mlp.experts.gate_up_proj"], ref["model.layers.1.mlp.experts.down_proj"]
    for e in range(cfg.moe.num_experts):
        w13 = torch.cat((gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T))
        assert np.array_equal(tn.dequantize(layer, e, "w13"), w13.numpy())
        assert np.array_equal(tn.dequantize(layer, e, "w2"), down[e].T.numpy())


@pytest.mark.native
def test_mxfp4_scales_beyond_fp16_are_quantized_again(copy_of):
    """A block scale of 2^-40 (s = 87) has no fp16: that tensor is packed from its floats instead,
    so the layer still holds its values within int4's error, and convert reports it."""
    import tandem_native as tn

    path = copy_of("mxfp4")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    _edit_tensors(path, lambda t: t[name].view(-1)[:4].fill_(87))
    ckpt = Checkpoint(path)
    cfg = parse_model_config(ckpt.config)
    assert ckpt.quantized("model.layers.1.mlp.experts.down_proj", index=0) is None
    assert ckpt.quantized("model.layers.1.mlp.experts.gate_up_proj", index=0) is not None
    errors = {}
    layer = tn.MoeLayer(pack_layer(ckpt, cfg, 1, "int4", 64, tn.ThreadPool(1), errors=errors))
    down = ckpt.get("model.layers.1.mlp.experts.down_proj")
    got = np.stack([tn.dequantize(layer, e, "w2") for e in range(cfg.moe.num_experts)])
    want = down.transpose(1, 2).numpy()
    assert set(errors) == {"down"} and 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.2


@pytest.mark.native
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_fp8_experts_pack_as_their_dequantized_floats_do(fmt):
    import tandem_native as tn

    pool = tn.ThreadPool(1)
    fp8, deq = Checkpoint(quantized("fp8")), Checkpoint(dequantized("fp8"))
    cfg = parse_model_config(fp8.config)
    assert np.array_equal(pack_layer(fp8, cfg, 2, fmt, 32, pool), pack_layer(deq, cfg, 2, fmt, 32, pool))


# ---------------------------------------------------------------- bad inputs


@pytest.fixture
def copy_of(tmp_path):
    def make(kind):
        dst = tmp_path / kind
        shutil.copytree(quantized(kind), dst)
        return dst
    return make


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


BAD_TENSORS = [
    ("fp8", lambda t: t.pop(EXPERT + ".weight_scale_inv"),
     f"FP8 tensor '{EXPERT}.weight' .* no scale tensor '{EXPERT}.weight_scale_inv'"),
    ("fp8", lambda t: t.update({EXPERT + ".weight_scale_inv": torch.ones(2, 2)}),
     rf"scale tensor '{EXPERT}.weight_scale_inv' .* shape \[2, 2\], expected \[1, 2\]"),
    ("int4", lambda t: t.update({EXPERT + ".weight_scale": torch.ones(64, 5, dtype=torch.bfloat16)}),
     rf"scale tensor '{EXPERT}.weight_scale' .* \[64, 5\]"),
    ("int4", lambda t: t.pop(EXPERT + ".weight_scale"), f"has no '{EXPERT}.weight_scale'"),
    ("int4", lambda t: t.update({EXPERT + ".weight_shape": torch.tensor([64, 200])}),
     rf"'{EXPERT}.weight_shape' says \[64, 200\]"),
]


@pytest.mark.parametrize("kind, edit, message", BAD_TENSORS,
                         ids=["fp8-no-scale", "fp8-scale-shape", "int4-scale-shape", "int4-no-scale", "int4-weight-shape"])
def test_a_bad_scale_or_shape_tensor_names_the_tensor(copy_of, kind, edit, message):
    path = copy_of(kind)
    _edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(path).get(EXPERT + ".weight")


def test_fp8_per_tensor_scales_are_refused(copy_of):
    path = copy_of("fp8")
    _edit_config(path, lambda q: q.pop("weight_block_size"))
    with pytest.raises(ConfigError, match="per-tensor or per-channel scales"):
        Checkpoint(path)


@pytest.mark.parametrize("key, value, message", [
    ("fmt", "e5m2", "FP8 fmt 'e5m2' is not supported"),
    ("weight_block_size", [128], "weight_block_size must be two positive integers"),
    ("scale_fmt", "e4m3", "scale_fmt 'e4m3' is not supported"),
    ("quant_method", "awq", "quant_method 'awq' is not supported"),
])
def test_fp8_config_variants_we_do_not_read(copy_of, key, value, message):
    path = copy_of("fp8")
    _edit_config(path, lambda q: q.update({key: value}))
    with pytest.raises(ConfigError, match=message):
        Checkpoint(path)


def test_fp8_tensors_without_a_quantization_config_are_refused(copy_of):
    path = copy_of("fp8")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported dtype F8_E4M3 .*quantization_config"):
        load_fp32(path)


def test_int4_asymmetric_schemes_are_refused(copy_of):
    path = copy_of("int4")
    _edit_config(path, lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False))
    with pytest.raises(ConfigError, match="group 'group_0' .*symmetric=False.* is not supported"):
        Checkpoint(path)


def test_mtp_layers_are_skipped(copy_of):
    """DeepSeek's multi-token-prediction layer (index num_hidden_layers) is never read."""
    path = copy_of("fp8")
    mtp = "model.layers.3.self_attn.o_proj.weight"
    _edit_tensors(path, lambda t: t.update({mtp: torch.full((8, 8), float("nan"))}))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ids = Tokenizer(path).encode(PROMPT)
    ckpt = Checkpoint(path)
    model, _ = load_fp32(path)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    assert (ours - hf_logits(dequantized("fp8"), ids)).abs().max().item() <= TOL
    assert mtp in ckpt
