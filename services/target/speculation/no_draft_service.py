"""The draft client of a target with no draft service: nothing to call.

Such a target still speculates where it proposes drafts itself (grammar drafts,
services/target/structured/); every draft-service call is skipped (`available` is False).
"""

from __future__ import annotations


class NoDraftService:
    available = False
    connected = True  # nothing to wait for

    def connect(self) -> None:
        pass

    def propose(self, requests):
        raise AssertionError("no draft service: the speculator must not ask it")

    def release(self, seq_ids: list[str]) -> None:
        pass

    def num_unreleased(self) -> int:
        return 0

    def close(self) -> None:
        pass
