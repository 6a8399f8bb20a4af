"""benchmarks/memory_roofline.py: a streaming read's bandwidth beside each system's bytes a token x tok/s."""

from __future__ import annotations

import json
import sys

from benchmarks import memory_roofline


def test_each_system_gets_its_bytes_a_token_and_a_share_of_the_read(tmp_path, monkeypatch, capsys):
    models = tmp_path / "llamacpp" / "models"
    models.mkdir(parents=True)
    (models / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"\0" * 1000)
    result = tmp_path / "compare-x.json"
    result.write_text(json.dumps({"args": {"specmesh_weights": "gguf"}, "result": {"single": {
        "vLLM": 50.0, "specmesh": 60.0, "llama.cpp Q4_K_M": 70.0, "llama.cpp BF16": None, "_all": {}}}}))
    monkeypatch.setattr(memory_roofline, "stream_bandwidth", lambda gb, repeats: [10e9, 20e9, 30e9])
    monkeypatch.setattr(sys, "argv", ["memory_roofline", str(result), "--llamacpp-dir", str(tmp_path / "llamacpp")])
    memory_roofline.main()
    out = capsys.readouterr().out
    assert "median 20.0 GB/s (min 10.0, max 30.0" in out
    assert "| compare-x | specmesh (gguf) | 60.0 | 294 | 17.6 | 88% |" in out  # 60 x 294 MB over 20 GB/s
    assert "| compare-x | vLLM | 50.0 | 536 | 26.8 | 134% |" in out
    assert "| compare-x | llama.cpp Q4_K_M | 70.0 | 0 | 0.0 | 0% |" in out  # its file's 1,000 bytes
    assert "llama.cpp BF16" not in out  # no figure: no row


def test_the_streaming_read_measures_each_repeat():
    rates = memory_roofline.stream_bandwidth(0.01, 3)
    assert len(rates) == 3 and all(r > 1e8 for r in rates)


def test_a_run_with_the_argmax_screen_counts_its_int8_copy_not_the_output_layer(tmp_path, monkeypatch, capsys):
    runs = []
    for name, switches in (("screened", {}), ("unscreened", {"SPECMESH_ARGMAX_SCREEN": "0"})):
        path = tmp_path / f"compare-{name}.json"
        path.write_text(json.dumps({"args": {"specmesh_weights": "auto"}, "switches": switches,
                                    "result": {"single": {"specmesh": 50.0}}}))
        runs.append(str(path))
    monkeypatch.setattr(memory_roofline, "stream_bandwidth", lambda gb, repeats: [20e9])
    monkeypatch.setattr(sys, "argv", ["memory_roofline", *runs])
    memory_roofline.main()
    out = capsys.readouterr().out
    assert "| compare-screened | specmesh (auto) | 50.0 | 376 |" in out
    assert "| compare-unscreened | specmesh (auto) | 50.0 | 536 |" in out


def test_a_run_that_recorded_the_served_format_is_counted_by_it(tmp_path, monkeypatch, capsys):
    from benchmarks.anchors.compare import served_weights
    log = tmp_path / "target.log"
    log.write_text("2026-12-07 INFO services.target.model.model_runner: "
                   "linear layers: gguf-bf16 (asked: auto), 73 packed\n")
    assert served_weights(log) == "gguf-bf16"
    path = tmp_path / "compare-auto.json"
    path.write_text(json.dumps({"args": {"specmesh_weights": "auto"}, "switches": {},
                                "result": {"single": {"specmesh": 50.0}, "_weights": served_weights(log)}}))
    monkeypatch.setattr(memory_roofline, "stream_bandwidth", lambda gb, repeats: [20e9])
    monkeypatch.setattr(sys, "argv", ["memory_roofline", str(path)])
    memory_roofline.main()
    assert "| compare-auto | specmesh (gguf-bf16) | 50.0 | 281 |" in capsys.readouterr().out  # not auto's old 376
