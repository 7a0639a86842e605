"""The bench checkpoints: random-weight qwen3_moe models in the Hugging Face layout, big enough to
time (the tiny test checkpoints are not), and the packed stores `expert_server convert` makes of them.

- "bench": hidden 2048, 64 experts, top-8, moe_intermediate 768, 6 layers: Qwen3-30B-A3B's expert
  shape, about 3.6 GB of bf16 safetensors and 1 GB packed in int4. End-to-end decode and startup.
- "d7168": hidden 7168 (DeepSeek-V3's), 1 layer of 16 tiny experts: what an echo server needs to
  carry DeepSeek-sized activations in transport benchmarks, at almost no size.
- "mla": a deepseek_v3 with DeepSeek-V3's attention (MLA: 16 heads, q_lora 1536, kv_lora 512, nope
  128, rope 64, v 128) at hidden 2048, 4 layers of 64 experts top-8 (moe_intermediate 768) and one
  shared expert: long-context decode through absorbed MLA, about 2.5 GB of bf16.

config.json comes from transformers' own config class (Qwen3MoeConfig, DeepseekV3Config) save_pretrained; the safetensors are written
here, one shard per layer (bf16, seeded normal(0, 0.02), norm weights ones), with the names and
shapes transformers' save_pretrained would write (its own reverse weight conversion, applied to a
model on the meta device), plus model.safetensors.index.json. The tokenizer is the tiny trained BPE
of tests/checkpoints.py. Each is cached under .cache/bench-models/<name>-<digest of the recipe>/;
an unchanged recipe reuses it. A built checkpoint is checked against our own loader before use.

    python -m bench.checkpoint [--name bench|d7168|all] [--store int4] [--check]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CACHE_ROOT = REPO / ".cache" / "bench-models"
SEED = 20240611
STD = 0.02
WRITER_VERSION = 1  # bump when the way tensors are written changes

_COMMON = dict(
    intermediate_size=6144,  # dense-MLP layers only: there are none (mlp_only_layers is empty)
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# name -> Qwen3MoeConfig keyword arguments (vocab_size and the token ids come from the tokenizer)
RECIPES: dict[str, dict] = {
    "bench": {
        **_COMMON, "hidden_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "d7168": {
        **_COMMON, "hidden_size": 7168, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 8,
        "moe_intermediate_size": 64, "intermediate_size": 128,
    },
    "mla": {
        "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "intermediate_size": 6144,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 2, "attention_bias": False, "num_mtp_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # what llama.cpp's converter reads to route as DeepSeek-V3 does (else it routes with softmax)
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    },
}
# name -> family for the recipes that are not qwen3_moe; family -> transformers' config and model classes
FAMILY = {"mla": "deepseek_v3"}
CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
# A shrunk copy of each family's recipe, saved with transformers' own save_pretrained to compare names against.
_NAMING_PROBE = {
    "qwen3_moe": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "intermediate_size": 128},
    "deepseek_v3": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "intermediate_size": 128},
}  # fmt: skip


def family(name: str) -> str:
    return FAMILY.get(name, "qwen3_moe")


def _class(name: str, which: int):
    import transformers

    return getattr(transformers, CLASSES[family(name)][which])


def progress(what: str) -> None:
    print(f"[bench.checkpoint] {what}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the recipe and its cache key


@functools.lru_cache(maxsize=None)
def tokenizer_files() -> dict[str, bytes]:
    """The tiny trained BPE tokenizer of tests/checkpoints.py, as file name -> bytes (trained in a
    moment; its bytes go into the digest, so a changed tokenizer recipe makes new checkpoints)."""
    from tests import checkpoints as tiny

    with tempfile.TemporaryDirectory() as tmp:
        tiny._write_tokenizer(Path(tmp))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


def config_kwargs(name: str) -> dict:
    from tests import checkpoints as tiny

    return {**RECIPES[name], "vocab_size": tiny.VOCAB}


def digest(name: str) -> str:
    import transformers

    h = hashlib.sha256(json.dumps([config_kwargs(name), SEED, STD, WRITER_VERSION, transformers.__version__],
                                  sort_keys=True).encode())
    for file, data in tokenizer_files().items():
        h.update(file.encode() + data)
    return h.hexdigest()[:12]


def checkpoint(name: str) -> Path:
    """Path of the cached bench checkpoint `name`, built (and checked) on first use."""
    path = CACHE_ROOT / f"{name}-{digest(name)}"
    if not (path / "config.json").exists():
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE_ROOT))
        try:
            t0 = time.perf_counter()
            build(name, tmp)
            check(tmp, name)
            os.replace(tmp, path)
            progress(f"built {path} in {time.perf_counter() - t0:.0f} s")
        except OSError:
            if not (path / "config.json").exists():  # not another process that built it first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def bench_checkpoint() -> Path:
    """The 6-layer, 64-expert, hidden-2048 checkpoint (built on first use)."""
    return checkpoint("bench")


def mla_checkpoint() -> Path:
    """The 4-layer deepseek_v3 with DeepSeek-V3's attention shape (built on first use)."""
    return checkpoint("mla")


def echo_checkpoint() -> Path:
    """The 1-layer, hidden-7168 checkpoint for echo servers (built on first use)."""
    return checkpoint("d7168")


# ------------------------------------------------------------------ writing


def hf_config(name: str, kwargs: dict):
    return _class(name, 0)(**kwargs, architectures=[CLASSES[family(name)][1]], dtype="bfloat16")


def saved_layout(name: str, config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as transformers' save_pretrained writes this config's model: the model's
    state dict on the meta device (no memory), through the same reverse weight conversion
    save_pretrained applies (transformers 5 holds experts fused; checkpoints name them one by one)."""
    with torch.device("meta"):
        model = _class(name, 1)(config)
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the modules already carry the saved names
        pass
    else:
        state = revert_weight_conversion(model, state)
    return {name: tuple(t.shape) for name, t in state.items()}


def shard_of(name: str) -> int:
    """0 for embeddings, final norm and lm_head; layer L in shard L + 1."""
    parts = name.split(".")
    return int(parts[2]) + 1 if name.startswith("model.layers.") else 0


def fill(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    if len(shape) == 1:  # a bias (none in this recipe)
        return t.zero_()
    return t.normal_(0.0, STD, generator=gen)


def write_safetensors(layout: dict[str, tuple[int, ...]], out: Path) -> None:
    """One shard per layer (plus one for the rest), each seeded on its own, and the index."""
    from safetensors.torch import save_file

    shards: dict[int, list[str]] = {}
    for name in sorted(layout):
        shards.setdefault(shard_of(name), []).append(name)
    n = max(shards) + 1
    weight_map, total = {}, 0
    for i in range(n):
        gen = torch.Generator().manual_seed(SEED * 1000 + i)
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {name: fill(name, layout[name], gen) for name in shards.get(i, [])}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        progress(f"{out.name}: wrote {file} ({sum(t.nbytes for t in tensors.values()) / 2**20:.0f} MiB)")
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build(name: str, out: Path) -> None:
    config = hf_config(name, config_kwargs(name))
    config.save_pretrained(out)
    write_safetensors(saved_layout(name, config), out)
    for file, data in tokenizer_files().items():
        (out / file).write_bytes(data)


# ------------------------------------------------------------------ checks against our own code


def check(path: Path, name: str) -> dict:
    """Opens the checkpoint with our loader and checks that our code finds every tensor under the
    names it expects: each routed expert's (gate, up, down) by model_config.expert_tensor_names,
    everything else by building the dense model as load_model does; nothing left over. Then checks
    that the names written here are the ones transformers' save_pretrained writes, on a shrunk copy
    of the recipe."""
    from services.common.errors import CheckpointError
    from services.dense.loader import open_checkpoint
    from services.dense.models.decoder import MoeDecoder
    from services.dense.moe.experts import ExpertBackend
    from services.dense.runtime import DenseRuntime
    from services.dense.tokenizer import Tokenizer
    from services.dense.weights import WeightLoader

    class NoExperts(ExpertBackend):  # the routed experts are never read by the dense side
        def submit(self, layer, x, ids, weights):
            raise NotImplementedError

        def wait(self, handle):
            raise NotImplementedError

    ckpt, cfg = open_checkpoint(path)
    if not all(cfg.is_moe(i) for i in range(cfg.num_layers)):
        raise CheckpointError(f"{path}: every layer of a bench checkpoint should be MoE")
    d, inter = cfg.hidden_size, cfg.moe.intermediate_size
    routed = set()
    for layer in range(cfg.num_layers):
        for e in range(cfg.moe.num_experts):
            gate, up, down = cfg.expert_tensor_names(layer, e)
            for tensor, shape in ((gate, (inter, d)), (up, (inter, d)), (down, (d, inter))):
                if ckpt.shape(tensor) != shape:
                    raise CheckpointError(f"{path}: {tensor} has shape {ckpt.shape(tensor)}, expected {shape}")
                routed.add(tensor)
    runtime = DenseRuntime(dtype="bfloat16", device="cpu")
    MoeDecoder(cfg, WeightLoader(ckpt, runtime.torch_dtype, runtime.torch_device), NoExperts())
    dense = set(ckpt.loaded)  # what the dense model read, by name
    stray = set(ckpt.names()) - routed - dense
    if stray:
        raise CheckpointError(f"{path}: tensors our code never reads: {sorted(stray)[:5]}")
    if routed & dense or not all(cfg.is_routed_expert_tensor(n) for n in routed) or any(
            cfg.is_routed_expert_tensor(n) for n in dense):
        raise CheckpointError(f"{path}: the dense side reads routed experts, or is_routed_expert_tensor disagrees")
    check_naming(name, config_kwargs(name))
    vocab = Tokenizer(path).vocab_size
    if vocab > cfg.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has {vocab} tokens, the model {cfg.vocab_size}")
    return {"tensors": len(list(ckpt.names())), "routed": len(routed), "dense": len(dense), "layers": cfg.num_layers,
            "hidden": d, "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "moe_intermediate": inter}


def check_naming(name: str, kwargs: dict) -> None:
    """transformers' save_pretrained on a shrunk copy of the recipe writes exactly the names (and
    shapes) that saved_layout gives for that copy."""
    from safetensors import safe_open
    from transformers.utils import logging as hf_logging

    from services.common.errors import CheckpointError

    hf_logging.disable_progress_bar()

    config = hf_config(name, {**kwargs, **_NAMING_PROBE[family(name)]})
    ours = saved_layout(name, config)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        _class(name, 1)(config).save_pretrained(tmp)
        theirs = {}
        for file in Path(tmp).glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                theirs.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        raise CheckpointError(f"our safetensors layout differs from transformers' save_pretrained: {diff}")


# ------------------------------------------------------------------ packed stores (`expert_server convert`)


def native_digest() -> str:
    """The tandem_native module file's digest: a store is the native packed layout, so a rebuilt
    module gets a fresh store rather than trusting an old one."""
    spec = importlib.util.find_spec("tandem_native")
    if spec is None or spec.origin is None:
        raise RuntimeError("tandem_native is not built (python setup.py build_ext --inplace)")
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]


def store_path(model_dir: Path, fmt: str, group_size: int = 32) -> Path:
    return CACHE_ROOT / "stores" / f"{model_dir.name}.{fmt}-g{group_size}-{native_digest()}.store"


def packed_store(model_dir: Path, fmt: str, threads: int = 2, group_size: int = 32) -> tuple[Path, float | None]:
    """The store `python -m expert_server convert` writes for this checkpoint and format, made once
    and cached; the seconds the conversion took when it ran now (None when cached)."""
    out = store_path(model_dir, fmt, group_size)
    if out.exists():
        return out, None
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "expert_server", "convert", "--model", str(model_dir), "--format", fmt,
           "--threads", str(threads), "--group-size", str(group_size), "--out", str(out)]  # fmt: skip
    progress(f"converting {model_dir.name} to {fmt}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"expert_server convert failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    took = time.perf_counter() - t0
    for stale in out.parent.glob(f"{model_dir.name}.{fmt}-g{group_size}-*.store"):
        if stale != out:  # made by an older tandem_native: about 1 GB each
            stale.unlink(missing_ok=True)
    return out, took


# ------------------------------------------------------------------ entry point


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="all", help=f"one of {', '.join(RECIPES)} or all (default)")
    p.add_argument("--store", action="append", default=[], help="also convert to a packed store in this format")
    p.add_argument("--check", action="store_true", help="check a cached checkpoint again against our loader")
    a = p.parse_args(argv)
    names = list(RECIPES) if a.name == "all" else [a.name]
    if not set(names) <= set(RECIPES):
        p.error(f"--name: expected one of {', '.join(RECIPES)} or all")
    for name in names:
        path = checkpoint(name)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"{name}: {path} ({size / 2**30:.2f} GiB of safetensors)")
        if a.check:
            print(f"  checked: {check(path, name)}")
        for fmt in a.store:
            store, took = packed_store(path, fmt)
            print(f"  {fmt} store: {store} ({store.stat().st_size / 2**30:.2f} GiB"
                  f"{f', converted in {took:.1f} s' if took else ', cached'})")


if __name__ == "__main__":
    main()
