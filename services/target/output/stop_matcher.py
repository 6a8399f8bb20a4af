"""Stop-sequence matching whose time per token does not grow with the number of stop
sequences: one Aho–Corasick automaton per request (pyahocorasick, a maintained C
implementation) scans only the newly decoded text plus the last `longest - 1`
characters before it (where a stop sequence ending in the new text may begin).

pyahocorasick's resumable search (`iter(...).set(text, False)`) crashes the process
(a use-after-free; reproduced with astral-plane characters), so each call scans a
fresh window instead: O(longest + new text) per token, whatever the number of stops.

The first stop sequence to *end* in the text wins (ties: the longest, i.e. the one that
starts first): generation would have ended there had tokens arrived one character at a
time.
"""

from __future__ import annotations

import ahocorasick


class StopMatcher:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self._automaton = ahocorasick.Automaton()
        for s in stop:
            self._automaton.add_word(s, len(s))
        self._automaton.make_automaton()
        self.longest = max(map(len, stop))
        self._tail = ""  # the last longest - 1 characters fed
        self._fed = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Appends `text` to the stream; returns the start index (in the whole stream) of the
        first stop sequence that ends in it, or None."""
        window = self._tail + text
        offset = self._fed - len(self._tail)  # stream index of window[0]
        best_end, best_len = None, 0
        for end, length in self._automaton.iter(window):
            if end < len(self._tail):
                continue  # ended before the new text: already reported (or not a match then)
            if best_end is not None and end != best_end:
                break  # matches come in end order; only ties at the first end matter
            best_end, best_len = end, max(best_len, length)
        self._fed += len(text)
        self._tail = window[-(self.longest - 1):] if self.longest > 1 else ""
        return None if best_end is None else offset + best_end - best_len + 1
