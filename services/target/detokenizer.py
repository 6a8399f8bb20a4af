"""Incremental detokenization with stop sequences, one per request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns committed token ids into text pieces as they arrive.

    Text is held back while it may still be (a) an incomplete UTF-8 character or
    (b) the start of a stop sequence, so no stop text ever reaches the client.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""  # decoded text of all output tokens so far
        self._emitted = 0  # characters of _text already returned
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Adds committed tokens; returns the new text that is safe to emit."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self._text = text
        for stop in self._stop:
            index = self._text.find(stop, max(0, self._emitted - len(stop)))
            if index != -1:
                self.stopped = True
                return self._take(index)
        return self._take(max(self._emitted, len(self._text) - self._holdback))

    def flush(self) -> str:
        """Returns the held-back text at the end of generation."""
        return "" if self.stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        piece = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return piece
