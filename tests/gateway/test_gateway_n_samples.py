"""`n` samples through the official `openai` client: chat and completions, streaming and not —
one choice per sample with its index, each equal to a one-sample request seeded with seed + index;
usage counts the prompt once; n over the limit is a 400 naming `n`."""

from __future__ import annotations

import openai
import pytest


pytestmark = pytest.mark.asyncio(loop_scope="module")  # one mesh for the module
QUESTION = [{"role": "user", "content": "Tell me a story about the sea."}]
PROMPT = "The lighthouse keeper looked at the sea and"
SEED = 11


async def test_chat_n3_streaming_and_not(client):
    args = dict(model="default", messages=QUESTION, max_tokens=8, temperature=1.0)
    alone = [await client.chat.completions.create(**args, seed=SEED + i) for i in range(3)]

    full = await client.chat.completions.create(**args, seed=SEED, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.message.content for c in full.choices] == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in full.choices] == [a.choices[0].finish_reason for a in alone]
    assert full.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt once
    assert full.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    stream = await client.chat.completions.create(**args, seed=SEED, n=3, stream=True,
                                                  stream_options={"include_usage": True})
    events = [event async for event in stream]
    content, finish, roles, order = {}, {}, {}, []
    for event in events:
        for choice in event.choices:
            order.append(choice.index)
            roles.setdefault(choice.index, choice.delta.role)  # the first event of each choice
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert [content[i] for i in range(3)] == [c.message.content for c in full.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in full.choices]
    assert order != sorted(order)  # interleaved by index, not one choice after the other
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == full.usage.completion_tokens


async def test_completions_n3_streaming_and_not(client):
    args = dict(model="default", prompt=PROMPT, max_tokens=8, temperature=1.0)
    alone = [await client.completions.create(**args, seed=SEED + i) for i in range(3)]

    full = await client.completions.create(**args, seed=SEED, n=3)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.text for c in full.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in full.choices}) > 1  # three samples, not one answer three times
    assert full.usage.prompt_tokens == alone[0].usage.prompt_tokens

    stream = await client.completions.create(**args, seed=SEED, n=3, stream=True)
    text, finish = {}, {}
    async for event in stream:
        for choice in event.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert [text[i] for i in range(3)] == [c.text for c in full.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in full.choices]


@pytest.mark.parametrize("n", [17, 0, 1.5])
async def test_bad_n_is_a_400_naming_n(client, n):
    for call in (lambda: client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4, n=n),
                 lambda: client.completions.create(model="default", prompt=PROMPT, max_tokens=4, n=n)):
        with pytest.raises(openai.BadRequestError) as exc:
            await call()
        assert exc.value.status_code == 400 and exc.value.body["param"] == "n", exc.value.body
    ok = await client.completions.create(model="default", prompt=PROMPT, max_tokens=4, n=2)
    assert len(ok.choices) == 2  # still serving
