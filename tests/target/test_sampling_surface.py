"""Log-probabilities, penalties, logit bias and min_tokens through real servers (tiny models),
without speculation, with a draft chain and with draft trees.

References are computed here from the definitions: one fp32 forward of the tiny model over
prompt + output (Hugging Face, not the engine), then the per-row reference processors of
tests/target/test_logits_processors.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import details_of
from services.common.sampling_params import SamplingConfig, sampling_from_proto
from services.target.model.sampler import target_probs
from specmesh.proto.v1 import common_pb2
from tests.mesh import AUTH_A, collect, request, start_draft, start_mesh
from tests.target.test_logits_processors import reference_logits

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the meshes are shared by the module
PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat",
           "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4",
           "Once upon a time"]
MESHES = ["plain", "chain", "tree"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def meshes(tiny_llama_dir):
    """No speculation; a draft model's chains (depth 3); dynamic draft trees (depth 3, 8 nodes).
    The draft model is the target itself: its proposals are the raw greedy tokens, so many are
    accepted, and penalties, bias and sampling still reject some (the bonus after a rejection)."""
    draft = await start_draft(tiny_llama_dir)
    started = {"plain": await start_mesh(tiny_llama_dir),
               "chain": await start_mesh(tiny_llama_dir, draft_address=draft.address, speculation={
                   "speculation_method": "draft_model", "speculation_depth": 3}),
               "tree": await start_mesh(tiny_llama_dir, draft_address=draft.address, speculation={
                   "speculation_method": "dynamic_tree", "speculation_depth": 3, "speculation_nodes": 8})}
    try:
        yield started
    finally:
        for mesh in started.values():
            await mesh.stop()
        await draft.stop(grace=0.5)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference_rows(hf_model, prompt_ids: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] fp32 logits that chose each output token (one HF forward)."""
    ids = torch.tensor([prompt_ids + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()  # [len(ids), vocab]
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(output)]


def reference_logprobs(raw: torch.Tensor, history: list[int], num_prompt: int, config: SamplingConfig,
                       eos: set[int]) -> torch.Tensor:
    """raw: [vocab] -> log-probabilities of the distribution sampled from (or the raw model's)."""
    if config.raw_logprobs:
        return torch.log_softmax(raw.double(), -1)
    processed = reference_logits(raw, history, num_prompt, config, eos).float()
    if config.greedy:
        return torch.log_softmax(processed.double(), -1)
    return torch.log(target_probs(processed[None], config)[0]).double()


def reference_greedy(hf_model, prompt_ids: list[int], config: SamplingConfig, eos: set[int]) -> list[int]:
    output: list[int] = []
    while len(output) < config.max_tokens:
        raw = reference_rows(hf_model, prompt_ids, output + [0])[-1]  # the row after the last token
        token = int(reference_logits(raw, prompt_ids + output, len(prompt_ids), config, eos).argmax())
        output.append(token)
        if token in eos:
            break
    return output


async def generate(mesh, prompt: str, max_tokens: int, **sampling) -> tuple[list[int], list, common_pb2.GenerateChunk]:
    ids, logprobs, last = [], [], None
    async for response in mesh.router_stub.Generate(request(prompt, max_tokens, **sampling), metadata=AUTH_A):
        ids.extend(response.chunk.token_ids)
        logprobs.extend(response.chunk.logprobs)
        last = response.chunk
    return ids, logprobs, last


LOGPROB_SETTINGS = {
    "greedy": dict(logprobs=True, top_logprobs=5),
    "sampled": dict(temperature=0.8, top_k=50, top_p=0.9, seed=3, has_seed=True, presence_penalty=0.5,
                    frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={10: 2.0, 11: -3.0},
                    logprobs=True, top_logprobs=5),
    "raw": dict(temperature=0.9, seed=5, has_seed=True, presence_penalty=1.0, logprobs=True,
                top_logprobs=3, raw_logprobs=True),
}


@pytest.mark.parametrize("setting", sorted(LOGPROB_SETTINGS))
@pytest.mark.parametrize("which", MESHES)
async def test_logprobs_equal_an_fp32_recomputation(meshes, hf_model, which, setting):
    mesh = meshes[which]
    eos = set(mesh.engine.spec.eos_token_ids)
    accepted = 0
    for prompt in PROMPTS:
        params = LOGPROB_SETTINGS[setting]
        ids, logprobs, last = await generate(mesh, prompt, 16, **params)
        config = sampling_from_proto(common_pb2.SamplingParams(max_tokens=16, **params))
        prompt_ids = mesh.engine.tokenize(prompt)
        assert [lp.token_id for lp in logprobs] == ids and len(ids) == last.usage.completion_tokens
        rows = reference_rows(hf_model, prompt_ids, ids)
        for j, (token, lp) in enumerate(zip(ids, logprobs)):
            want = reference_logprobs(rows[j], prompt_ids + ids[:j], len(prompt_ids), config, eos)
            assert lp.logprob == pytest.approx(float(want[token]), abs=2e-4), (prompt, j)
            top = [(t.token_id, t.logprob) for t in lp.top]
            assert len(top) == config.top_logprobs
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert [v for _, v in top] == pytest.approx(want.topk(len(top)).values.tolist(), abs=2e-4)
            assert all(v == pytest.approx(float(want[t]), abs=2e-4) for t, v in top)
            assert lp.logprob <= top[0][1] + 1e-6
            assert lp.token == mesh.engine.tokenizer.decode([token], skip_special_tokens=False)
        accepted += last.usage.accepted_tokens
    if which != "plain":
        assert accepted > 0, "no accepted draft token carried a log-probability"


GREEDY_SETTINGS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "bias": dict(logit_bias={20: 3.0, 35: 2.5, 9: -50.0}),
    "min_tokens": dict(min_tokens=20, logit_bias={2: 8.0}),  # EOS (2) likely, masked until 20
    "all": dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.8,
                logit_bias={7: 1.0}, min_tokens=3),
}


@pytest.mark.parametrize("setting", sorted(GREEDY_SETTINGS))
async def test_greedy_with_penalties_and_bias_equals_the_reference_with_and_without_speculation(
        meshes, hf_model, setting):
    params = GREEDY_SETTINGS[setting]
    config = sampling_from_proto(common_pb2.SamplingParams(max_tokens=24, **params))
    eos = set(meshes["plain"].engine.spec.eos_token_ids)
    proposed = 0
    for prompt in PROMPTS:
        want = reference_greedy(hf_model, meshes["plain"].engine.tokenize(prompt), config, eos)
        plain = await generate(meshes["plain"], prompt, 24, **params)
        assert plain[0] == want, (setting, prompt)
        for which in ("chain", "tree"):
            ids, _, last = await generate(meshes[which], prompt, 24, **params)
            assert ids == want, (setting, which, prompt)
            proposed += last.usage.proposed_tokens
    assert proposed > 0


@pytest.mark.parametrize("which", MESHES)
async def test_min_tokens_never_ends_early(meshes, which):
    mesh = meshes[which]
    eos = next(iter(sorted(mesh.engine.spec.eos_token_ids)))
    for prompt in PROMPTS:
        ids, _, last = await generate(mesh, prompt, 16, min_tokens=6, logit_bias={eos: 100.0})
        assert len(ids) == 7 and ids[-1] == eos and last.finish_reason == common_pb2.FINISH_REASON_STOP
        assert all(t not in mesh.engine.spec.eos_token_ids for t in ids[:6])
        # A stop sequence that matches at once ends the answer only once min_tokens are out.
        _, text, _ = await collect(mesh.router_stub, request(prompt, 16))
        stop = text[:2]
        early = await collect(mesh.router_stub, request(prompt, 16, stop=[stop]))
        assert early[2].finish_reason == common_pb2.FINISH_REASON_STOP_SEQUENCE
        assert early[2].usage.completion_tokens < 10
        late = await collect(mesh.router_stub, request(prompt, 16, stop=[stop], min_tokens=10))
        assert late[2].usage.completion_tokens >= 10


async def test_one_requests_settings_never_change_anothers_tokens(meshes):
    for which in MESHES:
        mesh = meshes[which]
        alone = await generate(mesh, PROMPTS[0], 20, logprobs=True)
        others = [dict(logit_bias={5: 100.0}, min_tokens=4), dict(presence_penalty=2.0, repetition_penalty=2.0),
                  dict(frequency_penalty=-2.0, temperature=1.0, seed=1, has_seed=True, logprobs=True,
                       top_logprobs=20)]
        together = await asyncio.gather(generate(mesh, PROMPTS[0], 20, logprobs=True),
                                        *(generate(mesh, PROMPTS[0], 20, **o) for o in others))
        assert together[0][0] == alone[0], which
        assert [lp.logprob for lp in together[0][1]] == pytest.approx([lp.logprob for lp in alone[1]], abs=1e-5)
        assert together[1][0][:4] == [5, 5, 5, 5]  # the bias did apply to its own row


BAD = [
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    (dict(repetition_penalty=-1.0), "sampling.repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "sampling.logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "sampling.logit_bias"),
    (dict(logit_bias={-3: 1.0}), "sampling.logit_bias"),
    (dict(logit_bias={10**6: 1.0}), "sampling.logit_bias"),  # not in the vocabulary: the target says so
    (dict(min_tokens=9), "sampling.min_tokens"),  # above max_tokens
    (dict(logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
    (dict(top_logprobs=3), "sampling.top_logprobs"),  # without logprobs
    (dict(raw_logprobs=True), "sampling.raw_logprobs"),
]


@pytest.mark.parametrize("params,field", BAD, ids=[f for _, f in BAD])
async def test_bad_sampling_input_is_invalid_argument_naming_the_field(meshes, params, field):
    mesh = meshes["chain"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(mesh.router_stub, request("hello", 8, **params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [v.field for v in details_of(info.value)["BadRequest"].field_violations]
    ids, _, last = await collect(mesh.router_stub, request("hello", 4, presence_penalty=1.0))
    assert len(ids) == 4  # still serving
