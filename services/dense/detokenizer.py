"""Incremental detokenization with stop strings.

Text is released as tokens arrive, but never half a UTF-8 character (a token that ends inside one
decodes to U+FFFD until the rest arrives) and never a piece that could still become a stop string:
a stop string split across tokens is caught whole, and none of it is emitted.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
PREFIX_TOKENS = 5  # context tokens decoded before the new ones, so merged spaces come out right


class Detokenizer:
    def __init__(self, tokenizer, prompt: list[int], stop: tuple[str, ...] = (), keep_special: bool = False):
        self.tokenizer, self.stop, self.skip_special = tokenizer, stop, not keep_special
        self.ids = list(prompt[-PREFIX_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # all decoded output text (cut at a stop string once one is found)
        self.emitted = 0  # characters of text already released
        self.stopped_by: str | None = None

    def add(self, token: int) -> str:
        """Takes one generated token; returns the text that can be released now (maybe "")."""
        if self.stopped_by is not None:
            return ""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip_special)
        after = self.tokenizer.decode(self.ids[self.prefix:], self.skip_special)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                return self._emit(hit)
            return self._emit(len(self.text) - self._stop_prefix_len())
        return self._emit(len(self.text))

    def _find_stop(self) -> int | None:
        """Where the earliest stop string starts, searching only text not yet released."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best, self.stopped_by = i, s
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of text that is the start of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """At the end of generation (not by a stop string): whatever was held back."""
        if self.stopped_by is not None:
            return ""
        return self._emit(len(self.text))
