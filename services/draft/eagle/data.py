"""Training data for the feature head: the target's own continuations of a prompt set, with its
last-layer features and its next-token distribution at every position.

Offline and reproducible: the built-in prompt set (open text: chat, questions, stories,
explanations) is drawn with the seed, or a file of prompts is given; each prompt gets the
target's greedy continuation or (for `sampled_share` of them) one sampled at `temperature`
with a per-prompt seed. One teacher-forced pass over prompt + continuation then records, per
position j, the feature f_j (after the final norm, as the serving target sends it) and the
target's top-`label_top_k` distribution of token j + 1 (renormalised: soft labels).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from services.draft.eagle.target_parts import TargetParts

_SUBJECTS = ("the ocean", "a small town", "friendship", "the moon", "an old library", "rain", "a robot",
             "bread", "mountains", "a lost key", "music", "winter", "a river", "the stars", "a garden",
             "a train journey", "honey bees", "a lighthouse", "chess", "a market")
_FORMS = ("Tell me a short story about {}.", "Write a poem about {}.", "Explain {} to a child.",
          "What is interesting about {}?", "Describe {} in a few sentences.",
          "Why do people like {}?", "Give me three facts about {}.", "Write a letter to a friend about {}.",
          "How would you paint {}?", "What does {} remind you of?")


@dataclass
class Rollout:
    """One prompt + continuation as the target sees it."""

    token_ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, hidden] bfloat16: f_j after the final norm
    label_ids: torch.Tensor  # [T, k] int64: the target's top-k tokens at j (for token j + 1)
    label_probs: torch.Tensor  # [T, k] float32, summing to 1 per row
    num_prompt_tokens: int


def build_prompts(tokenizer, num_prompts: int, seed: int, prompts_file: Path | None = None) -> list[list[int]]:
    """Token ids of `num_prompts` prompts: from `prompts_file` (one per line, or JSON lines with
    "prompt"), else the built-in open-text set, in a seeded order; chat-templated where the
    tokenizer has a template."""
    if prompts_file is not None:
        texts = []
        for line in Path(prompts_file).read_text().splitlines():
            line = line.strip()
            if line:
                texts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    else:
        texts = [form.format(subject) for form in _FORMS for subject in _SUBJECTS]
    random.Random(seed).shuffle(texts)
    texts = texts[:num_prompts]
    if not texts:
        raise ValueError("no prompts to train on")
    out = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append([int(t) for t in ids])
    return out


@torch.inference_mode()
def record_rollouts(model, parts: TargetParts, prompts: list[list[int]], max_new_tokens: int, seed: int,
                    sampled_share: float = 0.5, temperature: float = 0.8, label_top_k: int = 8,
                    progress=None) -> list[Rollout]:
    """The target's continuation and features for every prompt (`progress`: a tqdm or None)."""
    device = parts.device
    num_sampled = round(sampled_share * len(prompts))
    rollouts = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, P]
        sampled = i < num_sampled
        torch.manual_seed(seed * 100_003 + i)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=sampled, temperature=temperature if sampled else None,
                             top_k=0 if sampled else None, top_p=None, pad_token_id=model.config.pad_token_id or 0)
        tokens = out[0]  # [T]
        features = model.get_decoder()(tokens[None]).last_hidden_state[0]  # [T, hidden], after the final norm
        probs = torch.softmax(parts.features_to_logits(features), dim=-1)  # [T, vocab]
        top, top_ids = torch.topk(probs, min(label_top_k, probs.shape[-1]), dim=-1)  # [T, k]
        rollouts.append(Rollout(tokens.cpu(), features.to(torch.bfloat16).cpu(), top_ids.cpu(),
                                (top / top.sum(-1, keepdim=True)).float().cpu(), len(prompt)))
        if progress is not None:
            progress.update(1)
    return rollouts
