"""Checkpoint reading: single and sharded layouts, lazy reads, and one clear error per bad input."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.checkpoint import Checkpoint
from services.common.errors import CheckpointError, ConfigError
from services.dense.loader import load_model
from services.dense.runtime import DenseRuntime
from tests.checkpoints import checkpoint

ATTN = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture
def ckpt_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3_moe"), dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _load(path):
    return load_model(path, DenseRuntime(dtype="float32", device="cpu"))


def test_opening_reads_headers_only(ckpt_copy):
    ckpt = Checkpoint(ckpt_copy)
    assert ckpt.loaded == [] and ATTN in ckpt
    assert ckpt.get(ATTN).shape == (64, 64) and ckpt.loaded == [ATTN]


def test_sharded_checkpoint_loads_the_same_model(tmp_path, ckpt_copy):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(ckpt_copy).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt_copy / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    tokens = torch.arange(10, 40)
    a, _ = _load(ckpt_copy)
    b, _ = _load(sharded)
    assert torch.equal(a.forward(tokens, a.new_cache(30)), b.forward(tokens, b.new_cache(30)))


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="missing checkpoint directory"):
        _load(tmp_path / "nowhere")


def test_missing_config_json(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing file: .*config.json"):
        _load(ckpt_copy)


def test_missing_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file: no model.safetensors"):
        _load(ckpt_copy)


def test_missing_shard_named_by_the_index(ckpt_copy):
    index = {"metadata": {}, "weight_map": {ATTN: "model-00002-of-00002.safetensors"}}
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing file: .*model-00002-of-00002.safetensors"):
        _load(ckpt_copy)


def test_unsupported_model_type(ckpt_copy):
    config = json.loads((ckpt_copy / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        _load(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    _rewrite(ckpt_copy, lambda t: t.pop(ATTN))
    with pytest.raises(CheckpointError, match=f"missing tensor '{ATTN}'"):
        _load(ckpt_copy)


def test_wrong_shape(ckpt_copy):
    _rewrite(ckpt_copy, lambda t: t.update({ATTN: torch.zeros(64, 63)}))
    with pytest.raises(CheckpointError, match=rf"'{ATTN}'.*shape \[64, 63\], expected \[64, 64\]"):
        _load(ckpt_copy)


def test_unsupported_dtype(ckpt_copy):
    _rewrite(ckpt_copy, lambda t: t.update({ATTN: t[ATTN].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=f"'{ATTN}'.*unsupported dtype F8_E4M3"):
        _load(ckpt_copy)


def test_truncated_safetensors(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated safetensors file: tensor"):
        _load(ckpt_copy)


def test_file_cut_inside_the_header(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt or truncated safetensors header"):
        _load(ckpt_copy)


def test_corrupt_safetensors_header(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json !!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        _load(ckpt_copy)


def test_header_offsets_that_disagree_with_the_shape(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header[ATTN]["shape"] = [64, 32]
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    path.write_bytes(data[:8] + raw + data[8 + n :])
    with pytest.raises(CheckpointError, match=f"'{ATTN}' byte size does not match"):
        _load(ckpt_copy)


def test_invalid_config_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        _load(ckpt_copy)
