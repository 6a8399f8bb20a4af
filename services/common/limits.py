"""Size limits on what a caller controls, checked before any work (router and target).

Defaults follow what public serving APIs accept: a prompt of at most 1 MiB of UTF-8
(far beyond any context window served here: ~250k tokens at 4 bytes a token), at most
16 stop sequences (OpenAI allows 4) of at most 256 bytes each.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import ConfigDict, Field

from services.common.errors import Violation
from services.common.settings_group import SettingsGroup

DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_STOP_SEQUENCES = 16
DEFAULT_MAX_STOP_BYTES = 256


class RequestLimits(SettingsGroup):
    """The limits as settings (`settings.limits`, flat names max_prompt_bytes, ...); frozen, so
    the router's and the target's configs can hold one as a default."""

    model_config = ConfigDict(frozen=True)

    max_prompt_bytes: int = Field(DEFAULT_MAX_PROMPT_BYTES, gt=0, description="largest prompt (or sum "
                                  "of chat message contents) in UTF-8 bytes; router and target refuse "
                                  "more before tokenizing")
    max_stop_sequences: int = Field(DEFAULT_MAX_STOP_SEQUENCES, gt=0,
                                    description="most stop sequences a request may give")
    max_stop_bytes: int = Field(DEFAULT_MAX_STOP_BYTES, gt=0, description="longest stop sequence in UTF-8 bytes")

    def violations(self, prompt_parts: Iterable[str], stop: Iterable[str],
                   prompt_field: str = "prompt") -> list[Violation]:
        """What exceeds a limit; cheap (lengths only), so it runs before tokenizing."""
        out = []
        size = 0
        for part in prompt_parts:
            size += len(part.encode("utf-8", "surrogatepass"))
            if size > self.max_prompt_bytes:
                out.append(Violation(prompt_field, f"prompt is larger than the limit of "
                                     f"{self.max_prompt_bytes} bytes"))
                break
        stop = list(stop)
        if len(stop) > self.max_stop_sequences:
            out.append(Violation("sampling.stop", f"{len(stop)} stop sequences; the limit is "
                                 f"{self.max_stop_sequences}"))
        for i, s in enumerate(stop[:self.max_stop_sequences]):
            if len(s.encode("utf-8", "surrogatepass")) > self.max_stop_bytes:
                out.append(Violation(f"sampling.stop[{i}]", f"stop sequence is longer than "
                                     f"{self.max_stop_bytes} bytes"))
        return out
