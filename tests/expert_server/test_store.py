"""A converted store maps back bit-identical to packing at load, and refuses what does not match."""

import pytest
import torch

from expert_server import store
from services.common.checkpoint import Checkpoint
from services.common.errors import CheckpointError, ConfigError
from services.common.expert_weights import pack_layer
from services.dense.loader import open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from tests.checkpoints import checkpoint
from tests.expert_server.servers import in_process

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    import tandem_native

    path = checkpoint("qwen2_moe")
    ckpt, cfg = open_checkpoint(path)
    pool = tandem_native.ThreadPool(2)
    out = tmp_path_factory.mktemp("store") / "experts-int4.tandem"
    layers = store.moe_layers(cfg, None)
    store.convert(ckpt, cfg, layers, "int4", 32, pool, out)
    return path, ckpt, cfg, layers, out, pool


def test_store_layers_are_bit_identical_to_packing_at_load(converted):
    path, ckpt, cfg, layers, out, pool = converted
    mapped = store.open_store(out, ckpt, cfg, layers, "int4")
    assert sorted(mapped.layers) == layers
    header, data_start = store.read_header(mapped.keep, out)
    for entry in header["layers"]:
        fresh = pack_layer(ckpt, cfg, entry["layer"], "int4", 32, pool)
        start = data_start + entry["offset"]
        assert entry["nbytes"] == fresh.nbytes
        assert mapped.keep[start:start + fresh.nbytes] == fresh.tobytes()
    assert mapped.nbytes == sum(layer.nbytes for layer in mapped.layers.values())


def test_a_server_from_the_store_answers_like_one_packing_at_load(converted):
    path, ckpt, cfg, layers, out, _ = converted
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.moe.num_experts, generator=g)[:cfg.moe.top_k] for _ in range(5)])
    w = torch.rand(5, cfg.moe.top_k, generator=g)
    results = []
    for kw in ({}, {"store": out}):
        with in_process(path, "int4", **kw) as server:
            remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"127.0.0.1:{server.port}",), transport="shm"))
            results.append([remote.forward(layer, x, ids, w) for layer in layers])
            remote.close()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_store_from_another_checkpoint_is_refused(converted):
    *_, out, _ = converted
    other = Checkpoint(checkpoint("qwen3_moe"))
    _, cfg = open_checkpoint(other.dir)
    with pytest.raises(CheckpointError, match="different checkpoint"):
        store.open_store(out, other, cfg, store.moe_layers(cfg, None), "int4")


def test_store_format_and_layers_must_match(converted):
    path, ckpt, cfg, layers, out, _ = converted
    with pytest.raises(ConfigError, match="holds int4"):
        store.open_store(out, ckpt, cfg, layers, "int8")
    with pytest.raises(ConfigError, match="lacks layers"):
        store.open_store(out, ckpt, cfg, layers + [7], "int4")


@pytest.mark.parametrize("damage", ["truncate", "magic", "header"])
def test_damaged_store_is_a_checkpoint_error(converted, tmp_path, damage):
    path, ckpt, cfg, layers, out, _ = converted
    data = bytearray(out.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[:8] = b"NOTSTORE"
    else:
        data[16:20] = b"\xff\xfe{{"
    bad = tmp_path / "bad.tandem"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        store.open_store(bad, ckpt, cfg, layers, "int4")


@pytest.mark.parametrize("kind, fmt", [("fp8", "int4"), ("fp8_ue8m0", "int8"), ("int4", "int4")])
def test_quantized_checkpoints_convert_to_the_layers_packing_at_load_gives(kind, fmt, tmp_path):
    """FP8 and compressed-tensors INT4 sources through `convert`; the imported int4 keeps the
    checkpoint's uniform levels and group."""
    import tandem_native

    from tests.quantized import quantized

    ckpt, cfg = open_checkpoint(quantized(kind))
    pool = tandem_native.ThreadPool(2)
    layers = store.moe_layers(cfg, None)
    report = store.convert(ckpt, cfg, layers, fmt, 64, pool, tmp_path / "s.tandem")
    assert report.read_bytes == store.source_bytes(ckpt, cfg, layers) and report.peak_rss > 0
    assert (report.errors == {}) == (kind == "int4")  # imported as stored, or quantized again
    assert all(0 < e < (0.02 if fmt == "int8" else 0.15) for e in report.errors.values()), report.errors
    mapped = store.open_store(tmp_path / "s.tandem", ckpt, cfg, layers, fmt, 64)
    for layer in layers:
        fresh = tandem_native.MoeLayer(pack_layer(ckpt, cfg, layer, fmt, 64, pool))
        got = mapped.layers[layer]
        assert (got.group_size, got.levels) == (fresh.group_size, fresh.levels)
        assert (got.group_size == 32 and got.levels == list(range(-8, 8))) == (kind == "int4")
        for e in range(cfg.moe.num_experts):
            assert (tandem_native.dequantize(got, e, "w13") == tandem_native.dequantize(fresh, e, "w13")).all()
