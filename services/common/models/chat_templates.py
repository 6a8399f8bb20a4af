"""Gemma 3's chat template, and what a chat template says about turns.

GEMMA3_CHAT_TEMPLATE is Gemma 3's published template (google/gemma-3-270m-it's
tokenizer_config.json); the tiny chat test models use it. The packaged default model is
the pretrained base Gemma 3 270M, whose GGUF carries no template, and it is deliberately
not given this one: the base model was not trained on it and answers worse with it.
"""

from __future__ import annotations

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

_PROBE = "specmesh-end-of-turn-probe"


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The special token that closes an assistant turn in the tokenizer's chat template
    (`<end_of_turn>` for Gemma, `<|im_end|>` for ChatML, `<eos>` for templates that end
    turns with it); empty when there is no template or it closes turns with plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return frozenset()
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], tokenize=False)
    except Exception:  # a template that refuses this shape says nothing about its turns
        return frozenset()
    _, found, after = text.partition(_PROBE)
    if not found:
        return frozenset()
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for token_id in tokenizer(after, add_special_tokens=False).input_ids:
        if token_id in special:
            return frozenset([token_id])
        if tokenizer.decode([token_id]).strip():
            break  # visible text before any special token: no end-of-turn token
    return frozenset()
