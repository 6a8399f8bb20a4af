"""The side-by-side report (benchmarks/anchors/compare.py): per-round ratios, their band, the plot."""

from __future__ import annotations

import pytest

from benchmarks.anchors import compare


def _result(runs: dict) -> dict:
    return compare.summarize(runs)


RUNS = {
    "single": {"vLLM": [40.0, 50.0, 60.0], "specmesh": [30.0, 50.0, 66.0]},  # 0.75, 1.0, 1.1
    "cold_ttft": {"vLLM": [1.0, 1.2], "specmesh": [2.0, 1.0]},  # a time: lower is faster -> 0.5, 1.2
    "spec5": {"vLLM": [100.0], "specmesh": [130.0]},
}


def test_round_ratios_are_specmesh_speed_over_vllm_speed_round_by_round():
    result = _result(RUNS)
    assert compare.round_ratios(result, "single", True) == pytest.approx([0.75, 1.0, 1.1])
    assert compare.round_ratios(result, "cold_ttft", False) == pytest.approx([0.5, 1.2])
    assert compare.round_ratios(result, "batch18", True) == []  # not measured


def test_table_gives_the_ratio_of_medians_and_the_band_of_rounds():
    lines = compare.table(_result(RUNS)).splitlines()
    single = next(line for line in lines if line.startswith("| single-stream"))
    assert "50.0 (1.00x)" in single and "0.75–1.10x" in single
    cold = next(line for line in lines if line.startswith("| cold prefill"))
    assert "1.500 (0.73x vLLM's speed)" in cold  # medians 1.1 and 1.5 and "0.50–1.20x" in cold
    spec = next(line for line in lines if line.startswith("| speculation depth 5"))
    assert "1.30x" in spec


def test_plot_writes_a_png_of_the_rounds(tmp_path):
    pytest.importorskip("matplotlib")
    path = compare.plot(_result(RUNS), tmp_path / "ratios.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.plot(_result({}), tmp_path / "none.png") is None  # nothing measured, no plot


def test_a_variant_target_is_its_own_column_with_specmesh_over_its_speed():
    """`--variant LABEL:NAME=VALUE` (and `--generic`, one such variant) runs a second specmesh target
    with those settings; the report names it by its label and gives specmesh's speed over its own."""
    assert compare.parse_variant("float32 KV:SPECMESH_KV_DTYPE=float32") == ("float32 KV", {"SPECMESH_KV_DTYPE": "float32"})
    assert compare.parse_variant(compare.GENERIC)[1] == {"SPECMESH_FORWARD": "generic"}
    assert compare.parse_variant("ab:A=1,B=x=y") == ("ab", {"A": "1", "B": "x=y"})
    for bad in ("no-colon", "label:", ":A=1", "label:A"):
        with pytest.raises(ValueError, match="LABEL:NAME=VALUE"):
            compare.parse_variant(bad)
    result = _result({"single": {"vLLM": [40.0], "specmesh": [60.0], "variant": [50.0]},
                      "cold_ttft": {"vLLM": [1.0], "specmesh": [1.0], "variant": [2.0]}})
    result["_variant"] = "float32 KV"
    lines = compare.table(result).splitlines()
    assert lines[0].endswith("specmesh, float32 KV (specmesh / it) |")
    single = next(line for line in lines if line.startswith("| single-stream"))
    assert single.endswith("50.0 (1.20x) |")
    cold = next(line for line in lines if line.startswith("| cold prefill"))
    assert cold.endswith("2.000 (2.00x) |")
    assert "float32 KV" not in compare.table(_result(RUNS))  # no variant measured: no column
