"""Chat on the default model out of the box (slow: loads Gemma 3 270M): its checkpoint carries no
chat template, the target gives it Gemma 3's (its vocabulary has Gemma's turn tokens), and the
`openai` client's chat completion answers; structured outputs and a forced tool call parse."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
import pytest_asyncio

from services.settings import read_settings
from services.common.models.prepare import prepare_default_model
from services.gateway.app import Gateway, GatewayConfig
from tests.mesh import TOKEN_A, start_mesh

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    settings = read_settings()
    model_dir = prepare_default_model(Path(settings.model_cache).expanduser() / "gemma-3-270m", progress=False)
    # weights="none": torch's own linears, so the test needs no compiled kernel module.
    mesh = await start_mesh(model_dir, dtype="bfloat16", num_blocks=512, block_size=16, max_batched_tokens=512,
                            weights="none")
    gateway = Gateway(GatewayConfig(port=0, router_address=mesh.router.address))
    await gateway.start()
    client = openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key=TOKEN_A, max_retries=0)
    try:
        yield mesh, client
    finally:
        await client.close()
        await gateway.stop()
        await mesh.stop()


async def test_chat_completion_answers_on_the_default_model(client):
    mesh, client = client
    assert mesh.engine.tokenizer.chat_template  # given Gemma 3's at load
    answer = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=32, temperature=0)
    choice = answer.choices[0]
    print(f"answer: {choice.message.content!r} ({choice.finish_reason})")
    assert choice.message.content.strip() and "<start_of_turn>" not in choice.message.content
    assert answer.usage.prompt_tokens > 10  # the turn frame around the question


async def test_structured_outputs_on_the_default_model(client):
    _, client = client
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    answer = await client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    print(f"json: {answer.choices[0].message.content!r}")
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    tool = {"type": "function", "function": {"name": "get_capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "maxLength": 20}},
        "required": ["country"], "additionalProperties": False}}}
    answer = await client.chat.completions.create(model="default", messages=QUESTION, max_tokens=60, temperature=0,
                                                  tools=[tool], tool_choice="required", parallel_tool_calls=False)
    call = answer.choices[0].message.tool_calls[0]
    print(f"tool call: {call.function.name} {call.function.arguments}")
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_capital"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
