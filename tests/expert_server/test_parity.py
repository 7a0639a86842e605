"""Generation through expert-server processes gives exactly the native backend's tokens."""

import pytest

from services.dense.generate import generate
from services.dense.loader import open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tests.checkpoints import FAMILY_CHECKPOINTS, checkpoint
from tests.conftest import PROMPT, load_fp32
from tests.expert_server.servers import Spawned, in_process

pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native, pytest.mark.e2e]

# each family gets a format, so every format meets every kind of model once or more
FORMAT_OF = {name: ("bf16", "int8", "int4")[i % 3] for i, name in enumerate(FAMILY_CHECKPOINTS)}
PARAMS = SamplingParams(temperature=0, max_tokens=24)


def split_ranges(cfg) -> tuple[str, str]:
    """Two layer ranges with at least one MoE layer each."""
    first = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    return f"0-{first}", f"{first + 1}-{cfg.num_layers - 1}"


def native_tokens(path, fmt, prompt_ids):
    from services.dense.moe.native import NativeExperts

    checkpoint, cfg = open_checkpoint(path)
    model, experts = load_fp32(path, NativeExperts(cfg, checkpoint, fmt, threads=2))
    return generate(model, prompt_ids, PARAMS, Tokenizer(path).eos_token_ids).tokens


def remote_tokens(path, addresses, transport, prompt_ids, grpc_client="auto"):
    _, cfg = open_checkpoint(path)
    remote = RemoteExperts(cfg, RemoteConfig(addresses=tuple(addresses), transport=transport, grpc_client=grpc_client))
    try:
        model, _ = load_fp32(path, remote)
        return generate(model, prompt_ids, PARAMS, Tokenizer(path).eos_token_ids).tokens
    finally:
        remote.close()


def test_two_server_processes_splitting_the_layers_match_native_over_both_transports(family_checkpoint, prompt_ids):
    name, path = family_checkpoint
    check_split_servers(path, FORMAT_OF[name], prompt_ids)


@pytest.mark.parametrize("name", ["glm4_moe", "minimax_m2"])
def test_the_newer_families_in_bf16_through_split_servers(name):
    path = checkpoint(name)
    check_split_servers(path, "bf16", prompt_of(path))


def check_split_servers(path, fmt, prompt_ids):
    expected = native_tokens(path, fmt, prompt_ids)
    _, cfg = open_checkpoint(path)
    low, high = split_ranges(cfg)
    with Spawned(path, fmt, low) as a, Spawned(path, fmt, high) as b:
        for transport in ("shm", "grpc"):
            assert remote_tokens(path, [a.address, b.address], transport, prompt_ids) == expected, transport


def prompt_of(path):
    return Tokenizer(path).encode(PROMPT)


@pytest.mark.parametrize("transport, grpc_client", [("shm", "auto"), ("grpc", "auto"), ("grpc", "grpcio"),
                                                    ("auto", "auto")])
def test_one_in_process_server_matches_native(transport, grpc_client):
    path = checkpoint("deepseek_v3")
    prompt_ids = prompt_of(path)
    expected = native_tokens(path, "int4", prompt_ids)
    with in_process(path, "int4") as server:
        assert remote_tokens(path, [f"127.0.0.1:{server.port}"], transport, prompt_ids, grpc_client) == expected


def test_bfloat16_dense_path_matches_native_in_bfloat16_over_both_transports():
    from services.dense.loader import load_model
    from services.dense.moe.native import NativeExperts
    from services.dense.runtime import DenseRuntime

    path = checkpoint("qwen3_moe")
    prompt_ids = prompt_of(path)
    ckpt, cfg = open_checkpoint(path)
    runtime = DenseRuntime(dtype="bfloat16", device="cpu")
    eos = Tokenizer(path).eos_token_ids
    native, _ = load_model(path, runtime, NativeExperts(cfg, ckpt, "int8", threads=2))
    expected = generate(native, prompt_ids, PARAMS, eos).tokens
    with in_process(path, "int8") as server:
        for transport, client in (("shm", "auto"), ("grpc", "auto"), ("grpc", "grpcio")):
            remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"127.0.0.1:{server.port}",), transport=transport,
                                                     grpc_client=client))
            model, _ = load_model(path, runtime, remote)
            assert generate(model, prompt_ids, PARAMS, eos).tokens == expected, (transport, client)
            remote.close()
