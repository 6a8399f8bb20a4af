"""Size limits on what a caller controls, checked before any work (router and target).

Defaults follow what public serving APIs accept: a prompt of at most 1 MiB of UTF-8
(far beyond any context window served here: ~250k tokens at 4 bytes a token), at most
16 stop sequences (OpenAI allows 4) of at most 256 bytes each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import Violation

DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_STOP_SEQUENCES = 16
DEFAULT_MAX_STOP_BYTES = 256


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # prompt (or all chat message contents), UTF-8
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES
    max_stop_bytes: int = DEFAULT_MAX_STOP_BYTES  # each stop sequence, UTF-8

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_stop_sequences", "max_stop_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

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
