"""A workload: JSONL, one request a line.

    {"bucket": "summarize", "prompt": "...", "max_tokens": 64, "temperature": 0.0,
     "token": "...", "messages": [{"role": "user", "content": "..."}],
     "retrieval": {"corpus": "docs", "query": "...", "k": 4}, "seed": 1, "model": ""}

`bucket` (the workload's own label, reported as given) and `prompt` or `messages` are
required; the rest is optional.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specmesh.proto.v1 import common_pb2, router_service_pb2


@dataclass(frozen=True)
class WorkloadItem:
    bucket: str
    prompt: str = ""
    max_tokens: int = 64
    temperature: float = 0.0
    token: str = ""  # bearer token; "" = the bench's --token
    messages: tuple[tuple[str, str], ...] = ()
    retrieval: dict = field(default_factory=dict)
    seed: int | None = None
    model: str = ""

    def request(self) -> router_service_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)
        if self.seed is not None:
            sampling.seed, sampling.has_seed = self.seed, True
        message = router_service_pb2.GenerateRequest(sampling=sampling, model=self.model)
        if self.messages:
            message.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in self.messages)
        else:
            message.prompt = self.prompt
        if self.retrieval:
            message.retrieval.CopyFrom(router_service_pb2.RetrievalSpec(**self.retrieval))
        return message


def load_workload(path: str | Path) -> list[WorkloadItem]:
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(parse_item(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


def parse_item(data: dict) -> WorkloadItem:
    if not isinstance(data, dict) or not data.get("bucket"):
        raise ValueError("each line needs a 'bucket'")
    messages = tuple((m["role"], m["content"]) for m in data.get("messages", ()))
    if not data.get("prompt") and not messages:
        raise ValueError("each line needs a 'prompt' or 'messages'")
    unknown = set(data) - {"bucket", "prompt", "max_tokens", "temperature", "token", "messages",
                           "retrieval", "seed", "model"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    return WorkloadItem(bucket=str(data["bucket"]), prompt=data.get("prompt", ""),
                        max_tokens=int(data.get("max_tokens", 64)),
                        temperature=float(data.get("temperature", 0.0)), token=data.get("token", ""),
                        messages=messages, retrieval=dict(data.get("retrieval") or {}),
                        seed=data.get("seed"), model=data.get("model", ""))
