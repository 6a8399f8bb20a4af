"""Streaming stop-sequence matching whose time per token does not grow with the number
of stop sequences: one Aho–Corasick automaton per request (pyahocorasick, a maintained
C implementation), fed only the newly decoded text and resumed from its last state.

The first stop sequence to *end* in the text wins (ties: the longest, i.e. the one that
starts first): generation would have ended there had tokens arrived one character at a
time.
"""

from __future__ import annotations

import ahocorasick


class StopMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        automaton = ahocorasick.Automaton()
        for s in stop:
            automaton.add_word(s, len(s))
        automaton.make_automaton()
        self._search = automaton.iter("")
        self.longest = max(map(len, stop))

    def feed(self, text: str) -> int | None:
        """Appends `text` to the stream; returns the start index (in the whole stream) of the
        first stop sequence that ends in it, or None."""
        self._search.set(text, False)  # resume from the previous state: positions are cumulative
        best_end, best_len = None, 0
        for end, length in self._search:
            if best_end is not None and end != best_end:
                break  # matches come in end order; only ties at the first end matter
            best_end, best_len = end, max(best_len, length)
        return None if best_end is None else best_end - best_len + 1
