"""`specmesh bench WORKLOAD ...` and `specmesh bench compare A B` (argument parsing and glue).

    specmesh bench workload.jsonl --address 127.0.0.1:50051 --qps 1,2,4 --num-requests 100 \
        --seed 0 --slo-ttft-ms 500 --slo-tpot-ms 100 --out bench-out
    specmesh bench compare bench-a bench-b --out compare-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.bench.report import Slo, compare_markdown, summarize, write_report
from services.bench.runner import run_schedule
from services.bench.schedule import poisson_schedule
from services.bench.workload import WorkloadItem, load_workload


@dataclass(frozen=True)
class BenchConfig:
    address: str
    workload: str
    qps: tuple[float, ...] = (1.0,)
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    timeout_s: float = 120.0
    token: str = ""
    out: str = "bench-out"
    plots: bool = True

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give --num-requests or --duration")
        if not self.qps or any(q <= 0 for q in self.qps):
            raise ValueError(f"--qps must be positive rates, got {self.qps}")


def main(argv: list[str], settings) -> int:
    if argv[:1] == ["compare"]:
        args = _compare_parser().parse_args(argv[1:])
        print(compare(Path(args.a), Path(args.b), Path(args.out)))
        return 0
    args = _parser().parse_args(argv)
    config = BenchConfig(
        address=args.address or settings.router_address, workload=args.workload,
        qps=tuple(float(q) for part in args.qps or ["1"] for q in part.split(",") if q),
        num_requests=args.num_requests, duration_s=args.duration, seed=args.seed,
        slo=Slo(_s(args.slo_ttft_ms), _s(args.slo_tpot_ms), _s(args.slo_e2e_ms)),
        timeout_s=args.timeout_s, token=args.token or settings.token, out=args.out, plots=not args.no_plots)
    report = asyncio.run(run_bench(config, settings))
    print(f"wrote {report['paths']}")
    return 0


async def run_bench(config: BenchConfig, settings=None) -> dict:
    """Runs every QPS of the sweep in turn against `config.address`; writes report.json,
    report.md and plots. The router's TLS is verified with `settings.router_ca` when set."""
    from tqdm import tqdm

    from services.common.client import router_ca
    from specmesh.client import NO_RETRIES, AsyncClient

    items = load_workload(config.workload)
    ca = router_ca(settings) if settings is not None else None
    runs = []
    async with AsyncClient(config.address, ca_pem=ca, timeout=config.timeout_s, retry=NO_RETRIES) as client:
        for qps in config.qps:
            schedule = poisson_schedule(qps, config.seed, len(items), config.num_requests, config.duration_s)
            with tqdm(total=len(schedule), desc=f"{qps:g} req/s", unit="req") as progress:
                records = await run_schedule(client, items, schedule, config.token, config.timeout_s, progress)
            runs.append(run_result(qps, items, schedule, records, config.slo))
    out = Path(config.out)
    paths = list(write_report(out, _config_json(config), runs))
    if config.plots:
        from services.bench.plots import plot_run
        paths += plot_run(out, runs)
    return {"runs": runs, "paths": [str(p) for p in paths]}


def run_result(qps: float, items: list[WorkloadItem], schedule, records, slo: Slo) -> dict:
    requests = [r.to_json() for r in records]
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
    duration = max([a.at_s for a in schedule] + ends, default=0.0)
    return {"qps": qps, "duration_s": duration, "arrivals_s": [a.at_s for a in schedule],
            "requests": requests, "summary": summarize(requests, duration, slo)}


def compare(a: Path, b: Path, out: Path) -> str:
    """Writes compare.md and compare.png for two reports (files or their directories)."""
    from services.bench.plots import plot_compare

    reports = [json.loads((p / "report.json" if p.is_dir() else p).read_text()) for p in (a, b)]
    out.mkdir(parents=True, exist_ok=True)
    text = compare_markdown(reports[0], reports[1], str(a), str(b))
    (out / "compare.md").write_text(text)
    plot_compare(out / "compare.png", reports[0], reports[1], str(a), str(b))
    return text


def _config_json(config: BenchConfig) -> dict:
    data = asdict(config)
    data.pop("token")  # never written to a report
    return data


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specmesh bench", description="open-loop load against a router "
                                "(Poisson arrivals); `specmesh bench compare A B` compares two reports")
    p.add_argument("workload", help="JSONL, one request a line: bucket, prompt (or messages), optional "
                   "max_tokens, temperature, token, retrieval, seed, model")
    p.add_argument("--address", help="router address (default: the router_address setting)")
    p.add_argument("--qps", action="append", default=[], help="arrival rate(s), e.g. 1,2,4 (a list sweeps)")
    p.add_argument("--num-requests", type=int, help="requests per rate")
    p.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0, help="arrival schedule seed (same seed, same schedule)")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput: time-per-output-token bound")
    p.add_argument("--slo-e2e-ms", type=float, help="goodput: end-to-end bound")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request deadline")
    p.add_argument("--token", help="bearer token (default: the token setting)")
    p.add_argument("--out", default="bench-out", help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return p


def _compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specmesh bench compare", description="two bench reports side by side")
    p.add_argument("a", help="report.json (or its directory)")
    p.add_argument("b", help="report.json (or its directory)")
    p.add_argument("--out", default="bench-compare", help="output directory")
    return p
