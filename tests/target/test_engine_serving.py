"""The target at serving scale: prefix cache with tenant salt, preemption, cancellation,
admission control, FP8 KV, fragmentation and KV events — through real gRPC servers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specmesh.proto.v1 import target_service_pb2
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh
from tests.e2e.test_generate import hf_greedy

SHARED_PREFIX = "System: you are a careful assistant. Answer briefly and precisely. " * 3


async def _stats(mesh):
    return await mesh.target_stub().GetStats(target_service_pb2.GetStatsRequest())


async def test_same_tenant_hits_the_prefix_cache_other_tenant_does_not(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    try:
        first = await collect(mesh.router_stub, request(SHARED_PREFIX + "Q1?", 8), metadata=AUTH_A)
        again = await collect(mesh.router_stub, request(SHARED_PREFIX + "Q2?", 8), metadata=AUTH_A)
        other = await collect(mesh.router_stub, request(SHARED_PREFIX + "Q1?", 8), metadata=AUTH_B)
        assert first[2].usage.cached_prompt_tokens == 0
        assert again[2].usage.cached_prompt_tokens > 0
        assert again[2].usage.cached_prompt_tokens % 4 == 0  # whole blocks (block_size 4)
        assert other[2].usage.cached_prompt_tokens == 0
        assert other[0] == first[0]  # same prompt, same greedy tokens, computed afresh
        repeat = await collect(mesh.router_stub, request(SHARED_PREFIX + "Q1?", 8), metadata=AUTH_A)
        assert repeat[0] == first[0]  # a prefix hit does not change the output
        stats = await _stats(mesh)
        assert stats.prefix_hit_tokens == again[2].usage.cached_prompt_tokens + \
            repeat[2].usage.cached_prompt_tokens
    finally:
        await mesh.stop()


async def test_forced_preemption_keeps_greedy_outputs_identical(tiny_llama_dir):
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    expected = [hf_greedy(tiny_llama_dir, p, 40) for p in prompts]
    # 6 sequences of ~60 tokens need ~90 blocks of 4; 40 blocks force preemption.
    mesh = await start_mesh(tiny_llama_dir, num_blocks=40, enable_prefix_caching=False)
    try:
        results = await asyncio.gather(*(collect(mesh.router_stub, request(p, 40)) for p in prompts))
        assert [r[0] for r in results] == expected
        stats = await _stats(mesh)
        assert stats.preemptions > 0
        assert stats.free_blocks == stats.num_blocks
    finally:
        await mesh.stop()


async def test_cancel_10_of_40_streams(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_num_seqs=40, num_blocks=1024)
    prompts = [f"Request {i} asks about topic {i % 7}" for i in range(40)]
    try:
        expected = {i: hf_greedy(tiny_llama_dir, prompts[i], 24) for i in range(40) if i % 4}
        calls = {i: mesh.router_stub.Generate(request(prompts[i], 24 if i % 4 else 200), metadata=AUTH_A)
                 for i in range(40)}

        async def run(i):
            ids = []
            async for response in calls[i]:
                ids.extend(response.chunk.token_ids)
                if i % 4 == 0 and len(ids) >= 3:
                    calls[i].cancel()
                    return None
            return ids
        results = await asyncio.gather(*(run(i) for i in range(40)), return_exceptions=True)
        for i in range(40):
            if i % 4:
                assert results[i] == expected[i], i
        for _ in range(200):
            stats = await _stats(mesh)
            if stats.used_blocks == 0 and not mesh.engine.live_request_ids():
                break
            await asyncio.sleep(0.02)
        assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks
        assert mesh.engine.live_request_ids() == set()
        assert stats.running_requests == 0 and stats.waiting_requests == 0
    finally:
        await mesh.stop()


async def test_overload_gets_resource_exhausted_at_once_and_admitted_calls_complete(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, max_num_seqs=2, max_queued_requests=2)
    try:
        results = await asyncio.gather(*(collect(mesh.router_stub, request(f"prompt {i}", 150))
                                         for i in range(12)), return_exceptions=True)
        rejected = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        completed = [r for r in results if not isinstance(r, BaseException)]
        assert rejected and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in rejected)
        assert all(dict(r.trailing_metadata() or ()).get("grpc-retry-pushback-ms") for r in rejected)
        assert len(completed) >= 4
        assert all(len(r[0]) == 150 for r in completed)
        assert len(completed) + len(rejected) == 12
    finally:
        await mesh.stop()


async def test_request_larger_than_kv_capacity_is_invalid_argument(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, num_blocks=8)  # 32 tokens of KV
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.router_stub, request("hello world", 40))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "KV capacity" in info.value.details()
    finally:
        await mesh.stop()


async def test_kv_events_stream_snapshot_then_stored_and_removed(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, num_blocks=64)
    stub = mesh.target_stub()
    try:
        await collect(mesh.router_stub, request(SHARED_PREFIX, 4))
        stream = stub.SubscribeKVEvents(target_service_pb2.SubscribeKVEventsRequest(after_sequence=0,
                                                                                   snapshot=True))
        first = await stream.read()
        assert first.is_snapshot and len(first.snapshot_blocks) == (await _stats(mesh)).cached_blocks
        seen = first.snapshot_sequence
        # Fill the pool with other prompts so cached blocks get evicted.
        for i in range(6):
            await collect(mesh.router_stub, request(f"{i} other text to fill the pool " * 4, 4))
        kinds = set()
        while "removed" not in kinds:
            message = await asyncio.wait_for(stream.read(), 5)
            for event in message.events:
                assert event.sequence == seen + 1  # no gaps
                seen = event.sequence
                kinds.add(target_service_pb2.KVEventKind.Name(event.kind).rsplit("_", 1)[-1].lower())
        assert kinds == {"stored", "removed"}
        stream.cancel()
        # A subscriber far behind the log's window gets a snapshot first.
        mesh.engine.kv_events._events.popleft()
        late = stub.SubscribeKVEvents(target_service_pb2.SubscribeKVEventsRequest(after_sequence=0))
        assert (await late.read()).is_snapshot
        late.cancel()
    finally:
        await mesh.stop()


def _engine(model_dir, **overrides):
    from services.target.config import EngineConfig
    from services.target.engine.engine import Engine
    config = dict(model_dir=model_dir, dtype="bfloat16", num_blocks=512, block_size=4,
                  max_num_seqs=64, kernels="reference")
    engine = Engine.load(EngineConfig(**{**config, **overrides}))
    engine.start()
    return engine


def _next_tokens(engine, contexts: list[list[int]]) -> list[int]:
    """Greedy next token after each context (one request each, run concurrently)."""
    import threading

    from services.common.sampling_params import SamplingConfig
    out, done = {}, threading.Semaphore(0)
    for i, ids in enumerate(contexts):
        def emit(step, i=i):
            out.setdefault(i, step.token_ids[0]) if step.token_ids else None
            if step.finish_reason is not None:
                done.release()
        engine.submit(f"ctx-{i}", ids, SamplingConfig(max_tokens=1), emit)
    for _ in contexts:
        done.acquire()
    return [out[i] for i in range(len(contexts))]


def test_fp8_kv_matches_bf16_kv_and_halves_kv_bytes(tmp_path):
    from services.common.models.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / "tiny64", arch="llama", seed=3, head_dim=64)
    reference = _engine(model_dir, kv_dtype="bfloat16")  # "auto" is float32 on the CPU
    fp8 = _engine(model_dir, kv_dtype="fp8")
    try:
        prompts = [reference.tokenize(p) for p in
                   ("The quick brown fox", "Once upon a time there was", "1 2 3 4 5 6 7 8")]
        # Random tiny models are chaotic, so compare teacher-forced: the greedy next token after
        # the same context (the bf16-KV run's own output), at every one of 32 positions.
        contexts = []
        for ids in prompts:
            for _ in range(32):
                ids = ids + _next_tokens(reference, [ids])
            contexts += [ids[:len(ids) - 32 + k] for k in range(32)]
        expected = _next_tokens(reference, contexts)
        got = _next_tokens(fp8, contexts)
        agree = sum(a == b for a, b in zip(expected, got)) / len(contexts)
        # Stated bound: at least 80% of next-token choices agree. Measured: 83-89% over three
        # tiny models; bf16 KV against float32 KV agrees 97-99% on the same models. Random tiny
        # models have small logit margins, so e4m3's 3 mantissa bits flip some choices.
        assert agree >= 0.8, agree
        # 1 byte per value plus one float32 scale per token and kv head: (64 + 4) / (2 * 64).
        assert fp8.stats().kv_bytes / reference.stats().kv_bytes == pytest.approx((64 + 4) / 128)
    finally:
        reference.shutdown()
        fp8.shutdown()


async def test_fragmentation_stays_below_4_percent_in_a_mixed_workload(tiny_llama_dir):
    # Waste is at most block_size - 1 slots per sequence; with the tiny model's 512-token context
    # a 4-token block matches what 16-token blocks give on prompts of thousands of tokens.
    mesh = await start_mesh(tiny_llama_dir, num_blocks=1024, block_size=4, max_batched_tokens=256)
    try:
        # Distinct texts (no shared prefix), 100-450 tokens each.
        words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "orbit"]
        prompts = [f"{w} " * n + "end" for w, n in zip(words, (40, 55, 70, 100, 45, 60, 85, 110))]
        tasks = [asyncio.create_task(collect(mesh.router_stub, request(p, 48))) for p in prompts]
        samples = []
        while not all(t.done() for t in tasks):
            stats = await _stats(mesh)
            if stats.used_blocks:
                samples.append(stats.fragmentation)
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert samples
        assert max(samples) < 0.04, max(samples)
    finally:
        await mesh.stop()


def test_run_on_engine_thread_runs_between_steps_while_the_loop_runs(tiny_llama_dir):
    import threading
    engine = _engine(tiny_llama_dir)
    try:
        main = threading.get_ident()
        loop_thread = engine.run_on_engine_thread(threading.get_ident)
        assert loop_thread != main
        assert _next_tokens(engine, [engine.tokenize("hello")])  # still serving afterwards
    finally:
        engine.shutdown()


def test_a_request_id_already_in_flight_is_rejected_and_changes_nothing(tiny_llama_dir):
    import threading

    from services.common.sampling_params import SamplingConfig
    from services.target.engine.engine import InvalidRequest
    engine = _engine(tiny_llama_dir)
    done = threading.Event()
    try:
        ids = engine.tokenize("hello there")
        engine.submit("same", ids, SamplingConfig(max_tokens=50),
                      lambda out: done.set() if out.finish_reason is not None else None)
        with pytest.raises(InvalidRequest):
            engine.submit("same", ids, SamplingConfig(max_tokens=5), lambda out: None)
        assert done.wait(30)
        engine.submit("same", ids, SamplingConfig(max_tokens=2), lambda out: None)  # free again
    finally:
        engine.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_llama_dir):
    import threading

    from services.common.sampling_params import SamplingConfig
    engine = _engine(tiny_llama_dir)
    forward = engine.runner.forward
    calls = {"n": 0}

    def failing_once(inputs, **kwargs):  # kwargs: vocab_subsets (greedy rows: the argmax screen)
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return forward(inputs, **kwargs)
    engine.runner.forward = failing_once
    errors, done = [], threading.Event()
    try:
        def emit(out):
            if out.finish_reason is not None or out.error is not None:
                errors.append(out.error)
                done.set()
        engine.submit("doomed", engine.tokenize("hello"), SamplingConfig(max_tokens=4), emit)
        assert done.wait(30)
        assert isinstance(errors[0], RuntimeError)
        assert engine.stats().used_blocks == 0 and engine.live_request_ids() == set()
        assert _next_tokens(engine, [engine.tokenize("hello")])  # still serving
    finally:
        engine.shutdown()
