"""Sends a schedule of requests to a router, open loop: each request leaves at its arrival
time whether or not earlier ones have finished, and its latencies are measured here.

Through the shipped client (specmesh.client) with NO_RETRIES: a retry would hide a failure
and count its wait as latency."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from services.bench.schedule import Arrival
from services.bench.workload import WorkloadItem
from specmesh.client import AsyncClient


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds)."""

    index: int
    item: int
    bucket: str
    scheduled_s: float  # arrival time in the schedule
    sent_s: float = 0.0  # when it actually left (lags the schedule when the client is late)
    status: str = "OK"  # grpc.StatusCode name
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None  # (e2e - ttft) / (completion tokens - 1)
    e2e_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    acceptance_length: float = 0.0
    verify_passes: int = 0
    fallback_steps: int = 0
    route: dict = field(default_factory=dict)
    request_id: str = ""  # the id the answering target knew it by (RouteRecord.request_id)
    sent_monotonic: float = 0.0  # time.monotonic() at send and at the first token: the clock
    first_token_monotonic: float | None = None  # an in-process engine's step log uses

    def to_json(self) -> dict:
        return asdict(self)


async def run_schedule(client: AsyncClient, items: list[WorkloadItem], schedule: list[Arrival],
                       token: str, timeout_s: float = 120.0, progress=None) -> list[RequestRecord]:
    """Runs the whole schedule; returns one record per arrival, in schedule order."""
    start = time.perf_counter()
    tasks = []
    for arrival in schedule:
        delay = start + arrival.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        item = items[arrival.item]
        record = RequestRecord(arrival.index, arrival.item, item.bucket, arrival.at_s)
        tasks.append(asyncio.create_task(_send(client, item, record, token, timeout_s, start, progress)))
    return list(await asyncio.gather(*tasks))


async def _send(client: AsyncClient, item: WorkloadItem, record: RequestRecord, token: str, timeout_s: float,
                run_start: float, progress) -> RequestRecord:
    metadata = (("authorization", f"Bearer {item.token or token}"),)
    sent = time.perf_counter()
    record.sent_s = sent - run_start
    record.sent_monotonic = time.monotonic()
    first = last = None
    tokens = 0
    try:
        async for response in client.stream(item.request(), metadata=metadata, timeout=timeout_s):
            chunk = response.chunk
            if chunk.token_ids:
                last = time.perf_counter()
                if first is None:
                    first, record.first_token_monotonic = last, time.monotonic()
                tokens += len(chunk.token_ids)
            if chunk.HasField("usage"):
                _usage(record, chunk.usage)
            if response.HasField("route"):
                record.route = MessageToDict(response.route, preserving_proto_field_name=True)
                record.request_id = response.route.request_id
        end = time.perf_counter()
        record.e2e_s = end - sent
        record.completion_tokens = record.completion_tokens or tokens
        if first is not None:
            record.ttft_s = first - sent
            if tokens > 1:
                record.tpot_s = (last - first) / (tokens - 1)
    except grpc.aio.AioRpcError as exc:
        record.status, record.error = exc.code().name, exc.details() or ""
    if progress is not None:
        progress.update(1)
    return record


def _usage(record: RequestRecord, usage) -> None:
    record.completion_tokens = usage.completion_tokens
    record.prompt_tokens = usage.prompt_tokens
    record.cached_prompt_tokens = usage.cached_prompt_tokens
    record.proposed_tokens = usage.proposed_tokens
    record.accepted_tokens = usage.accepted_tokens
    record.rejected_tokens = usage.rejected_tokens
    record.acceptance_length = usage.acceptance_length
    record.verify_passes = usage.verify_passes
    record.fallback_steps = usage.fallback_steps
