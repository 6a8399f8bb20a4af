"""A named place where a test makes the engine raise: a real fault in the running loop, not a
mock of the engine. Checking costs one Event read; nothing fires unless `arm` was called (tests
call it directly; `specmesh serve target` / `up` arm it on SIGUSR1 when the `fault_injection`
setting is on, services/builders.py)."""

from __future__ import annotations

import threading


class InjectedFault(RuntimeError):
    """Raised at an armed fault point."""


class FaultPoint:
    def __init__(self, name: str) -> None:
        self.name = name
        self._armed = threading.Event()

    def arm(self) -> None:
        """The next `check` raises InjectedFault (once); safe from any thread or signal handler."""
        self._armed.set()

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def check(self) -> None:
        if self._armed.is_set():
            self._armed.clear()
            raise InjectedFault(f"fault injected at {self.name}")
