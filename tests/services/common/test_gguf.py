"""GGUF models: tiny files written with gguf-py (tests/gguf_files.py) against transformers running
the same tensors as gguf-py dequantizes them; lossless imports; one clear error per bad file."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.common.checkpoint import Checkpoint, resolve_model
from services.common.errors import CheckpointError, ConfigError
from services.common.expert_weights import pack_layer
from services.common.model_config import parse_model_config
from services.dense.generate import generate
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import checkpoint
from tests.conftest import PROMPT, load_fp32
from tests.expert_server.servers import ROOT
from tests.gguf_files import converted_reference, gguf_model, gguf_reference, qwen3_reference
from tests.reference.hf_oracle import hf_greedy, hf_logits

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2")
CASES = [(f, "Q8_0") for f in FAMILIES] + [("qwen3_moe", q) for q in ("F32", "BF16", "Q4_0", "Q4_1")] + [("deepseek_v3", "Q4_0")]


@pytest.mark.parametrize("name, qtype", CASES)
def test_a_gguf_alone_matches_transformers_on_its_dequantized_tensors(name, qtype):
    path = resolve_model(gguf_model(name, qtype))
    ckpt, ref = Checkpoint(path), load_file(gguf_reference(name, qtype) / "model.safetensors")
    assert set(ckpt.names()) == set(ref)
    for key, want in ref.items():
        assert torch.equal(ckpt.get(key, tuple(want.shape)).float(), want), key
    ids = Tokenizer(path).encode(PROMPT)
    assert ids == Tokenizer(checkpoint(name)).encode(PROMPT)  # the tokenizer rebuilt from the metadata
    model, _ = load_fp32(path)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    assert (ours - hf_logits(gguf_reference(name, qtype), ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("variant", ["fused", "split"])
def test_fused_gate_up_experts_and_split_files_read_the_same_tensors(variant):
    path = gguf_model("qwen3_moe", "Q8_0", variant)
    if variant == "split":
        assert "-00001-of-" in path.name and len(list(path.parent.glob("*.gguf"))) > 2
    ckpt, ref = Checkpoint(resolve_model(path)), load_file(gguf_reference("qwen3_moe", "Q8_0") / "model.safetensors")
    assert set(ckpt.names()) == set(ref)
    for key, want in ref.items():
        assert torch.equal(ckpt.get(key, tuple(want.shape)).float(), want), key


def test_a_split_gguf_with_a_file_missing(tmp_path):
    src = gguf_model("qwen3_moe", "Q8_0", "split")
    shards = sorted(src.parent.glob("*.gguf"))
    for f in shards[:-1]:
        (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=f"split GGUF is missing {shards[-1].name}"):
        resolve_model(tmp_path / src.name)


def test_a_gguf_next_to_a_hugging_face_directory_greedy_decodes_as_transformers():
    path = resolve_model(checkpoint("deepseek_v3"), gguf_model("deepseek_v3", "Q8_0"))
    assert Checkpoint(path).source.kind == "gguf"
    ids = Tokenizer(path).encode(PROMPT)
    model, _ = load_fp32(path)
    eos = Tokenizer(path).eos_token_ids
    ours = generate(model, ids, SamplingParams(temperature=0, max_tokens=32), eos).tokens
    assert ours == hf_greedy(gguf_reference("deepseek_v3", "Q8_0"), ids, 32)


@pytest.mark.native
@pytest.mark.parametrize("qtype, fmt", [("Q8_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4_asym")])
def test_q8_0_q4_0_and_q4_1_experts_import_bit_exact(qtype, fmt):
    import tandem_native as tn

    ckpt = Checkpoint(resolve_model(gguf_model("qwen3_moe", qtype)))
    cfg = parse_model_config(ckpt.config)
    ref = load_file(gguf_reference("qwen3_moe", qtype) / "model.safetensors")
    layer = tn.MoeLayer(pack_layer(ckpt, cfg, 0, fmt, 64, tn.ThreadPool(1)))
    assert layer.group_size == 32 and layer.levels == (list(range(-8, 8)) if fmt == "int4" else [])
    for e in range(cfg.moe.num_experts):
        gate, up, down = (ref[n] for n in cfg.expert_tensor_names(0, e))
        assert np.array_equal(tn.dequantize(layer, e, "w13"), torch.cat((gate, up)).numpy())
        assert np.array_equal(tn.dequantize(layer, e, "w2"), down.numpy())


# ---------------------------------------------------------------- bad files


def _rewrite(src, dst, edit_meta=None, edit_tensor=None):
    """A copy of the GGUF at src with metadata values or one tensor's type changed."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    arch = edit_meta.get("general.architecture", arch) if edit_meta else arch
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        qtype, data = t.tensor_type, t.data
        if edit_tensor and t.name == edit_tensor:
            qtype = gguf.GGMLQuantizationType.IQ2_XXS
            data = np.zeros((*tuple(reversed(t.shape.tolist()))[:-1], t.shape[0] // 256 * 66), dtype=np.uint8)
        w.add_tensor(t.name, np.array(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unsupported_architecture(tmp_path):
    bad = _rewrite(gguf_model("qwen3_moe", "Q8_0"), tmp_path / "m.gguf", edit_meta={"general.architecture": "gpt2"})
    with pytest.raises(CheckpointError, match="GGUF architecture 'gpt2' is not supported"):
        resolve_model(bad)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    bad = _rewrite(gguf_model("qwen3_moe", "F32"), tmp_path / "m.gguf", edit_tensor="blk.0.attn_q.weight")
    with pytest.raises(CheckpointError, match="tensor 'blk.0.attn_q.weight' has GGUF type IQ2_XXS, which is not supported"):
        Checkpoint(resolve_model(bad))


def test_truncated_gguf(tmp_path):
    src = gguf_model("qwen3_moe", "Q8_0")
    bad = tmp_path / "m.gguf"
    bad.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    with pytest.raises(CheckpointError, match="m.gguf: (not a readable GGUF file|truncated GGUF)"):
        resolve_model(bad)


def test_metadata_that_disagrees_with_the_given_config(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(checkpoint("qwen3_moe"), hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_experts": 8}))
    with pytest.raises(CheckpointError, match="disagree: GGUF metadata gives num_experts = 16, config.json 8"):
        Checkpoint(resolve_model(hf, gguf_model("qwen3_moe", "Q8_0")))


def test_a_directory_holding_only_a_gguf_is_a_gguf_alone(tmp_path):
    src = gguf_model("qwen3_moe", "Q8_0")
    (tmp_path / src.name).symlink_to(src)
    path = resolve_model(tmp_path)
    assert path != tmp_path and Checkpoint(path).source.kind == "gguf"
    assert path.name == "qwen3_moe-Q8_0"  # the name it is served under
    assert resolve_model(gguf_model("qwen3_moe", "Q8_0", "split")).name == "qwen3_moe-Q8_0split"


def test_a_gguf_flag_that_is_not_a_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match="is not a .gguf file"):
        resolve_model(checkpoint("qwen3_moe"), tmp_path / "nothing.gguf")


# ---------------------------------------------------------------- llama.cpp's own K-quant and IQ files

FIXTURES = sorted((ROOT / "tests" / "fixtures" / "gguf").glob("qwen3_moe_k-*.gguf"))
CONVERTED = sorted((ROOT / "tests" / "fixtures" / "gguf").glob("*-converted-F16.gguf"))


@pytest.mark.parametrize("path", CONVERTED, ids=lambda p: p.stem.split("-")[0])
def test_files_from_llama_cpps_own_converter_match_transformers(path, tmp_path):
    """Its layouts as it writes them: DeepSeek's kv_b split, llama's q/k permutation, merged experts,
    llama.cpp's metadata (MLA's key_length_mla, head_count_kv 1, yarn_log_multiplier)."""
    family = path.stem.split("-")[0]
    model_dir = resolve_model(path)
    ids = Tokenizer(checkpoint(family)).encode(PROMPT)
    assert Tokenizer(model_dir).encode(PROMPT) == ids
    model, _ = load_fp32(model_dir)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    assert (ours - hf_logits(converted_reference(family, path, tmp_path), ids)).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def fixture_reference(tmp_path_factory):
    made = {}

    def get(path):
        if path not in made:
            made[path] = qwen3_reference(path, tmp_path_factory.mktemp(path.stem))
        return made[path]
    return get


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem.split("-")[-1])
def test_llama_cpp_quantized_files_match_transformers_on_their_dequantized_tensors(path, fixture_reference):
    model_dir = resolve_model(path)
    ids = Tokenizer(model_dir).encode(PROMPT)
    model, _ = load_fp32(model_dir)
    ours = model.forward(torch.tensor(ids), model.new_cache(len(ids)))
    assert (ours - hf_logits(fixture_reference(path), ids)).abs().max().item() <= 1e-4


@pytest.mark.native
@pytest.mark.parametrize("kind, fmt, tolerance", [("IQ4_NL", "int4", 0.0), ("Q4_K_pure", "int4_asym", 1e-3)])
def test_iq4_nl_imports_exactly_and_q4_k_within_fp16_rounding(kind, fmt, tolerance, fixture_reference):
    import tandem_native as tn

    path = next(p for p in FIXTURES if p.stem.endswith(kind))
    ckpt = Checkpoint(resolve_model(path))
    cfg = parse_model_config(ckpt.config)
    ref = load_file(fixture_reference(path) / "model.safetensors")
    layer = tn.MoeLayer(pack_layer(ckpt, cfg, 0, fmt, 64, tn.ThreadPool(1)))
    assert layer.group_size == 32
    for e in range(cfg.moe.num_experts):
        gate, up, down = (ref[n].numpy() for n in cfg.expert_tensor_names(0, e))
        for got, want in ((tn.dequantize(layer, e, "w13"), np.concatenate((gate, up))), (tn.dequantize(layer, e, "w2"), down)):
            assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)
