"""Model pools at run time: each pool's replicas, tokenizer and measured speed.

A pool is one model; the router tokenizes a prompt with the pool's
own tokenizer (loaded once, off the event loop, from the pool's model directory) to
count tokens and compute the chained block hashes its replicas compute. Without a
readable tokenizer the pool still serves: token counts are estimated (4 bytes per token)
and replica choice falls back from kv_aware to least_loaded for that pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import grpc

from services.common.block_hash import chained_block_hashes, extra_key
from services.common.mesh_config import PoolConfig
from specmesh.proto.v1 import cache_service_pb2
from services.router.cache_instances import CacheInstances, NoCacheInstance, shard_key
from services.router.replicas import Replica, ReplicaSet

log = logging.getLogger(__name__)
BYTES_PER_TOKEN_ESTIMATE = 4
MAX_INDEX_BLOCKS = 1024  # leading blocks sent to the prefix index per request
PREFIX_LOOKUP_TIMEOUT_S = 0.1


class Pool:
    def __init__(self, config: PoolConfig, replicas: ReplicaSet, model_cache: Path,
                 tpot_ewma: float = 0.2) -> None:
        self.config = config
        self.name = config.name
        self.replicas = replicas
        self._model_cache = model_cache
        self._tokenizer = None
        self._tokenizer_loaded = False
        self._tokenizer_lock = asyncio.Lock()
        self._ewma = tpot_ewma
        self.tpot_s: float | None = None  # measured; None until the first answer

    async def tokenize(self, prompt: str, messages=()) -> list[int] | None:
        """Prompt ids as the pool's replicas compute them (off the event loop); None without a
        tokenizer, or when the chat template refuses the messages (the target will say why)."""
        tokenizer = await self._get_tokenizer()
        if tokenizer is None:
            return None
        return await asyncio.to_thread(_prompt_ids, tokenizer, prompt, messages)

    def estimate_tokens(self, prompt: str) -> int:
        return max(1, len(prompt.encode()) // BYTES_PER_TOKEN_ESTIMATE)

    def block_hashes(self, token_ids: list[int], tenant_salt: str) -> list[int]:
        """The prompt's chained block hashes as this pool's replicas compute them (may be [])."""
        block_size = self.replicas.block_size()
        model_id = self.config.model_id or self.replicas.cache_model_id()
        if block_size is None or not model_id:
            return []  # no replica has answered yet
        return chained_block_hashes(token_ids, block_size, extra_key(model_id, tenant_salt),
                                    limit=MAX_INDEX_BLOCKS)

    def observe_tpot(self, seconds_per_token: float) -> None:
        self.tpot_s = seconds_per_token if self.tpot_s is None else (
            (1 - self._ewma) * self.tpot_s + self._ewma * seconds_per_token)

    async def _get_tokenizer(self):
        if self._tokenizer_loaded:
            return self._tokenizer
        async with self._tokenizer_lock:
            if not self._tokenizer_loaded:
                self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.model,
                                                          str(self._model_cache))
                self._tokenizer_loaded = True
        return self._tokenizer


class PrefixLookup:
    """Asks the cache service's prefix index how many leading blocks each replica holds (the
    instance that owns the prompt's first block, services/router/cache_instances.py)."""

    def __init__(self, cache: CacheInstances | None) -> None:
        self._cache = cache

    async def cached_tokens(self, hashes: list[int], replicas: list[Replica], block_size: int) -> dict[str, int]:
        """address -> cached leading prompt tokens, tier hits priced at their load cost
        (`Replica.cached_tokens`), at least what this router's prompts in flight there share
        (`Replica.sent_blocks`: the index hears of those blocks only once they are computed)."""
        if not hashes or not replicas:
            return {}
        out = await self._indexed(hashes, replicas, block_size)
        for r in replicas:
            sent = r.sent_blocks(hashes) * block_size
            if sent > out.get(r.address, 0):
                out[r.address] = sent
        return out

    async def _indexed(self, hashes: list[int], replicas: list[Replica], block_size: int) -> dict[str, int]:
        """What the prefix index says; {} when it is unavailable."""
        if self._cache is None:
            return {}
        try:
            response = await self._cache.call(
                shard_key("prefix", str(hashes[0])), "PrefixMatch",
                cache_service_pb2.PrefixMatchRequest(block_hashes=hashes, replicas=[r.address for r in replicas]),
                timeout=PREFIX_LOOKUP_TIMEOUT_S)
        except NoCacheInstance as exc:
            log.debug("prefix index unavailable: %s", exc)
            return {}
        except grpc.aio.AioRpcError as exc:
            log.debug("prefix index unavailable: %s", exc.code().name)
            return {}
        by_address = {r.address: r for r in replicas}
        return {m.replica: by_address[m.replica].cached_tokens(m.matched_blocks, m.host_blocks, m.shared_blocks,
                                                               block_size)
                for m in response.matches if m.replica in by_address}


def build_pools(configs, channel_factory: Callable[[str], grpc.aio.Channel], policy: str,
                poll_interval_s: float, model_cache: Path) -> dict[str, Pool]:
    return {c.name: Pool(c, ReplicaSet(c.replicas, channel_factory, policy, poll_interval_s), model_cache)
            for c in configs}


def _prompt_ids(tokenizer, prompt: str, messages) -> list[int] | None:
    if not messages:
        return tokenizer(prompt).input_ids
    try:
        from services.target.server.chat import chat_prompt_ids  # the target's own rendering
        return chat_prompt_ids(tokenizer, messages)
    except Exception:
        return None


@lru_cache(maxsize=16)
def _load_tokenizer(model: str, model_cache: str):
    """The tokenizer of a pool's model directory, or None (never prepares or downloads a model)."""
    from services.common.models.prepare import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME
    path = Path(model_cache).expanduser() / DEFAULT_MODEL_NAME if model in DEFAULT_MODEL_ALIASES \
        else Path(model).expanduser()
    try:
        from transformers import AutoTokenizer

        from services.common.models.chat_templates import apply_chat_template_setting
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        apply_chat_template_setting(tokenizer)  # as the target renders chat (its default)
        return tokenizer
    except Exception as exc:  # missing directory or files: serve without one
        log.warning("pool model %s: no tokenizer at %s (%s); token counts are estimated and "
                    "replica choice ignores cached prefixes", model, path, exc)
        return None
