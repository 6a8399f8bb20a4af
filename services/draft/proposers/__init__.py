"""Draft proposers: one `Proposer` per speculation method.

The draft model proposers import torch and transformers, so they load on first use
(a server without a draft model never imports them).
"""

from services.draft.proposers.base import ROOT, DraftSampling, DraftTree, Proposer
from services.draft.proposers.prompt_lookup import PromptLookupProposer
from services.draft.proposers.suffix import SuffixProposer

__all__ = ["ROOT", "DraftSampling", "DraftTree", "Proposer", "PromptLookupProposer", "SuffixProposer", "DraftModel",
           "DraftModelProposer", "DynamicTreeProposer", "TreeBuild"]

_LAZY = {"DraftModel": "draft_model", "DraftModelProposer": "draft_model",
         "DynamicTreeProposer": "dynamic_tree", "TreeBuild": "dynamic_tree"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"services.draft.proposers.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
