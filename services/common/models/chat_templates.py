"""Chat templates: Gemma 3's, the `--chat-template FILE|NAME` setting, and what a template
says about turns.

GEMMA3_CHAT_TEMPLATE is Gemma 3's published template (google/gemma-3-270m-it's
tokenizer_config.json); the tiny chat test models use it. The packaged default model is the
pretrained base Gemma 3 270M, whose GGUF carries no template but whose vocabulary has Gemma's
turn tokens: `apply_chat_template_setting` gives such a model Gemma's template, so chat works
out of the box (the base model was not instruction-tuned on it, so its answers are those of a
base model in a chat frame: see README, Chat).
"""

from __future__ import annotations

from pathlib import Path

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
CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}  # --chat-template NAME
NO_TEMPLATE = "none"  # --chat-template none: plain prompts only, whatever the model ships
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def apply_chat_template_setting(tokenizer, setting: str = "") -> str:
    """Sets `tokenizer.chat_template` from the `chat_template` setting and says where it came from.

    "" = the model's own; a model without one whose vocabulary has Gemma's turn tokens as single
    tokens gets Gemma 3's. A NAME from CHAT_TEMPLATES, "none", or a FILE: Jinja text, or JSON
    holding "chat_template" (a tokenizer_config.json). ValueError for an unknown name or a file
    that cannot be read."""
    if setting == NO_TEMPLATE:
        tokenizer.chat_template = None
        return "none"
    if setting in CHAT_TEMPLATES:
        tokenizer.chat_template = CHAT_TEMPLATES[setting]
        return setting
    if setting:
        tokenizer.chat_template = _template_file(setting)
        return setting
    if getattr(tokenizer, "chat_template", None):
        return "the model's own"
    if _has_gemma_turn_tokens(tokenizer):
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
        return "gemma3 (the vocabulary has Gemma's turn tokens)"
    return "none (the model has no chat template)"


def _template_file(setting: str) -> str:
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {setting!r} is neither a file nor one of "
                         f"{sorted(CHAT_TEMPLATES) + [NO_TEMPLATE]}")
    text = path.read_text()
    if path.suffix == ".json":
        import json
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"chat_template file {setting!r} has no \"chat_template\" string: {exc}") from None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"chat_template file {setting!r} holds no template")
    return text


def _has_gemma_turn_tokens(tokenizer) -> bool:
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in GEMMA_TURN_TOKENS:
        ids = tokenizer(token, add_special_tokens=False).input_ids
        if len(ids) != 1 or ids[0] == unk:
            return False
    return True


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
