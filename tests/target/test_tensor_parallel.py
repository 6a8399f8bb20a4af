"""A tensor-parallel target (services/target/tp/): two ranks, two processes over gloo, tiny fp32
models through a real target gRPC server.

  * its greedy output is token for token one rank's, for the lean Gemma 3 and Llama forwards,
    plain, with a prefix-cache hit (the second request's prompt is cached), with two samples of one
    prompt (their shared last block copied on write, on every rank) and under speculation (another
    tiny model's dynamic trees: verify rows, and accepted side branches whose KV moves into place
    on every rank);
  * a rank killed fails the requests it was serving with UNAVAILABLE and turns the target's health
    NOT_SERVING, within a bounded time (no collective waits out its timeout on a dead peer);
  * the generic transformers path is refused with a reason, as is a head count the ranks cannot split.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import ServerConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from services.target.model.model_runner import load_model
from services.target.model.step_plan import BLOCKS, SLOTS
from services.target.server.app import build_target_server
from specmesh.proto.v1 import common_pb2, target_service_pb2, target_service_pb2_grpc
from tests.mesh import start_draft

PROMPTS = ["the cat sat on the mat. the cat sat on the", "Once upon a time", "1 2 3 4 5 6 7 8 1 2 3"]
SHARED = "a shared system prompt that every request starts with, long enough for blocks: "
TREE = common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_DYNAMIC_TREE, max_depth=3, max_nodes=8)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread per rank (rank 0 is this process; the others copy its count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, tiny_llama_dir, tiny_gemma_dir):
    """Each target with seeded noise on its weights: a draft that agrees often but not always, so
    the target accepts side branches of its trees now and then."""
    from transformers import AutoModelForCausalLM
    dirs = {}
    for arch, target_dir in (("llama", tiny_llama_dir), ("gemma3", tiny_gemma_dir)):
        draft_dir = tmp_path_factory.mktemp(f"draft-{arch}") / "model"
        shutil.copytree(target_dir, draft_dir)
        model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, param in sorted(model.named_parameters()):
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
        model.save_pretrained(draft_dir)
        dirs[arch] = draft_dir
    return dirs


@contextlib.asynccontextmanager
async def _target(model_dir, tensor_parallel: int, draft_address: str = "", kv_dtype: str = "auto"):
    config = EngineConfig(model_dir=model_dir, dtype="float32", tensor_parallel=tensor_parallel, num_blocks=256,
                          block_size=4, kv_host_bytes=0, draft_address=draft_address, draft_timeout_s=10.0,
                          kv_dtype=kv_dtype)
    engine = await asyncio.to_thread(Engine.load, config)
    server = build_target_server(ServerConfig(port=0), engine, "tiny")
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        if draft_address:
            for _ in range(500):
                if engine.speculator.client.connected:
                    break
                await asyncio.sleep(0.02)
        yield server, target_service_pb2_grpc.TargetServiceStub(channel), channel
    finally:
        await channel.close()
        await server.stop(0.1)


def _request(request_id: str, prompt: str, max_tokens: int = 12, plan=None, n: int = 1):
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id=request_id, prompt=prompt, tenant_salt="tenant",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, n=n), speculation=plan)


async def _generate(stub, request) -> tuple[list[list[int]], common_pb2.Usage]:
    """Each sample's tokens, and the request's usage."""
    ids, usage = [[] for _ in range(max(request.sampling.n, 1))], None
    async for response in stub.Generate(request, timeout=120):
        ids[response.chunk.index].extend(response.chunk.token_ids)
        if response.chunk.HasField("usage"):
            usage = response.chunk.usage
    return ids, usage


def _count_copies(runner) -> dict:
    """Counts the KV copies rank 0 runs (and sends the other ranks with the next plan), by kind."""
    counts = {BLOCKS: 0, SLOTS: 0}
    copy_kv = runner.copy_kv

    def counted(copy):
        counts[copy.kind] += 1
        copy_kv(copy)
    runner.copy_kv = counted
    return counts


async def _outputs(model_dir, tensor_parallel: int, draft_address: str) -> dict:
    """Per case: the greedy tokens, and the usage counters that show what ran."""
    out = {}
    async with _target(model_dir, tensor_parallel, draft_address) as (server, stub, _channel):
        copies = _count_copies(server.target_service.engine.runner)
        for i, prompt in enumerate(PROMPTS):
            out[f"plain-{i}"] = await _generate(stub, _request(f"plain-{i}", prompt))
        for i, prompt in enumerate(PROMPTS[:2]):  # the second's shared prefix is a prefix-cache hit
            out[f"prefix-{i}"] = await _generate(stub, _request(f"prefix-{i}", SHARED + prompt))
        out["samples"] = await _generate(stub, _request("samples", PROMPTS[1], n=2))
        for i, prompt in enumerate(PROMPTS):
            out[f"tree-{i}"] = await _generate(stub, _request(f"tree-{i}", prompt, 24, TREE))
    return out, copies


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_two_ranks_generate_what_one_rank_generates(arch, tiny_llama_dir, tiny_gemma_dir, draft_dirs):
    model_dir = {"llama": tiny_llama_dir, "gemma3": tiny_gemma_dir}[arch]
    draft = await start_draft(draft_dirs[arch])
    try:
        one, _ = await _outputs(model_dir, 1, draft.address)
        two, copies = await _outputs(model_dir, 2, draft.address)
    finally:
        await draft.stop(grace=0.1)
    assert {case: ids for case, (ids, _) in two.items()} == {case: ids for case, (ids, _) in one.items()}
    assert all(len(sample) > 0 for ids, _ in one.values() for sample in ids)
    assert copies[BLOCKS] > 0 and copies[SLOTS] > 0  # both kinds of KV copy reached the other rank
    assert two["prefix-1"][1].cached_prompt_tokens >= 16  # the shared prefix's blocks came from the cache
    assert two["prefix-1"][1].cached_prompt_tokens == one["prefix-1"][1].cached_prompt_tokens
    verified = [usage for case, (_, usage) in two.items() if case.startswith("tree")]
    assert sum(u.verify_passes for u in verified) > 0 and sum(u.accepted_tokens for u in verified) > 0
    assert [u.accepted_tokens for u in verified] == [one[f"tree-{i}"][1].accepted_tokens for i in range(3)]


@pytest.mark.parametrize("arch, overrides", [("qwen2", {"num_key_value_heads": 2}), ("qwen3", {}), ("mistral", {})])
async def test_the_rest_of_the_llama_family_splits_too(arch, overrides, tmp_path):
    """Qwen2's q/k/v biases cut with their columns, Qwen3's per-head q/k norms and head_dim * heads
    != hidden, Mistral's sliding window on every layer (seeded vectors: a bias or norm cut wrongly
    changes the logits)."""
    from services.common.models.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, seed=3, **overrides)
    outputs = []
    for tensor_parallel in (1, 2):
        async with _target(model_dir, tensor_parallel) as (_, stub, _channel):
            outputs.append([(await _generate(stub, _request(f"{arch}-{i}", prompt, 16)))[0]
                            for i, prompt in enumerate([*PROMPTS, SHARED + PROMPTS[0]])])
    assert outputs[1] == outputs[0] and all(ids[0] for ids in outputs[0])


async def test_two_ranks_with_fp8_kv_generate_what_one_rank_generates(tiny_gemma_dir):
    """fp8 KV scales are per head, so each rank's shard quantizes its heads as one rank does."""
    outputs = []
    for tensor_parallel in (1, 2):
        async with _target(tiny_gemma_dir, tensor_parallel, kv_dtype="fp8") as (_, stub, _channel):
            outputs.append([(await _generate(stub, _request(f"fp8-{i}", SHARED + prompt)))[0]
                            for i, prompt in enumerate(PROMPTS)])
    assert outputs[1] == outputs[0] and all(ids[0] for ids in outputs[0])


async def _health(channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def test_a_killed_rank_fails_its_requests_unavailable_and_the_target_not_serving(tiny_llama_dir):
    async with _target(tiny_llama_dir, 2) as (server, stub, channel):
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        calls = [stub.Generate(_request(f"live-{i}", PROMPTS[i], max_tokens=400), timeout=60) for i in range(2)]
        for call in calls:
            await call.read()  # both are streaming
        killed = time.monotonic()
        follower = server.target_service.engine.ranks.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
            assert "tensor-parallel rank lost" in info.value.details()
        while await _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - killed < 10, "health still SERVING 10 s after a rank died"
            await asyncio.sleep(0.05)
        assert server.engine_failed.is_set()  # what `specmesh serve target` exits on (for a restart)
        with pytest.raises(grpc.aio.AioRpcError) as later:
            await _generate(stub, _request("later", "hello"))
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_an_idle_target_turns_not_serving_when_a_rank_dies(tiny_llama_dir):
    async with _target(tiny_llama_dir, 2) as (server, stub, channel):
        assert (await _generate(stub, _request("warm", "hello", 4)))[0][0]
        server.target_service.engine.ranks.procs[0].kill()
        killed = time.monotonic()
        while await _health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - killed < 10, "an idle target missed its dead rank"
            await asyncio.sleep(0.05)


class _Rank:
    """A one-rank stand-in for load_model's `tp` argument: only rank and world are read when cutting."""

    def __init__(self, world: int) -> None:
        self.rank, self.world = 0, world


def test_the_generic_path_and_uneven_heads_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="lean forwards only"):
        load_model(tiny_llama_dir, torch.float32, fuse=False, tp=_Rank(2))
    with pytest.raises(ValueError, match="must divide num_attention_heads 4, num_key_value_heads 2"):
        load_model(tiny_llama_dir, torch.float32, tp=_Rank(3))


def test_the_setting_reaches_the_engine_from_flag_and_environment(tiny_llama_dir):
    from services.builders import engine_config
    from services.settings import read_settings
    assert engine_config(read_settings({}, tensor_parallel=2), tiny_llama_dir).tensor_parallel == 2
    assert engine_config(read_settings({"SPECMESH_TENSOR_PARALLEL": "4"}), tiny_llama_dir).tensor_parallel == 4
    assert engine_config(read_settings({}), tiny_llama_dir).tensor_parallel == 1
    with pytest.raises(ValueError, match="tensor_parallel"):
        EngineConfig(model_dir=tiny_llama_dir, tensor_parallel=0)
