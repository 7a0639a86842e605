"""A Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) from a GGUF's tokenizer.ggml.*
metadata: byte-level BPE vocabularies ("gpt2" models) with the pre-tokenizer llama.cpp names in
tokenizer.ggml.pre, special tokens from the token types, and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import CheckpointError
from services.common.sources.gguf_file import GgufFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers as p

    byte_level = p.ByteLevel(add_prefix_space=False, use_regex=False)
    splits = {"llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "qwen2": (_QWEN2,), "deepseek-v3": _DEEPSEEK_V3}
    if pre in ("default", "gpt2", "gpt-2"):
        return p.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return p.Sequence([p.Digits(individual_digits=True), p.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in splits:
        return p.Sequence([*(p.Split(Regex(r), behavior="isolated") for r in splits[pre]), byte_level])
    raise CheckpointError(
        f"GGUF tokenizer.ggml.pre {pre!r} is not known here; give the model's Hugging Face directory for its "
        "tokenizer (--model DIR --gguf FILE)"
    )


def write_tokenizer(g: GgufFile, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the GGUF's vocabulary, into out."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model = g.key("tokenizer.ggml.model", arch=False)
    if model != "gpt2":
        raise CheckpointError(
            f"{g.path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); give the "
            "model's Hugging Face directory for its tokenizer (--model DIR --gguf FILE)"
        )
    tokens = list(g.key("tokenizer.ggml.tokens", arch=False) or [])
    merges = [tuple(m.split(" ", 1)) for m in g.key("tokenizer.ggml.merges", arch=False) or []]
    types = list(g.key("tokenizer.ggml.token_type", arch=False) or [1] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(f"{g.path}: GGUF tokenizer metadata is incomplete (tokens or token types)")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(g.key("tokenizer.ggml.pre", "default", arch=False))
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL])
    tok.save(str(out / "tokenizer.json"))

    def token(key: str):
        i = g.key(f"tokenizer.ggml.{key}_token_id", arch=False)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
              "pad_token": token("padding"), "unk_token": token("unknown"),
              "add_bos_token": bool(g.key("tokenizer.ggml.add_bos_token", False, arch=False)),
              "chat_template": g.key("tokenizer.chat_template", arch=False),
              "model_max_length": g.key("context_length", 4096)}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))
