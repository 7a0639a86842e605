"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library) and its stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from services.common.errors import CheckpointError


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"missing file: {path}")
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception on bad files
            raise CheckpointError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.config = _json(model_dir / "tokenizer_config.json")
        self.chat_template = self._chat_template(model_dir)
        self.eos_token_ids = self._stop_ids(model_dir)

    def _stop_ids(self, model_dir: Path) -> tuple[int, ...]:
        """generation_config.json first (it may list several), then config.json, then the eos token."""
        for name in ("generation_config.json", "config.json"):
            ids = _ids(_json(model_dir / name).get("eos_token_id"))
            if ids:
                return tuple(ids)
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        token_id = self._tok.token_to_id(eos) if eos else None
        return () if token_id is None else (token_id,)

    def _chat_template(self, model_dir: Path) -> str:
        """tokenizer_config.json's chat_template (a string, or the 'default' of a named list), else
        chat_template.jinja; empty when the checkpoint has none."""
        template = self.config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
        path = model_dir / "chat_template.jinja"
        return path.read_text() if path.is_file() else ""

    def special_token(self, name: str) -> str:
        """tokenizer_config.json's bos_token / eos_token as text ("" when absent)."""
        value = self.config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
