"""Chat requests: messages rendered with the model's own chat template into prompt ids."""

from __future__ import annotations

MAX_MESSAGES = 1024  # per request; the router's size limits apply to the contents


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refuses them)."""


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Prompt ids of `messages` (ChatMessage protos or role/content dicts), generation prompt
    added: exactly what `tokenizer.apply_chat_template(..., add_generation_prompt=True)` gives."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"{len(messages)} messages is above the limit {MAX_MESSAGES}")
    turns = [_as_dict(m) for m in messages]
    for turn in turns:
        if not turn["role"]:
            raise ChatTemplateError("every message needs a role (system, user or assistant)")
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
    except Exception as exc:  # jinja's TemplateError, raise_exception(...) in the template
        raise ChatTemplateError(f"the model's chat template refused the messages: {exc}") from None
    return list(encoded["input_ids"])


def _as_dict(message) -> dict[str, str]:
    if isinstance(message, dict):
        return {"role": message.get("role", ""), "content": message.get("content", "")}
    return {"role": message.role, "content": message.content}
