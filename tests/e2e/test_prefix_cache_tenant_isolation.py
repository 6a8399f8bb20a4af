"""Another tenant's repeat of a prompt is not faster than a fresh prompt, while the
same tenant's repeat is (the positive control).

"Faster" is measured as work, not wall-clock (no test asserts a wall-clock time): the prefill tokens
the engine computes (prefix-cache query tokens minus hit tokens, from GetStats) and the
`cached_prompt_tokens` the caller sees. Time to first token follows the computed prefill
tokens, so equal work means no timing side channel from the prefix cache.
"""

from __future__ import annotations

from specmesh.proto.v1 import target_service_pb2
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh

PROMPT = "The quarterly report of a confidential project says that the numbers are " * 4
FRESH = "A completely different text about gardens, rivers and long summer evenings " * 4


async def _prefill_work(mesh, req, metadata) -> tuple[int, int]:
    """(prefill tokens the engine computed, cached_prompt_tokens reported) for one request."""
    stub = mesh.target_stub()
    before = await stub.GetStats(target_service_pb2.GetStatsRequest())
    _, _, last = await collect(mesh.router_stub, req, metadata=metadata)
    after = await stub.GetStats(target_service_pb2.GetStatsRequest())
    computed = ((after.prefix_query_tokens - before.prefix_query_tokens)
                - (after.prefix_hit_tokens - before.prefix_hit_tokens))
    return computed, last.usage.cached_prompt_tokens


async def test_another_tenants_repeat_does_as_much_prefill_work_as_a_fresh_prompt(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        prompt_tokens = len(mesh.engine.tokenize(PROMPT))
        assert len(mesh.engine.tokenize(FRESH)) > 0
        first = await _prefill_work(mesh, request(PROMPT, 2), AUTH_A)
        assert first == (prompt_tokens, 0)
        other_repeat = await _prefill_work(mesh, request(PROMPT, 2), AUTH_B)
        other_fresh = await _prefill_work(mesh, request(FRESH, 2), AUTH_B)
        same_repeat = await _prefill_work(mesh, request(PROMPT, 2), AUTH_A)
        # Tenant B's repeat of A's prompt: every token computed, nothing reported cached,
        # exactly like a prompt nobody sent before.
        assert other_repeat == (prompt_tokens, 0)
        assert other_fresh == (len(mesh.engine.tokenize(FRESH)), 0)
        # Positive control: A's own repeat reuses all whole blocks but the last token's.
        block = mesh.engine.blocks.block_size
        cached = (prompt_tokens - 1) // block * block
        assert cached > 0
        assert same_repeat == (prompt_tokens - cached, cached)
    finally:
        await mesh.stop()
