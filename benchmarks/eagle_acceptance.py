"""How often a feature head's chains match the target, offline (no mesh, no timing): the target's
greedy answers to held-out open-text prompts (benchmarks/eagle_open_text.py's, not among the
training prompts), their features as the serving target computes them (bf16), and at every
answer position the head's depth-`d` greedy chain from the true context, scored against the
tokens the target wrote next. Reports the mean accepted draft tokens per pass (τ - 1 of a
greedy chain verified at that position) and the first draft token's hit rate, beside prompt
lookup's chains at the same positions and their combinations.

    python -u benchmarks/eagle_acceptance.py --head services/draft/eagle/heads/gemma-3-270m.eagle.safetensors

A pass in serving starts only where the previous one ended; scoring every position weighs all
positions equally, which is what the mean over many passes tends to. Use it to compare heads
on the same answers; the served figure is eagle_open_text.py's.

`--sampled T --draft-temperatures 0.6 0.8 1.0` also scores sampled drafting at every position of
answers sampled at T (seeded): the first draft token's acceptance probability sum_i min(p_i, q_i)
(speculative sampling's), p the target's distribution at temperature T (from its own feature at
that position), q the head's sparse distribution (its top `--max-top-k` tokens) at each draft
temperature. Any q is lossless (the verify pass draws what q leaves to it from the residual); the
draft temperature that maximises this sum accepts the most. Beside it, a sampled tree's first
level: the head's top 1, 2 and 4 tokens sent without q, one of which is accepted with the target's
probability of them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.eagle_open_text import PROMPTS  # noqa: E402
from services.common.models.loading import load_causal_lm, resolve_model_dir  # noqa: E402
from services.draft.eagle.data import build_prompts, generate_continuations, record_rollouts  # noqa: E402
from services.draft.eagle.drafter import HeadContext  # noqa: E402
from services.draft.eagle.proposer import EagleProposer  # noqa: E402
from services.draft.eagle.target_parts import TargetParts  # noqa: E402
from services.draft.proposers.base import DraftSampling  # noqa: E402
from services.draft.proposers.prompt_lookup import PromptLookupProposer  # noqa: E402
from services.draft.state import SequenceState  # noqa: E402
from services.settings import read_settings  # noqa: E402


def held_out_answers(model_dir: Path, tokens: int, temperature: float = 0.0) -> tuple[list[list[int]], list]:
    """The held-out prompts as chat turns, and their rollouts (answers with bf16 features): greedy,
    or sampled at `temperature` (seeded)."""
    import tempfile
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(PROMPTS) + "\n")
        f.flush()
        prompts = build_prompts(tokenizer, len(PROMPTS), 0, Path(f.name))
    answers = generate_continuations(model_dir, prompts, tokens, 0, sampled_share=1.0 if temperature > 0 else 0.0,
                                     temperature=temperature or 0.8, max_num_seqs=len(prompts))
    model = load_causal_lm(model_dir, torch.bfloat16, "cpu")[0].eval()
    return prompts, record_rollouts(model, TargetParts.from_model(model, model_dir), prompts, answers)


def score(head: Path, model_dir: Path, prompts: list[list[int]], rollouts: list, depth: int) -> dict:
    """Per answer position: the head's chain, prompt lookup's chain (3- to 1-grams) and "lookup
    where it matches, else the head", each scored by the run of its tokens the target wrote."""
    drafter = EagleProposer.load(head, model_dir, torch.bfloat16).drafter
    runs = {"head": 0, "lookup": 0, "lookup else head": 0, "best of both": 0}
    first, passes, matched = 0, 0, 0
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        ids = rollout.token_ids.tolist()
        ctx = HeadContext()
        lookup, state = PromptLookupProposer(), SequenceState("s", "", 0)
        lookup.observe("s", ids[:len(prompt)])
        state.token_ids.extend(ids[:len(prompt)])
        # head position j takes (f_j, t_{j+1}); feed the prompt's positions but its last
        drafter.feed(ctx, ids[1:len(prompt)], rollout.features[:len(prompt) - 1])
        for j in range(len(prompt) - 1, len(ids) - 2):
            drafter.feed(ctx, [ids[j + 1]], rollout.features[j:j + 1])  # now ctx.last predicts t_{j+2}
            lookup.observe("s", [ids[j + 1]])
            state.token_ids.append(ids[j + 1])  # committed: t_0 .. t_{j+1}
            truth = ids[j + 2:j + 2 + depth]
            head_chain = list(drafter.chain(ctx, "s", depth, DraftSampling(), None, 16).token_ids)
            lookup_chain = list(lookup.propose([state], depth, depth)[0].token_ids)
            head_run, lookup_run = _run(head_chain, truth), _run(lookup_chain, truth)
            runs["head"] += head_run
            runs["lookup"] += lookup_run
            runs["lookup else head"] += lookup_run if lookup_chain else head_run
            runs["best of both"] += max(head_run, lookup_run)
            matched += bool(lookup_chain)
            first += int(head_chain[0] == truth[0])
            passes += 1
    return {"passes": passes, "accepted_per_pass": {k: v / passes for k, v in runs.items()},
            "first_token_hit": first / passes, "lookup_matched": matched / passes}


SIBLINGS = (1, 2, 4)  # a sampled tree's first-level widths scored


@torch.inference_mode()
def sampled_acceptance(head: Path, model_dir: Path, prompts: list[list[int]], rollouts: list, temperature: float,
                       draft_temperatures: list[float], max_top_k: int) -> tuple[dict[float, float], dict[int, float]]:
    """Mean first-draft-token acceptance probability per draft temperature (see the docstring), and
    per k the same for a tree's first level of the head's top k tokens sent without q (deterministic
    proposals: one of them is accepted with the target's probability of the k, sum_top-k p)."""
    from services.draft.proposers.draft_model import sparse_distribution
    drafter = EagleProposer.load(head, model_dir, torch.bfloat16).drafter
    totals, positions = dict.fromkeys(draft_temperatures, 0.0), 0
    siblings = dict.fromkeys(SIBLINGS, 0.0)
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        ids = rollout.token_ids.tolist()
        ctx = HeadContext()
        drafter.feed(ctx, ids[1:len(prompt)], rollout.features[:len(prompt) - 1])
        for j in range(len(prompt) - 1, len(ids) - 2):
            drafter.feed(ctx, [ids[j + 1]], rollout.features[j:j + 1])  # ctx.last predicts t_{j+2}
            p = torch.softmax(drafter.parts.features_to_logits(rollout.features[j + 1]) / temperature, -1)  # [vocab]
            logits = drafter.output(ctx.last)  # [V'] draft logits
            for t in draft_temperatures:
                index, q = sparse_distribution(logits, DraftSampling(t), max_top_k)  # [k], [k]
                totals[t] += float(torch.minimum(p[drafter.output.token_ids(index)], q).sum())
            top = drafter.output.token_ids(torch.topk(logits, max(SIBLINGS)).indices)  # [max k] token ids
            for k in SIBLINGS:
                siblings[k] += float(p[top[:k]].sum())
            positions += 1
    return {t: total / positions for t, total in totals.items()}, {k: v / positions for k, v in siblings.items()}


def _run(chain: list[int], truth: list[int]) -> int:
    """Draft tokens a greedy verify accepts: the leading run equal to what the target wrote."""
    run = 0
    while run < min(len(chain), len(truth)) and chain[run] == truth[run]:
        run += 1
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--head", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=128, help="greedy answer length per prompt")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--sampled", type=float, default=0.0, help="target temperature of the sampled scoring (0: off)")
    parser.add_argument("--draft-temperatures", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0])
    parser.add_argument("--max-top-k", type=int, default=16, help="tokens of a sampled node's q (the proposer's)")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    started = time.perf_counter()
    prompts, rollouts = held_out_answers(model_dir, args.tokens)
    print(f"{len(prompts)} held-out prompts, {sum(len(r.token_ids) - p for r, p in zip(rollouts, map(len, prompts)))} "
          f"answer tokens ({time.perf_counter() - started:.0f} s)")
    sampled_rollouts = held_out_answers(model_dir, args.tokens, args.sampled)[1] if args.sampled > 0 else None
    for head in args.head:
        result = score(head, model_dir, prompts, rollouts, args.depth)
        print(f"{head}: depth {args.depth}, {result['passes']} positions; first draft token right "
              f"{100 * result['first_token_hit']:.1f}%; prompt lookup matched at {100 * result['lookup_matched']:.1f}%")
        for name, accepted in result["accepted_per_pass"].items():
            print(f"  {name:<18} {accepted:.2f} accepted per pass (τ {1 + accepted:.2f})")
        if args.sampled > 0:
            alphas, siblings = sampled_acceptance(head, model_dir, prompts, sampled_rollouts, args.sampled,
                                                  args.draft_temperatures, args.max_top_k)
            print(f"  on answers sampled at T={args.sampled}, q = the head's top {args.max_top_k}: first draft "
                  f"token's acceptance probability by draft temperature")
            for t, alpha in alphas.items():
                print(f"    draft T={t:<5} {alpha:.3f}")
            print("  a tree's first level, the head's top k sent without q (deterministic proposals): "
                  + ", ".join(f"top {k} {v:.3f}" for k, v in siblings.items()))


if __name__ == "__main__":
    main()
