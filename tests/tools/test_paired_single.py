"""The paired single-stream benchmark's arithmetic (benchmarks/anchors/paired_single.py): the ratio
is the median of per-pair ratios over the clean pairs, void pairs are left out and counted, and
a run with no clean pair states no ratio. None needs llama.cpp."""

from __future__ import annotations

import statistics

from benchmarks.anchors.paired_single import SPECMESH, bootstrap_median, decode_rate, report, summarize_pairs

OTHER = "llama.cpp Q4_K_M"


def _pair(ours: float, theirs: float, foreign_ours: float = 0.01, foreign_theirs: float = 0.01) -> dict:
    return {SPECMESH: ours, OTHER: theirs, "foreign": {SPECMESH: foreign_ours, OTHER: foreign_theirs}}


def test_the_ratio_is_the_median_of_the_pairs_and_void_pairs_are_left_out():
    # Drift: the machine slows between pairs, both systems alike; specmesh is 1.2x in every pair.
    pairs = [_pair(1.2 * s, s) for s in (80.0, 70.0, 60.0, 50.0, 40.0)]
    pairs.append(_pair(10.0, 80.0, foreign_theirs=0.30))  # beside a hog: void, whatever it measured
    summary = summarize_pairs(pairs, OTHER)
    assert summary["pairs"] == 6 and summary["void"] == 1
    assert abs(summary["ratio"] - 1.2) < 1e-9
    low, high = summary["ratio_90"]
    assert abs(low - 1.2) < 1e-9 and abs(high - 1.2) < 1e-9
    assert summary[SPECMESH] == 72.0 and summary[OTHER] == 60.0  # medians over the clean pairs
    text = report(summary, "header")
    assert "1.20x [1.20, 1.20]" in text and "5 clean pairs of 6 (1 void" in text


def test_no_clean_pair_no_ratio():
    summary = summarize_pairs([_pair(70.0, 60.0, foreign_ours=0.2)], OTHER)
    assert summary["ratio"] is None and summary["void"] == 1
    assert "void" in report(summary, "header")


def test_the_bootstrap_interval_brackets_the_median():
    values = [0.8, 0.9, 1.0, 1.05, 1.1, 1.2, 1.3]
    low, high = bootstrap_median(values)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)
    assert low < high


def test_the_decode_rate_counts_tokens_after_the_first():
    assert decode_rate(65, 0.5, 1.5) == 64.0
