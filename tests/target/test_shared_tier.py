"""The shared tier's store against a real Redis (127.0.0.1:6379, keys under a per-test prefix,
deleted afterwards): entries come back byte-equal; bad, foreign and other-key entries are
never served; this replica's byte bound holds; a full write queue drops instead of blocking;
Redis down means no entries, never an error."""

from __future__ import annotations

import hashlib
import json
import struct
import time

import redis
import torch

from services.target.engine.block_manager import BlockManager
from services.target.engine.host_tier import HostTier, TierIdentity
from services.target.engine.shared_tier import MAGIC, SharedTier, prefetch
from tests.target.shared_redis import URL, free_port, kv_prefix  # noqa: F401 (fixture)

BLOCK_BYTES = 256
IDENTITY = TierIdentity("model", "torch.float32", 4, BLOCK_BYTES)
KEY_A = "model\x00salt-a"


def _data(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _chain(n: int, extra: str = KEY_A) -> list[tuple[int, tuple]]:
    from services.common.block_hash import block_hash
    out, parent = [], None
    for i in range(n):
        key = (parent, (i, i + 1, i + 2, i + 3), extra)
        parent = block_hash(*key)
        out.append((parent, key))
    return out


def _tier(prefix: str, capacity: int = 1 << 20, url: str = URL, **kw) -> SharedTier:
    return SharedTier(redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2), prefix,
                      IDENTITY, capacity, ttl_s=60, **kw)


def _write(tier: SharedTier, chain, first_seed: int = 0) -> None:
    for i, (h, key) in enumerate(chain):
        assert tier.wants(h)
        assert tier.offer(h, key, _data(first_seed + i))
    assert tier.flush()


def test_entries_written_by_one_tier_load_byte_equal_in_another(kv_prefix):
    chain = _chain(5)
    writer, reader = _tier(kv_prefix), _tier(kv_prefix)
    try:
        _write(writer, chain)
        assert not any(writer.wants(h) for h, _ in chain)  # written: not offered again
        loaded = reader.load(chain, 1 << 20)
        assert [torch.equal(e.data, _data(i)) for i, e in enumerate(loaded)] == [True] * 5
        assert [e.origin for e in loaded] == ["shared"] * 5
        assert len(reader.load(chain, 3 * BLOCK_BYTES)) == 3  # at most max_bytes
        assert len(reader.load(chain + _chain(2, "model\x00other"), 1 << 20)) == 5  # stops at the first miss
        s = writer.stats()
        assert (s.written_blocks, s.dropped_writes, s.errors) == (5, 0, 0)
        assert s.written_bytes == sum(writer.client.strlen(writer.redis_key(h)) for h, _ in chain)
        assert reader.client.ttl(reader.redis_key(chain[0][0])) > 0  # every entry expires
    finally:
        writer.close()
        reader.close()


def test_bad_foreign_and_other_key_entries_are_never_served(kv_prefix):
    chain = _chain(7)
    tier = _tier(kv_prefix)
    try:
        _write(tier, chain)
        client, key_of = tier.client, tier.redis_key
        raw = client.get(key_of(chain[1][0]))
        corrupted = bytearray(raw)
        corrupted[-10] ^= 0x08
        client.set(key_of(chain[1][0]), bytes(corrupted))
        client.set(key_of(chain[2][0]), client.get(key_of(chain[2][0]))[:-16])  # truncated
        client.set(key_of(chain[3][0]), b"SMKV")  # truncated inside its header
        for i, other in ((4, TierIdentity("other-model", "torch.float32", 4, BLOCK_BYTES)),
                         (5, TierIdentity("model", "torch.bfloat16", 4, BLOCK_BYTES)),
                         (6, TierIdentity("model", "torch.float32", 8, BLOCK_BYTES))):
            foreign = SharedTier(client, kv_prefix, other, 1 << 20, 60)  # what another model's replica writes
            client.set(key_of(chain[i][0]), foreign.frame(chain[i][1], _data(i)))
            foreign._stop = True
        # Another tenant's block under this hash: the entry's key digest differs, so it is refused.
        other_tenant = _chain(1, "model\x00salt-b")[0][1]
        client.set(key_of(chain[0][0]), tier.frame(other_tenant, _data(0)))
        assert tier.load(chain, 1 << 20) == []
        for i in range(1, 7):
            assert tier.load(chain[i:], 1 << 20) == [], i
        assert tier.stats().rejected_blocks == 7 and tier.stats().loaded_blocks == 0
    finally:
        tier.close()


def test_this_replicas_byte_bound_holds_and_its_oldest_entries_go_first(kv_prefix):
    chain = _chain(12)
    probe = _tier(kv_prefix)
    entry_bytes = len(probe.frame(chain[0][1], _data(0)))
    probe.close()
    bound = 5 * entry_bytes + entry_bytes // 2
    tier = _tier(kv_prefix, capacity=bound)
    try:
        for i, (h, key) in enumerate(chain):
            tier.offer(h, key, _data(i))
            assert tier.flush()
            held = sum(tier.client.strlen(k) for k in tier.client.scan_iter(f"{kv_prefix}:*"))
            assert held <= bound and tier.stats().written_bytes == held
        assert [bool(tier.client.exists(tier.redis_key(h))) for h, _ in chain] == [False] * 7 + [True] * 5
        s = tier.stats()
        assert (s.written_blocks, s.deleted_blocks, s.written_bytes) == (12, 7, 5 * entry_bytes)
        assert tier.wants(chain[0][0])  # deleted: written again when computed again
    finally:
        tier.close()


def test_a_full_write_queue_drops_and_never_blocks(kv_prefix):
    tier = _tier(kv_prefix, queue_size=2)
    tier.close()  # no writer: the queue only fills
    chain = _chain(3)
    assert [tier.offer(h, key, _data(0)) for h, key in chain] == [True, True, False]
    assert tier.stats().dropped_writes == 1 and tier.wants(chain[2][0])


def test_redis_down_means_no_entries_and_no_error(kv_prefix):
    tier = _tier(kv_prefix, url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    try:
        chain = _chain(3)
        start = time.monotonic()
        assert tier.load(chain, 1 << 20) == []
        assert tier.load(chain, 1 << 20) == []  # backing off: not even tried
        for h, key in chain:
            tier.offer(h, key, _data(0))
        assert tier.flush()
        assert time.monotonic() - start < 2.0
        s = tier.stats()
        assert s.errors == 1 and s.dropped_writes == 3 and s.written_blocks == 0
    finally:
        tier.close()


def test_prefetch_loads_past_what_this_replica_holds_into_the_host_tier(kv_prefix):
    chain = _chain(6)
    writer, reader = _tier(kv_prefix), _tier(kv_prefix)
    host = HostTier(1 << 20, IDENTITY)
    blocks = BlockManager(num_blocks=16, block_size=4, host_tier=host)
    try:
        _write(writer, chain)
        host.put(chain[0][0], host.entry(chain[0][1], _data(100)))  # this replica's own copy of block 0
        assert prefetch(blocks, host, reader, chain) == 5
        assert host.hashes() == [h for h, _ in chain]
        assert torch.equal(host.entry_of(chain[0][0]).data, _data(100))  # its own copy kept, not fetched
        assert [host.entry_of(h).origin for h, _ in chain] == ["host"] + ["shared"] * 5
        assert prefetch(blocks, host, reader, chain) == 0  # everything held: no Redis call
        assert reader.stats().loaded_blocks == 5
    finally:
        writer.close()
        reader.close()


def test_an_entry_of_the_previous_format_is_refused(kv_prefix):
    """Format 1 (blake2b checksum) entries left by an older replica: refused, recomputed."""
    chain = _chain(1)
    tier = _tier(kv_prefix)
    try:
        (h, key), data = chain[0], _data(0)
        frame = tier.frame(key, data)
        (size,) = struct.unpack_from("<I", frame, len(MAGIC))
        header = json.loads(frame[len(MAGIC) + 4:len(MAGIC) + 4 + size])
        header.update(v=1, sum=hashlib.blake2b(data.numpy(), digest_size=16).hexdigest())
        raw = json.dumps(header).encode()
        tier.client.set(tier.redis_key(h), MAGIC + struct.pack("<I", len(raw)) + raw + data.numpy().tobytes())
        assert tier.load(chain, 1 << 20) == []
        assert tier.stats().rejected_blocks == 1
    finally:
        tier.close()


def test_a_loaded_entry_keeps_its_checksum_and_is_checked_again_when_taken(kv_prefix):
    chain = _chain(2)
    writer, reader = _tier(kv_prefix), _tier(kv_prefix)
    host = HostTier(1 << 20, IDENTITY)
    try:
        _write(writer, chain)
        assert prefetch(BlockManager(num_blocks=8, block_size=4, host_tier=host), host, reader, chain) == 2
        first, second = (host.entry_of(h) for h, _ in chain)
        assert first.checksum == host.entry(chain[0][1], _data(0)).checksum  # the one the writer framed
        second.data[7] ^= 0x01  # corrupted in this process after the load's check
        assert torch.equal(host.take(*chain[0]), _data(0))
        assert host.take(*chain[1]) is None and host.stats().rejected_blocks == 1
    finally:
        writer.close()
        reader.close()
