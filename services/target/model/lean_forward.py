"""Which lean forward runs a model: Gemma 3's (gemma3_forward.py), the Llama family's
(llama_forward.py), or none (transformers' own modules with the paged attention hooked in)."""

from __future__ import annotations

import logging

from torch import nn

from services.target.model import gemma3_forward, llama_forward
from services.target.model.gemma3_forward import FUSED, fuse_projections

log = logging.getLogger(__name__)

_FORWARDS = ((gemma3_forward.supports, gemma3_forward.Gemma3PagedForward),
             (llama_forward.supports, llama_forward.LlamaPagedForward))


def supports(model: nn.Module) -> bool:
    """Whether a lean forward computes `model` exactly (its projections are then fused at load)."""
    return any(check(model) for check, _ in _FORWARDS)


def fuse(model: nn.Module) -> None:
    """Fuses q/k/v and gate/up (before packing) where a lean forward will run the model."""
    if supports(model):
        fuse_projections(model)


def build(model: nn.Module):
    """The lean forward of a fused model, or None (and says why in the log) for the generic path."""
    for check, forward in _FORWARDS:
        if check(model) and hasattr(model, FUSED):
            log.info("forward: %s (lean, %s)", forward.__name__, type(model).__name__)
            return forward(model)
    why = "projections not fused" if supports(model) else "no lean forward for this architecture or config"
    log.info("forward: transformers' modules for %s (%s)", type(model).__name__, why)
    return None
