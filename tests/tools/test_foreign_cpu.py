"""The benchmark's foreign-CPU monitor sees a CPU hog that is not part of the system under test."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from services.bench.foreign_cpu import ForeignCpu, process_seconds, process_tree

HOG = "import time\nend = time.time() + 30\nwhile time.time() < end: pass\n"


def test_a_hog_beside_the_system_is_foreign_and_voids_the_measurement():
    system = subprocess.Popen(["sleep", "30"])  # the "system under test": idle
    hog = subprocess.Popen([sys.executable, "-c", HOG])  # a CPU hog beside it
    try:
        # Two monitors over the same seconds: one counts the hog as the system's, one not.
        with ForeignCpu(lambda: [system.pid], interval_s=0.5) as beside, \
                ForeignCpu(lambda: [system.pid, hog.pid], interval_s=0.5) as inside:
            start, hog_start = time.monotonic(), process_seconds(hog.pid)
            time.sleep(3.2)
            hog_cpu = (process_seconds(hog.pid) - hog_start) / ((time.monotonic() - start) * os.cpu_count())
    finally:
        hog.kill()
        system.kill()
    assert beside.share()["samples"] >= 4 and hog_cpu > 0.03  # the hog ran (~0.5 on a quiet machine)
    # Everything else on the machine is foreign to both; the hog only to one.
    difference = beside.share()["mean"] - inside.share()["mean"]
    assert abs(difference - hog_cpu) < 0.02 + 0.4 * hog_cpu, (difference, hog_cpu, beside.samples, inside.samples)
    assert beside.share()["void"]
    assert beside.share(start=float("inf"))["samples"] == 0  # a window with no sample


def test_the_process_tree_holds_descendants():
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(process_tree([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(process_tree([parent.pid])) == 2  # sh and its sleep
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()


def test_the_side_by_side_report_states_no_ratio_from_void_measurements():
    from benchmarks.anchors.compare import round_ratios, summarize, table
    values = {"single": {"vLLM": [60.0, 60.0], "specmesh": [66.0, 30.0]},
              "batch18": {"vLLM": [300.0], "specmesh": [330.0]}}
    # Round 2 of single-stream ran beside a hog (40% foreign); batch18 was contaminated throughout.
    shares = {"single": {"vLLM": [0.01, 0.02], "specmesh": [0.01, 0.40]},
              "batch18": {"vLLM": [0.30], "specmesh": [0.30]}}
    result = summarize(values, shares)
    assert round_ratios(result, "single", True) == [1.1]  # the void round is left out
    assert result["single"]["specmesh"] == 66.0 and result["single"]["_void"] == []  # ... of the medians too
    assert result["batch18"]["_void"] == ["specmesh", "vLLM"] and round_ratios(result, "batch18", True) == []
    rows = {line.split(" | ")[0]: line for line in table(result).splitlines()}
    assert "void: foreign CPU" in rows["| 18 concurrent requests, tok/s in all"]
    assert "30.0% / 30.0%" in rows["| 18 concurrent requests, tok/s in all"]
