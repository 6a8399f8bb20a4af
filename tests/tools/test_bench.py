"""`specmesh bench`: exact percentiles, reproducible Poisson schedules, and a run against a
tiny-model mesh that accounts for every request and writes the report and plots."""

from __future__ import annotations

import json
import math

import pytest

from services.bench.cli import BenchConfig, compare, run_bench
from services.bench.report import ALL, Slo, percentile, summarize
from services.bench.schedule import poisson_schedule
from tests.mesh import TOKEN_A, start_mesh


def test_percentiles_are_exact_on_a_known_list():
    values = [float(v) for v in range(101)]  # 0..100, shuffled order must not matter
    values = values[::2] + values[1::2]
    assert [percentile(values, p) for p in (0, 50, 95, 99, 100)] == [0.0, 50.0, 95.0, 99.0, 100.0]
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([], 99) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_per_bucket_counts_errors_goodput_and_speculation():
    def record(bucket, ttft, status="OK", **usage):
        return {"bucket": bucket, "status": status, "ttft_s": ttft, "tpot_s": 0.01,
                "e2e_s": None if ttft is None else ttft + 1,
                "verify_passes": usage.get("passes", 0), "accepted_tokens": usage.get("accepted", 0),
                "proposed_tokens": usage.get("proposed", 0), "rejected_tokens": usage.get("rejected", 0),
                "fallback_steps": usage.get("fallbacks", 0), "completion_tokens": 10}
    records = [record("a", t / 100) for t in range(101)]
    records += [record("b", 0.5, passes=4, accepted=6, proposed=10, rejected=4, fallbacks=2),
                record("b", None, status="DEADLINE_EXCEEDED")]
    summary = summarize(records, duration_s=10.0, slo=Slo(ttft_s=0.5))
    a, b = summary["a"], summary["b"]
    assert a["count"] == 101 and a["errors"] == 0
    assert (a["ttft_s"]["p50"], a["ttft_s"]["p95"], a["ttft_s"]["p99"]) == (0.5, 0.95, 0.99)
    assert a["goodput_fraction"] == 51 / 101 and a["goodput_rps"] == 5.1
    assert (b["count"], b["errors"], b["rejected_tokens"], b["fallback_steps"]) == (2, 1, 4, 2)
    assert b["acceptance_length"] == (6 + 4) / 4
    assert summary[ALL]["count"] == 103


def test_same_seed_same_schedule():
    first = poisson_schedule(5.0, seed=7, num_items=3, num_requests=50)
    assert first == poisson_schedule(5.0, seed=7, num_items=3, num_requests=50)
    assert first != poisson_schedule(5.0, seed=8, num_items=3, num_requests=50)
    assert [a.index for a in first] == list(range(50))
    assert all(b.at_s > a.at_s for a, b in zip(first, first[1:]))
    timed = poisson_schedule(5.0, seed=7, num_items=3, duration_s=2.0)
    assert timed == [a for a in first if a.at_s <= 2.0]


async def test_bench_against_a_tiny_mesh_reports_every_request(tiny_llama_dir, tmp_path):
    workload = tmp_path / "workload.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in [
        {"bucket": "summarize", "prompt": "Summarize: the cat sat on the mat. The cat sat.", "max_tokens": 6},
        {"bucket": "creative", "prompt": "Write a poem", "max_tokens": 5, "temperature": 1.0, "seed": 3},
    ]) + "\n")
    mesh = await start_mesh(tiny_llama_dir)
    try:
        reports = []
        for run in ("a", "b"):
            config = BenchConfig(address=mesh.router.address, workload=str(workload), qps=(50.0, 100.0),
                                 num_requests=6, seed=11, slo=Slo(ttft_s=30.0), token=TOKEN_A,
                                 out=str(tmp_path / run))
            await run_bench(config)  # through specmesh.client, one attempt a request
            reports.append(json.loads((tmp_path / run / "report.json").read_text()))
    finally:
        await mesh.stop()
    for report in reports:
        for run in report["runs"]:
            schedule = poisson_schedule(run["qps"], 11, 2, num_requests=6)
            assert [r["index"] for r in run["requests"]] == list(range(6))  # every request sent is here
            assert [r["item"] for r in run["requests"]] == [a.item for a in schedule]
            assert run["arrivals_s"] == [a.at_s for a in schedule]
            assert all(r["status"] == "OK" and r["completion_tokens"] > 0 for r in run["requests"])
            assert sum(s["count"] for k, s in run["summary"].items() if k != ALL) == 6
        assert "token" not in report["config"]
    assert [r["arrivals_s"] for r in reports[0]["runs"]] == [r["arrivals_s"] for r in reports[1]["runs"]]
    for name in ("report.md", "cdf_qps50.png", "cdf_qps100.png", "p99_vs_qps.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0, name
    assert "| summarize |" in (tmp_path / "a" / "report.md").read_text()
    text = compare(tmp_path / "a", tmp_path / "b" / "report.json", tmp_path / "cmp")
    assert "| summarize | ttft |" in text and (tmp_path / "cmp" / "compare.png").stat().st_size > 0


def test_the_multi_turn_schedule_is_seeded_and_thinks_only_between_turns():
    from benchmarks.kv_host_tier import arrival_schedule
    starts, pauses = arrival_schedule([3, 2], rate=2.0, think=10.0, seed=1)
    assert (starts, pauses) == arrival_schedule([3, 2], rate=2.0, think=10.0, seed=1)  # both sides replay it
    assert starts[0] < starts[1] and [len(p) for p in pauses] == [3, 2]
    assert all(conv[0] == 0.0 for conv in pauses) and all(p > 0 for conv in pauses for p in conv[1:])
    assert arrival_schedule([3, 2], rate=2.0, think=0.0, seed=1) == (starts, [[0.0] * 3, [0.0] * 2])
    assert arrival_schedule([3, 2], rate=math.inf, think=0.0)[0] == [0.0, 0.0]  # the calibration: all at once


def test_the_multi_turn_benchmark_runs_both_sides_at_a_calibrated_rate(tiny_gemma_dir, capsys):
    """`kv_host_tier --rate auto` on a tiny model: the calibration serves every conversation at once on
    a started engine with the tier (it once waited forever on one never started), then both sides run
    at the share of that capacity asked for."""
    import argparse
    import threading

    from benchmarks.kv_host_tier import measure
    from services.bench.foreign_cpu import ForeignCpu
    args = argparse.Namespace(model=str(tiny_gemma_dir), prefix_tokens=64, block_size=16, conversations=3, turns=2,
                              max_tokens=3, system_facts=3, rate="auto", load=0.6, think=0.0, dtype="float32",
                              skip_costs=True, skip_multi_turn=False, shared_url="", without_first=False)
    errors = []

    def benchmark(cpu):
        try:
            measure(args, cpu)
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)
    with ForeignCpu() as cpu:
        worker = threading.Thread(target=benchmark, args=(cpu,), daemon=True)
        worker.start()
        worker.join(timeout=300)
    assert not worker.is_alive(), "the multi-turn benchmark did not finish"
    assert not errors, errors
    out = capsys.readouterr().out
    assert "calibrated rate" in out and isinstance(args.rate, float) and args.rate > 0
    assert "arriving at once" in out and "60% of it" in out
    assert "TTFT without / with the host tier" in out and "of 6 turns" in out
