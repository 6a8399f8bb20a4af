"""How often a feature head's chains match the target, offline (no mesh, no timing): the target's
greedy answers to held-out open-text prompts (benchmarks/eagle_open_text.py's, not among the
training prompts), their features as the serving target computes them (bf16), and at every
answer position the head's depth-`d` greedy chain from the true context, scored against the
tokens the target wrote next. Reports the mean accepted draft tokens per pass (τ - 1 of a
greedy chain verified at that position) and the first draft token's hit rate.

    python -u benchmarks/eagle_acceptance.py --head services/draft/eagle/heads/gemma-3-270m.eagle.safetensors

A pass in serving starts only where the previous one ended; scoring every position weighs all
positions equally, which is what the mean over many passes tends to. Use it to compare heads
on the same answers; the served figure is eagle_open_text.py's.
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
from services.settings import read_settings  # noqa: E402


def held_out_answers(model_dir: Path, tokens: int) -> tuple[list[list[int]], list]:
    """The held-out prompts as chat turns, and their rollouts (greedy answers with bf16 features)."""
    import tempfile
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(PROMPTS) + "\n")
        f.flush()
        prompts = build_prompts(tokenizer, len(PROMPTS), 0, Path(f.name))
    answers = generate_continuations(model_dir, prompts, tokens, 0, sampled_share=0.0, max_num_seqs=len(prompts))
    model = load_causal_lm(model_dir, torch.bfloat16, "cpu")[0].eval()
    return prompts, record_rollouts(model, TargetParts.from_model(model, model_dir), prompts, answers)


def score(head: Path, model_dir: Path, prompts: list[list[int]], rollouts: list, depth: int) -> dict:
    drafter = EagleProposer.load(head, model_dir, torch.bfloat16).drafter
    accepted, first, passes = 0, 0, 0
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        ids = rollout.token_ids.tolist()
        ctx = HeadContext()
        # head position j takes (f_j, t_{j+1}); feed the prompt's positions but its last
        drafter.feed(ctx, ids[1:len(prompt)], rollout.features[:len(prompt) - 1])
        for j in range(len(prompt) - 1, len(ids) - 2):
            drafter.feed(ctx, [ids[j + 1]], rollout.features[j:j + 1])  # now ctx.last predicts t_{j+2}
            chain = drafter.chain(ctx, "s", depth, DraftSampling(), None, 16).token_ids
            truth = ids[j + 2:j + 2 + depth]
            run = 0
            while run < min(len(chain), len(truth)) and chain[run] == truth[run]:
                run += 1
            accepted += run
            first += int(bool(truth) and chain[0] == truth[0])
            passes += 1
    return {"passes": passes, "accepted_per_pass": accepted / passes, "tau": 1 + accepted / passes,
            "first_token_hit": first / passes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--head", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=128, help="greedy answer length per prompt")
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    started = time.perf_counter()
    prompts, rollouts = held_out_answers(model_dir, args.tokens)
    print(f"{len(prompts)} held-out prompts, {sum(len(r.token_ids) - p for r, p in zip(rollouts, map(len, prompts)))} "
          f"answer tokens ({time.perf_counter() - started:.0f} s)")
    for head in args.head:
        result = score(head, model_dir, prompts, rollouts, args.depth)
        print(f"{head}: depth {args.depth}, {result['passes']} positions: {result['accepted_per_pass']:.2f} accepted "
              f"per pass (τ {result['tau']:.2f}), first draft token right {100 * result['first_token_hit']:.1f}%")


if __name__ == "__main__":
    main()
