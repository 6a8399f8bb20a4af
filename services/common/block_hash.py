"""Chained block hashes of a token sequence: one implementation for the target and the router.

A *full* block holds `block_size` tokens. Its hash is `h(parent_hash, tokens, extra_key)`
(parent = None for the first block), where `extra_key` holds the model id and the tenant
salt, so equal tokens of different tenants never share a block. The target registers its
cached blocks under these hashes; the router computes the same hashes for a prompt and
asks the cache service's prefix index which replica holds the longest leading run.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def extra_key(model_id: str, tenant_salt: str) -> str:
    """The key mixed into every block hash of one (model, tenant)."""
    return f"{model_id}\x00{tenant_salt}"


def block_hash(parent: int | None, tokens: tuple[int, ...], extra_key: str) -> int:
    """Stable 64-bit chained hash (the same in every process, so events can be shared)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", 0 if parent is None else parent))
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    h.update(extra_key.encode())
    return struct.unpack("<Q", h.digest())[0]


def chained_block_hashes(token_ids: Sequence[int], block_size: int, extra_key: str,
                         limit: int | None = None) -> list[int]:
    """Hashes of the leading full blocks of `token_ids` (at most `limit` of them)."""
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes, parent = [], None
    for i in range(count):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_key)
        hashes.append(parent)
    return hashes
