"""Per-bucket summaries of a bench run: report.json (every request), report.md (tables).

Percentiles interpolate linearly between the closest ranks (numpy's default, Excel's
PERCENTILE.INC): P50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ALL = "(all)"
METRICS = ("ttft_s", "tpot_s", "e2e_s")
PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Slo:
    """A request counts toward goodput when it succeeded within every given bound (seconds)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def met(self, record: dict) -> bool:
        if record["status"] != "OK":
            return False
        for name in METRICS:
            bound = getattr(self, name)
            if bound is not None and (record[name] is None or record[name] > bound):
                return False
        return True


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def summarize(records: list[dict], duration_s: float, slo: Slo) -> dict[str, dict]:
    """{bucket: summary} with an ALL row; `duration_s`: the run's length for rates."""
    buckets: dict[str, list[dict]] = {}
    for record in records:
        buckets.setdefault(record["bucket"], []).append(record)
    out = {bucket: _summary(rs, duration_s, slo) for bucket, rs in sorted(buckets.items())}
    out[ALL] = _summary(records, duration_s, slo)
    return out


def write_report(out_dir: Path, config: dict, runs: list[dict]) -> tuple[Path, Path]:
    """runs: [{"qps", "duration_s", "requests": [record dicts], "summary"}]. Returns the two paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    json_path.write_text(json.dumps({"config": config, "runs": runs}, indent=1))
    md_path.write_text(markdown(config, runs))
    return json_path, md_path


def markdown(config: dict, runs: list[dict]) -> str:
    slo = config.get("slo", {})
    lines = ["# specmesh bench report", "",
             f"Router `{config.get('address')}`, workload `{config.get('workload')}`, seed {config.get('seed')}; "
             f"SLOs: {', '.join(f'{k} ≤ {v * 1000:g} ms' for k, v in slo.items() if v) or 'none'}.", ""]
    for run in runs:
        lines += [f"## {run['qps']:g} requests/s ({len(run['requests'])} requests, {run['duration_s']:.1f} s)", "",
                  "| bucket | count | errors | TTFT P50/P95/P99 ms | TPOT P50/P95/P99 ms | e2e P50/P95/P99 ms "
                  "| accept. length | rejected tok | fallbacks | goodput req/s (%) |",
                  "|---|---:|---:|---|---|---|---:|---:|---:|---|"]
        for bucket, s in run["summary"].items():
            lines.append(f"| {bucket} | {s['count']} | {s['errors']} | {_ms3(s, 'ttft_s')} | {_ms3(s, 'tpot_s')} "
                         f"| {_ms3(s, 'e2e_s')} | {s['acceptance_length']:.2f} | {s['rejected_tokens']} "
                         f"| {s['fallback_steps']} | {s['goodput_rps']:.2f} ({s['goodput_fraction'] * 100:.0f}%) |")
        lines.append("")
    return "\n".join(lines)


def compare_markdown(a: dict, b: dict, name_a: str, name_b: str) -> str:
    """Side by side P50/P99 per bucket of the first run common to both reports' QPS lists."""
    lines = [f"# bench compare: A = `{name_a}`, B = `{name_b}`", ""]
    runs_b = {run["qps"]: run for run in b["runs"]}
    for run_a in a["runs"]:
        run_b = runs_b.get(run_a["qps"])
        if run_b is None:
            continue
        lines += [f"## {run_a['qps']:g} requests/s", "",
                  "| bucket | metric | A P50 | B P50 | A P99 | B P99 | B/A P99 |", "|---|---|---:|---:|---:|---:|---:|"]
        for bucket, sa in run_a["summary"].items():
            sb = run_b["summary"].get(bucket)
            if sb is None:
                continue
            for metric in METRICS:
                pa, pb = sa[metric]["p99"], sb[metric]["p99"]
                ratio = f"{pb / pa:.2f}" if pa and pb else "-"
                lines.append(f"| {bucket} | {metric[:-2]} | {_ms(sa[metric]['p50'])} | {_ms(sb[metric]['p50'])} "
                             f"| {_ms(pa)} | {_ms(pb)} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


# ---- helpers ----------------------------------------------------------------
def _summary(records: list[dict], duration_s: float, slo: Slo) -> dict:
    ok = [r for r in records if r["status"] == "OK"]
    passes = sum(r["verify_passes"] for r in ok)
    good = sum(1 for r in records if slo.met(r))
    summary = {"count": len(records), "errors": len(records) - len(ok),
               "acceptance_length": (sum(r["accepted_tokens"] for r in ok) + passes) / passes if passes else 0.0,
               "proposed_tokens": sum(r["proposed_tokens"] for r in ok),
               "accepted_tokens": sum(r["accepted_tokens"] for r in ok),
               "rejected_tokens": sum(r["rejected_tokens"] for r in ok),
               "fallback_steps": sum(r["fallback_steps"] for r in ok),
               "completion_tokens": sum(r["completion_tokens"] for r in ok),
               "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
               "goodput_fraction": good / len(records) if records else 0.0}
    for metric in METRICS:
        values = [r[metric] for r in ok if r[metric] is not None]
        summary[metric] = {f"p{p}": percentile(values, p) for p in PERCENTILES}
        summary[metric]["mean"] = sum(values) / len(values) if values else None
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _ms3(summary: dict, metric: str) -> str:
    s = summary[metric]
    return " / ".join(_ms(s[f"p{p}"]) for p in PERCENTILES)
