"""A torch function mode that records every tensor factory call that does not name its device
and every random draw whose generator lives on another device than the tensor it fills.

On a CUDA target a factory without `device=` makes a CPU tensor, and every kernel that then
meets it beside the model's tensors fails (or copies to the host). On the CPU both devices are
the same, so a test cannot see the mismatch itself; what it can check is that every tensor the
step path makes says where it goes (tests/target/test_step_devices.py)."""

from __future__ import annotations

import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.empty_strided,
    torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
})


class DeviceNamingGuard(TorchFunctionMode):
    """Use as a context on the thread that runs the step; `violations` lists what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self.calls = 0  # torch calls seen (a guard that saw nothing proves nothing)
        self._lock = threading.Lock()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        problem = None
        if func in FACTORIES and kwargs.get("device") is None:
            problem = f"torch.{func.__name__} without device="
        generator = kwargs.get("generator")
        if generator is not None:
            target = kwargs.get("device")
            if target is None:
                target = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            if target is not None and torch.device(target) != generator.device:
                problem = f"torch.{func.__name__} with a {generator.device} generator for a {target} tensor"
        if problem is not None:
            caller = _caller()
            with self._lock:
                self.violations.append(f"{problem} at {caller}")
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame in specmesh's services (where the call was written)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/services/" in frame.filename:
            return f"{frame.filename.split('/services/')[-1]}:{frame.lineno}"
    return "outside services/"
