"""The wire form of target features (DraftSequence.features, FeatureRows): bf16 rows, little-endian.

One definition for both sides: the target encodes the features of newly committed positions,
the draft service checks and decodes them for the feature head (services/draft/eagle)."""

from __future__ import annotations

import torch

from specmesh.proto.v1 import draft_service_pb2

BYTES_PER_VALUE = 2  # bfloat16


def encode(start: int, rows: torch.Tensor) -> draft_service_pb2.FeatureRows:
    """rows [num_rows, hidden] (any float dtype, any device) -> FeatureRows of positions start.."""
    data = rows.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return draft_service_pb2.FeatureRows(start=start, num_rows=rows.shape[0], hidden_size=rows.shape[1], data=data)


def problem(message: draft_service_pb2.FeatureRows, hidden_size: int, num_tokens: int) -> str | None:
    """Why `message` cannot be the features of a sequence of `num_tokens` committed tokens for a
    head of `hidden_size`, or None. Feature j goes with token j + 1, so positions end at
    num_tokens - 2."""
    if message.hidden_size != hidden_size:
        return f"features have hidden_size {message.hidden_size}, the head {hidden_size}"
    if message.start < 0 or message.num_rows < 0:
        return f"features start {message.start} and num_rows {message.num_rows} must be >= 0"
    if len(message.data) != message.num_rows * message.hidden_size * BYTES_PER_VALUE:
        return (f"features carry {len(message.data)} bytes, expected num_rows * hidden_size * 2 = "
                f"{message.num_rows * message.hidden_size * BYTES_PER_VALUE}")
    if message.start + message.num_rows > num_tokens - 1:
        return (f"features of positions up to {message.start + message.num_rows - 1} for a sequence of "
                f"{num_tokens} tokens (the last has no feature yet)")
    return None


def decode(message: draft_service_pb2.FeatureRows) -> torch.Tensor:
    """-> [num_rows, hidden] bfloat16 (checked with `problem` first)."""
    values = torch.frombuffer(bytearray(message.data), dtype=torch.int16)  # a copy: the message stays read-only
    return values.view(torch.bfloat16).view(message.num_rows, message.hidden_size)
