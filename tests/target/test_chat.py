"""Chat through the mesh: messages are rendered with the model's own chat template and the
answer stops at the template's end-of-turn token, token for token like transformers'
`apply_chat_template` + `generate`."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.models.chat_templates import end_of_turn_ids
from services.common.models.tiny import TINY_VOCAB_SIZE, build_tiny_model
from specmesh.proto.v1 import common_pb2, router_service_pb2
from tests.mesh import collect, start_mesh

END_OF_TURN = TINY_VOCAB_SIZE + 1
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Count to ten."},
     {"role": "assistant", "content": "one, two, three"},
     {"role": "user", "content": "Go on."}],
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny chat model whose greedy answer to CONVERSATIONS[0] ends with <end_of_turn>:
    the LM head row of <end_of_turn> is made a scaled copy of the row of the answer's
    sixth token, so the model prefers ending its turn where it would have said that token."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-chat"), arch="llama", seed=3, chat=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sixth = hf_chat(model_dir, CONVERSATIONS[0], 8, model=model)[5]
    with torch.no_grad():
        model.lm_head.weight[END_OF_TURN] = model.lm_head.weight[sixth] * 1.5
    model.save_pretrained(model_dir)
    return model_dir


def hf_chat(model_dir, messages, max_new_tokens, model=None) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = model or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def chat_request(messages, max_tokens=24) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(**m) for m in messages],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def test_end_of_turn_token_comes_from_the_template(chat_dir, tiny_llama_dir):
    assert end_of_turn_ids(AutoTokenizer.from_pretrained(chat_dir)) == {END_OF_TURN}
    assert end_of_turn_ids(AutoTokenizer.from_pretrained(tiny_llama_dir)) == frozenset()  # no template


async def test_chat_equals_apply_chat_template_and_generate(chat_dir):
    mesh = await start_mesh(chat_dir)
    try:
        for messages in CONVERSATIONS:
            ids, text, last = await collect(mesh.router_stub, chat_request(messages))
            assert ids == hf_chat(chat_dir, messages, 24), messages
        # The first answer ends its turn: the mesh stops at <end_of_turn>, as generate does.
        ids, _, last = await collect(mesh.router_stub, chat_request(CONVERSATIONS[0]))
        assert ids[-1] == END_OF_TURN and len(ids) < 24
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP
        tokenizer = AutoTokenizer.from_pretrained(chat_dir)
        prompt_ids = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
        assert last.usage.prompt_tokens == len(prompt_ids)
    finally:
        await mesh.stop()


async def test_bad_chat_requests_are_invalid_argument(chat_dir, tiny_llama_dir):
    mesh = await start_mesh(chat_dir)
    try:
        both = chat_request(CONVERSATIONS[0])
        both.prompt = "hello"
        alternating = chat_request([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        for req, details in [(both, "set prompt or messages, not both"),
                             (chat_request([{"role": "user", "content": " "}]), "messages are empty"),
                             (alternating, "Conversation roles must alternate")]:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(mesh.router_stub, req)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert details in exc.value.details()
    finally:
        await mesh.stop()
    plain = await start_mesh(tiny_llama_dir)  # a model without a chat template
    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await collect(plain.router_stub, chat_request(CONVERSATIONS[0]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "this model has no chat template; send a plain prompt instead" in exc.value.details()
    finally:
        await plain.stop()


async def run_cli(*argv) -> tuple[int, str, str]:
    import asyncio
    import sys
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.cli", *argv,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_cli_generate_sends_chat_and_falls_back_for_a_base_model(chat_dir, tiny_llama_dir):
    question = CONVERSATIONS[0][0]["content"]
    for model_dir, messages in ((chat_dir, CONVERSATIONS[0]), (tiny_llama_dir, None)):
        mesh = await start_mesh(model_dir)
        try:
            req = chat_request(messages, max_tokens=6) if messages else router_service_pb2.GenerateRequest(
                prompt=question, sampling=common_pb2.SamplingParams(max_tokens=6))
            _, expected, _ = await collect(mesh.router_stub, req)
            code, out, err = await run_cli("generate", question, "--address", mesh.router.address,
                                           "--token", "token-a", "--max-tokens", "6")
        finally:
            await mesh.stop()
        assert code == 0, err
        assert out == expected + "\n"
        assert ("no chat template" in err) == (messages is None)
