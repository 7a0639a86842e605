"""A checkpoint: config.json plus its weights from one source (sources/), read a tensor at a time.

A checkpoint is a directory: config.json and tokenizer files, and the weights as safetensors
(plain, FP8 or compressed-tensors, as config.json's quantization_config says) or as one GGUF model
(a file, or the first of a split). resolve_model() turns `--model FILE.gguf` (a GGUF alone) and
`--model DIR --gguf FILE` into such a directory. Every source yields float tensors under their
Hugging Face names, so the dense path and the expert packing never see how a checkpoint is stored.
Opening reads headers only; shapes are checked on every read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.errors import CheckpointError, ConfigError
from services.common.sources import QuantizedWeight, TensorSource, gguf_in, open_source

GGUF_ROOT = Path(__file__).resolve().parents[2] / ".cache" / "gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return config


class Checkpoint:
    """A validated view of a checkpoint directory; tensors are read lazily by name."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"missing checkpoint directory: {self.dir}")
        self.config = read_config(self.dir)
        self.source: TensorSource = open_source(self.dir, self.config)
        self._names = set(self.source.names())
        self.loaded: list[str] = []  # names read so far, in order: lets tests see what was touched

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def names(self) -> Iterable[str]:
        return self.source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._names:
            raise CheckpointError(f"missing tensor {name!r} in checkpoint {self.dir}")
        return tuple(self.source.shape(name))

    def stored_bytes(self, name: str) -> int:
        """Bytes the tensor takes in the checkpoint's files (scales included)."""
        self.shape(name)
        return self.source.stored_bytes(name)

    def _checked(self, name: str, shape: tuple[int, ...] | None) -> None:
        actual = self.shape(name)
        if shape is not None and actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.dir.name} has shape {list(actual)}, expected {list(shape)}")
        self.loaded.append(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor as floats, checking its shape when one is expected."""
        self._checked(name, shape)
        return self.source.read(name)

    def quantized(self, name: str, shape: tuple[int, ...] | None = None, index: int | None = None) -> QuantizedWeight | None:
        """The tensor's stored codes (of its slice `index`, for stacked experts) when they are a packed
        format's (see sources.base), else None."""
        self._checked(name, shape)
        return self.source.quantized(name, index)

    def fingerprint(self) -> str:
        """A digest of config.json and the stored weights' names, sizes and headers (not the data)."""
        h = hashlib.sha256((self.dir / "config.json").read_bytes())
        self.source.fingerprint(h)
        return h.hexdigest()


def resolve_model(model: Path | None, gguf: Path | None = None) -> Path:
    """The checkpoint directory for `--model X [--gguf FILE]`: X itself when it is a directory and no
    GGUF is named; otherwise a directory of links, .cache/gguf/<digest>/<the GGUF's name>: to the
    GGUF (its split files stay beside it), and to X's config.json and tokenizer files, or, for a
    GGUF alone, config.json and tokenizer files made from its metadata."""
    if gguf is None and model.is_dir():
        alone = not (model / "config.json").is_file() and gguf_in(model)
        if not alone:
            return model
        model, gguf = None, alone  # a directory holding only a GGUF (a volume mounted in a container)
    elif gguf is None:
        model, gguf = None, model
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ConfigError(f"{gguf} is not a .gguf file (nor a checkpoint directory)")
    if model is not None and not (model / "config.json").is_file():
        raise ConfigError(f"--model: {model} has no config.json (a Hugging Face directory is needed next to --gguf)")
    gguf = gguf.resolve()
    key = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}:{model and model.resolve()}".encode())
    out = GGUF_ROOT / key.hexdigest()[:12] / re.sub(r"-\d{5}-of-\d{5}$", "", gguf.stem)  # served under the stem
    if not (out / "config.json").exists():
        _companion(gguf, model, out)
    return out


def _companion(gguf: Path, model: Path | None, out: Path) -> None:
    import os
    import shutil
    import tempfile

    from services.common.sources.gguf_file import GgufFile
    from services.common.sources.gguf_meta import hf_config
    from services.common.sources.gguf_tokenizer import write_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=out.parent))
    try:
        (tmp / gguf.name).symlink_to(gguf)
        if model is not None:
            for name in ("config.json", *TOKENIZER_FILES):
                if (model / name).is_file():
                    (tmp / name).symlink_to((model / name).resolve())
        else:
            g = GgufFile(gguf)
            write_tokenizer(g, tmp)
            config = hf_config(g)
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
