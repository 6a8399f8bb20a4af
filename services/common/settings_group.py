"""The base of every group of settings (services/common/env.py reads them into one tree)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SettingsGroup(BaseModel):
    """A group of settings: unknown names refused, assignments validated; a field with an
    `alias` (its flat setting name, where the service's config calls the value differently)
    is accepted by either name."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              populate_by_name=True)
