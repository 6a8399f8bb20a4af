"""llama.cpp beside vLLM in the side-by-side benchmark (benchmarks/anchors/compare.py): the
report's columns and ratios, llama-server's context size, the check that the setup ran, and
the HTTP clients keeping all 18 batch requests in flight. None needs the llama.cpp build."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks.anchors import compare

BF16, Q4 = "llama.cpp BF16", "llama.cpp Q4_K_M"


def _rows(result: dict) -> dict[str, list[str]]:
    """Row label -> its cells."""
    out = {}
    for line in compare.table(result).splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


def test_the_table_has_a_column_per_llamacpp_system_with_specmesh_over_it():
    values = {"single": {"vLLM": [60.0], "specmesh": [70.0], BF16: [76.4], Q4: [87.5]},
              "cold_ttft": {"vLLM": [0.8], "specmesh": [0.5], BF16: [1.0], Q4: [2.0]}}
    shares = {"single": {"vLLM": [0.01], "specmesh": [0.02], BF16: [0.03], Q4: [0.04]},
              "cold_ttft": {"vLLM": [0.01], "specmesh": [0.02], BF16: [0.03], Q4: [0.04]}}
    rows = _rows(compare.summarize(values, shares))
    header = rows[""]
    assert header[4:6] == [f"{BF16} (specmesh / it)", f"{Q4} (specmesh / it)"]
    assert header[6] == f"foreign CPU (median: vLLM / specmesh / HF / {BF16} / {Q4})"
    single = rows["single-stream decode, tok/s"]
    assert single[4] == "76.4 (0.92x)" and single[5] == "87.5 (0.80x)"  # 70 / 76.4, 70 / 87.5
    assert single[6] == "1.0% / 2.0% / — / 3.0% / 4.0%"
    cold = rows["cold prefill of a ~2,000-token prompt, TTFT s"]
    assert cold[4] == "1.000 (2.00x)" and cold[5] == "2.000 (4.00x)"  # a time: theirs over ours
    assert rows["18 concurrent requests, tok/s in all"][4:6] == ["—", "—"]  # not measured, no ratio


def test_no_ratio_to_a_llamacpp_system_from_void_measurements():
    values = {"single": {"specmesh": [70.0, 71.0], BF16: [76.0, 30.0], Q4: [88.0]}}
    # BF16's second round ran beside a hog (clean median from the first); Q4_K_M's only round did.
    shares = {"single": {"specmesh": [0.01, 0.01], BF16: [0.01, 0.40], Q4: [0.30]}}
    result = compare.summarize(values, shares)
    assert result["single"][BF16] == 76.0 and result["single"]["_void"] == [Q4]
    assert compare.speed_ratio(result["single"], Q4, True) == "void"
    single = _rows(result)["single-stream decode, tok/s"]
    assert single[4] == f"76.0 ({70.5 / 76.0:.2f}x)"
    assert single[5] == "88.0 (void: foreign CPU)"
    # specmesh void: no ratio to anyone (BF16's median is over both its clean rounds now).
    result = compare.summarize(values, {"single": {"specmesh": [0.2, 0.3], BF16: [0.0, 0.0], Q4: [0.0]}})
    assert _rows(result)["single-stream decode, tok/s"][4:6] == [
        "53.0 (void: foreign CPU)", "88.0 (void: foreign CPU)"]


def test_without_llamacpp_the_table_keeps_its_columns():
    header = _rows(compare.summarize({"single": {"vLLM": [60.0], "specmesh": [66.0]}}))[""]
    assert header == ["vLLM", "specmesh (through the mesh)", "per round", "HF `generate`",
                      "foreign CPU (median: vLLM / specmesh / HF)"]


def test_every_slot_of_llama_server_holds_the_longest_prompt_and_its_tokens():
    for longest, tokens in ((2002, 64), (1508, 64), (14, 1), (4000, 256)):
        context = compare.llamacpp_context(longest, tokens)
        per_slot = context // compare.LLAMACPP_PARALLEL
        assert context % compare.LLAMACPP_PARALLEL == 0 and per_slot % 256 == 0
        assert longest + tokens < per_slot <= longest + tokens + 16 + 256


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"skip": [], "model": "default", "llamacpp_dir": "/nonexistent"} | kw))


def test_llamacpp_is_left_out_with_a_reason_until_the_setup_ran(tmp_path, capsys):
    assert compare.use_llamacpp(_args(llamacpp_dir=str(tmp_path))) is None
    out = capsys.readouterr().out
    assert "llama-server is missing" in out and "setup_llamacpp.sh" in out
    server, ggufs = compare.llamacpp_files(tmp_path)
    for path in (server, *ggufs.values()):
        path.parent.mkdir(parents=True, exist_ok=True)
        assert compare.llamacpp_missing(tmp_path) != ""  # until the last file is there
        path.write_bytes(b"x")
    assert compare.llamacpp_missing(tmp_path) == ""
    assert compare.use_llamacpp(_args(llamacpp_dir=str(tmp_path))) == tmp_path
    assert compare.use_llamacpp(_args(llamacpp_dir=str(tmp_path), skip=["llamacpp"])) is None
    assert compare.use_llamacpp(_args(llamacpp_dir=str(tmp_path), model="/some/dir")) is None
    assert "default model" in capsys.readouterr().out


class _Completions(BaseHTTPRequestHandler):
    """A loopback /v1/completions stream in the OpenAI shape llama-server and vLLM send; each
    request waits (up to 10 s) until 18 are in flight, so the peak shows the client's concurrency."""

    lock = threading.Lock()
    in_flight = peak = 0
    all_in = threading.Event()
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with cls.lock:
            cls.bodies.append(body)
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            if cls.in_flight == 18:
                cls.all_in.set()
        cls.all_in.wait(10)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for msg in ({"choices": [{"text": "a"}]},
                    {"choices": [{"text": "b"}], "usage": {"completion_tokens": n,
                                                          "prompt_tokens_details": {"cached_tokens": 3}}}):
            self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        with cls.lock:
            cls.in_flight -= 1

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: 18 connections opened at once overflowed it on a loaded
    # 2-core machine and one was reset (CI, 2026-12-05); llama-server's and vLLM's backlogs are larger.
    request_queue_size = 64


def test_the_http_clients_keep_all_18_batch_requests_in_flight():
    server = _Server(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = compare.LlamaCpp(server.server_address[1], "gemma")
        tok_s = asyncio.run(compare.batch18(client, ["p"] * 9, 64))
    finally:
        server.shutdown()
    assert _Completions.peak == 18  # asyncio's default pool let 6 through on 2 cores
    assert tok_s > 0 and client.cached_tokens == [3] * 18
    body = _Completions.bodies[0]
    assert body["cache_prompt"] is True and body["temperature"] == 0 and body["stream"] is True
    assert sorted(b["max_tokens"] for b in _Completions.bodies) == sorted(64 * (1 + i % 4) // 4 for i in range(18))


FAKE_SERVER = '''#!{python}
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "-nr" not in sys.argv:  # as llama.cpp's weight repacking did on a Xeon with AMX
    os.kill(os.getpid(), signal.SIGSEGV)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
'''


def test_a_llamacpp_server_that_crashes_while_repacking_runs_again_without_it_and_the_report_says_so(
        tmp_path, monkeypatch):
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(compare, "LLAMACPP_PORT", s.getsockname()[1])
    monkeypatch.setattr(compare, "LLAMACPP_NOTES", [])
    server = tmp_path / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(0o755)
    proc = compare.start_llamacpp_ready(Q4, server, tmp_path / "m.gguf", 4096, tmp_path / "log")
    try:
        assert proc.poll() is None and "-nr" in proc.args
        assert compare.LLAMACPP_NOTES == [f"{Q4} crashed while starting with weight repacking and ran with --no-repack"]
    finally:
        compare.stop([proc])
