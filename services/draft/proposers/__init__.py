"""Draft proposers: one `Proposer` per speculation method."""

from services.draft.proposers.base import ROOT, DraftTree, Proposer
from services.draft.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["ROOT", "DraftTree", "Proposer", "PromptLookupProposer"]
