"""Reasoning between <think> and </think> (Qwen3, DeepSeek-R1, GLM-4.5, Kimi-K2-Thinking): split from
the answer. DeepSeek-R1's template opens the tag in the prompt, so its output may start inside the
reasoning with no opening tag; a prompt ending in an open <think> says so.
"""

from __future__ import annotations

from gateway.parsing.base import held_back

OPEN, CLOSE = "<think>", "</think>"


def starts_inside(prompt: str) -> bool:
    """Whether the rendered prompt leaves the model inside a reasoning section."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN) or (tail.rfind(OPEN) > tail.rfind(CLOSE))


def split(text: str, final: bool, inside: bool) -> tuple[str, str, bool]:
    """(reasoning released so far, the answer's text so far, whether the reasoning has ended)."""
    stripped = text.lstrip()
    if not inside:
        if stripped.startswith(OPEN):
            stripped, inside = stripped[len(OPEN):], True
        elif not final and OPEN.startswith(stripped):
            return "", "", False  # may still become <think>
        else:
            return "", text, True
    end = stripped.find(CLOSE)
    if end >= 0:
        return stripped[:end].strip(), stripped[end + len(CLOSE):], True
    if final:
        return stripped.strip(), "", True
    return stripped[:len(stripped) - held_back(stripped, (CLOSE,))].strip(), "", False
