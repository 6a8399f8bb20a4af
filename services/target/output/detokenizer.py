"""Incremental detokenization with stop sequences, one per request."""

from __future__ import annotations

from services.target.output.special_tokens import control_token_ids
from services.target.output.stop_matcher import StopMatcher

# Tokens decoded again before the newest ones, so that merges across token boundaries
# (leading spaces, multi-byte characters) come out right without decoding everything.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns committed token ids into text pieces as they arrive.

    Text is held back while it may still be (a) an incomplete UTF-8 character or
    (b) the start of a stop sequence, so no stop text ever reaches the client.
    Each call decodes only a few tokens (a sliding window), not the whole output.

    With `skip_special_tokens` (the default) control tokens (services/target/output/
    special_tokens.py) are dropped before decoding: the text is that of the other tokens
    alone, so a control token between the bytes of one character, or inside a stop
    sequence, splits neither. Token ids are not this class's business: they stream as sampled.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._hidden = control_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._min_tokens = min_tokens  # stop sequences ending before this many tokens do not stop
        self._num_tokens = 0  # output tokens added, shown or not
        # The streamed text equals decode(shown output ids), as transformers' streamers produce it.
        self._ids: list[int] = []  # output ids that are shown (all of them when not skipping)
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already in _text
        self._text = ""  # decoded text of all output tokens so far
        self._emitted = 0  # characters of _text already returned
        self._stop = StopMatcher(stop) if stop else None  # time per token independent of len(stop)
        self._holdback = self._stop.longest - 1 if stop else 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Adds committed tokens; returns the new text that is safe to emit."""
        if self.stopped:
            return ""
        self._ids.extend(t for t in token_ids if t not in self._hidden)
        self._num_tokens += len(token_ids)
        new = self._decode_new()
        self._text += new
        index = self._stop.feed(new) if self._stop is not None and new else None
        if index is not None and self._num_tokens >= self._min_tokens:
            self.stopped = True
            return self._take(index)
        return self._take(max(self._emitted, len(self._text) - self._holdback))

    def flush(self) -> str:
        """Returns the held-back text at the end of generation (an incomplete character too)."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):
            self._text += self._decode_new(final=True)
        return self._take(len(self._text))

    def _decode_new(self, final: bool = False) -> str:
        """Text of the tokens after the read offset, decoded with a few tokens of context.

        Returns "" while the tail is an incomplete character, unless `final`.
        """
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        incomplete = after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before)
        if incomplete and not final:
            return ""  # an incomplete multi-byte character: wait for the next token
        delta = after[len(before):]
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _take(self, end: int) -> str:
        piece = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return piece
