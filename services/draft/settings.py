"""The draft service's settings (`settings.draft`).

The draft LM's dtype is the mesh's `dtype` (the target's: the two share a tokenizer and are
prepared alike); the plan limits a request may ask for are the speculation plan's
(services/common/speculation_plan.py).
"""

from __future__ import annotations

from pydantic import Field

from services.common.settings_group import SettingsGroup


class DraftSettings(SettingsGroup):
    draft_model: str = Field("", description="draft LM for draft_model / dynamic_tree: 'default' "
                             "or a local Hugging Face directory")
    eagle_head: str = Field("auto", description="feature head file for eagle (from `specmesh draft train`, "
                            "trained for the target `model`); 'auto' = the head shipped for the default "
                            "model when `model` is 'default' (services/draft/eagle/heads/), else none; "
                            "'none' = eagle unavailable")
