"""Per-token cost of stop-sequence matching against the number of stop sequences.

Feeds 2,000 pieces of 4 characters (about one token each) through the StopMatcher the
detokenizer uses and through the former scan (`str.find` per stop sequence per token),
side by side in one run, and prints microseconds per token.

    python benchmarks/stop_matching.py
"""

from __future__ import annotations

import time

from services.target.output.stop_matcher import StopMatcher

PIECES = ["abcd"] * 2000  # never matches: the worst case for both


def automaton_us_per_token(stops: tuple[str, ...]) -> float:
    matcher = StopMatcher(stops)
    start = time.perf_counter()
    for piece in PIECES:
        matcher.feed(piece)
    return (time.perf_counter() - start) / len(PIECES) * 1e6


def scan_us_per_token(stops: tuple[str, ...]) -> float:
    text, emitted = "", 0
    start = time.perf_counter()
    for piece in PIECES:
        text += piece
        for stop in stops:  # the detokenizer before the Aho-Corasick matcher
            text.find(stop, max(0, emitted - len(stop)))
        emitted = len(text)
    return (time.perf_counter() - start) / len(PIECES) * 1e6


def main() -> None:
    print(f"{'stops':>8} {'automaton us/token':>20} {'scan us/token':>15}")
    for n in (1, 16, 1_000, 100_000):
        stops = tuple(f"stop-{i:06d}" for i in range(n))
        scan = scan_us_per_token(stops) if n <= 1_000 else float("nan")
        print(f"{n:>8} {automaton_us_per_token(stops):>20.2f} {scan:>15.2f}")


if __name__ == "__main__":
    main()
