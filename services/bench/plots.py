"""PNG plots of bench reports (matplotlib, the `bench` extra): latency CDFs per bucket,
P99 against QPS, and a side-by-side comparison of two reports."""

from __future__ import annotations

from pathlib import Path

from services.bench.report import ALL, METRICS

_TITLES = {"ttft_s": "time to first token", "tpot_s": "time per output token", "e2e_s": "end to end"}


def plot_run(out_dir: Path, runs: list[dict]) -> list[Path]:
    """cdf_qps<Q>.png per run and p99_vs_qps.png; returns the paths written."""
    plt = _pyplot()
    paths = []
    for run in runs:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, metric in zip(axes, METRICS):
            for bucket in sorted({r["bucket"] for r in run["requests"]}):
                values = sorted(r[metric] * 1000 for r in run["requests"]
                                if r["bucket"] == bucket and r["status"] == "OK" and r[metric] is not None)
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=bucket)
            ax.set_title(f"{_TITLES[metric]} CDF at {run['qps']:g} req/s")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        paths.append(_save(fig, out_dir / f"cdf_qps{run['qps']:g}.png"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    buckets = sorted({b for run in runs for b in run["summary"]})
    for ax, metric in zip(axes, METRICS):
        for bucket in buckets:
            points = [(run["qps"], run["summary"][bucket][metric]["p99"]) for run in runs
                      if bucket in run["summary"] and run["summary"][bucket][metric]["p99"] is not None]
            if points:
                ax.plot([q for q, _ in points], [v * 1000 for _, v in points], marker="o", label=bucket,
                        linewidth=2.5 if bucket == ALL else 1.2)
        ax.set_title(f"P99 {_TITLES[metric]}")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    paths.append(_save(fig, out_dir / "p99_vs_qps.png"))
    return paths


def plot_compare(path: Path, a: dict, b: dict, name_a: str, name_b: str) -> Path:
    """Grouped bars: P99 of each metric per bucket, A beside B (first common QPS)."""
    plt = _pyplot()
    runs_b = {run["qps"]: run for run in b["runs"]}
    run_a = next((r for r in a["runs"] if r["qps"] in runs_b), a["runs"][0])
    run_b = runs_b.get(run_a["qps"], b["runs"][0])
    buckets = [k for k in run_a["summary"] if k in run_b["summary"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = range(len(buckets))
    for ax, metric in zip(axes, METRICS):
        for offset, (run, name) in zip((-0.2, 0.2), ((run_a, name_a), (run_b, name_b))):
            ax.bar([x + offset for x in xs], [(run["summary"][k][metric]["p99"] or 0) * 1000 for k in buckets],
                   width=0.4, label=name)
        ax.set_xticks(list(xs), buckets, rotation=30, ha="right", fontsize="small")
        ax.set_title(f"P99 {_TITLES[metric]} (ms) at {run_a['qps']:g} req/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, path)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("plots need matplotlib: pip install 'specmesh[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
