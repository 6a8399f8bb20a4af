"""Packed weights on 2 MB pages (services/target/kernels/huge_pages.py): the copy holds the same
values, starts on a cache line (a large tensor on a 2 MB boundary), small tensors and
SPECMESH_HUGE_PAGES=0 keep theirs, and where the kernel grants transparent huge pages on request
the large tensor's mapping has them."""

from __future__ import annotations

from pathlib import Path

import torch

from services.target.kernels import huge_pages


def _thp_on_request() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and ("[madvise]" in path.read_text() or "[always]" in path.read_text())


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_large_tensors_move_onto_huge_pages_with_their_values():
    big = torch.randn(3 << 20).to(torch.bfloat16).view(1536, 2048)  # 6 MB: shares a region
    huge = torch.randint(-128, 127, (24 << 20,), dtype=torch.int8)  # 24 MB: a mapping of its own
    placed, placed_huge = huge_pages.place(big), huge_pages.place(huge)
    assert torch.equal(placed, big) and placed.dtype == big.dtype and placed.shape == big.shape
    assert torch.equal(placed_huge, huge)
    assert placed.data_ptr() != big.data_ptr() and placed.data_ptr() % huge_pages.ALIGN == 0
    assert placed_huge.data_ptr() % huge_pages.PAGE == 0
    if _thp_on_request():
        assert _anon_huge_kb(placed_huge.data_ptr()) >= 2048


def test_small_tensors_and_the_switch_keep_their_memory(monkeypatch):
    small = torch.zeros(1000)
    assert huge_pages.place(small) is small
    monkeypatch.setenv("SPECMESH_HUGE_PAGES", "0")
    big = torch.zeros(1 << 20)
    assert huge_pages.place(big) is big


def test_zeros_on_huge_pages_are_zeros_of_the_dtype_and_shape():
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        t = huge_pages.zeros((64, 16, 1, 256), dtype)  # 256k-1M elements: a KV pool layer
        assert t.dtype == dtype and t.shape == (64, 16, 1, 256)
        assert not t.float().any()
        t[3, 2] = 1  # writable
        assert t.float().sum() == 256
    assert huge_pages.zeros((4, 4), torch.float32).sum() == 0  # small: torch.zeros
