"""Builds the draft gRPC server (not started: the caller awaits `start()` and `stop()`)."""

from __future__ import annotations

from services.common.server import GrpcServer
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME, DraftService, add_to_server


def build_draft_server(config: DraftConfig, draft_model=None) -> GrpcServer:
    """Loads the draft model of `config.draft_model_dir` unless `draft_model` (a loaded
    `services.draft.proposers.DraftModel`) is given."""
    service = DraftService(config, draft_model)
    return GrpcServer(config.server, lambda grpc_server: add_to_server(grpc_server, service),
                      [SERVICE_NAME], on_drain=service.drain)
