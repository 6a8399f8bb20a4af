"""How many tokens a verify step can commit with prompt lookup, on compare.py's nine prompts.

    python benchmarks/prompt_lookup_acceptance.py                 # default model, bf16, 64 tokens
    python benchmarks/prompt_lookup_acceptance.py --depths 5 10 20

The engine first decodes each prompt greedily without speculation. Each output is then replayed
against the draft service's own `PromptLookupProposer`: at every step the proposer sees the
committed tokens, proposes a chain of up to `depth` tokens, and the step commits the proposal's
longest prefix that matches the greedy output plus the bonus token, as a lossless verify would.
No timing is involved, so the numbers are the same on every machine.

It answers whether a better proposer could lift speculation much above plain decode's speed:
tok/s with speculation ~ tokens per step / verify step time, so at a fixed step cost the
ratio of tokens per step is the ratio of speeds. Rows:
  * n 1..3, most recent: the proposer as the draft service runs it (max_ngram 3, min_ngram 1);
  * n 2..4, most recent: the n-gram lengths compare.py gives vLLM's n-gram proposer;
  * what-if tree, k continuations: the k most recent distinct continuations of the longest
    matching n-gram as one tree (k x depth nodes; a CPU step pays for every node's logits).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.anchors.compare import make_prompts
from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.draft.proposers.prompt_lookup import PromptLookupProposer
from services.draft.state import SequenceState
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

def greedy_outputs(engine: Engine, prompts: list[str], tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, decoded by the engine without speculation."""
    out = []
    for prompt in tqdm(prompts, desc="greedy decode"):
        ids, generated, done = engine.tokenizer(prompt).input_ids, [], threading.Event()

        def emit(step, generated=generated, done=done):
            generated.extend(step.token_ids)
            if step.finish_reason is not None:
                done.set()
        engine.submit(f"acceptance-{time.monotonic_ns()}", ids, SamplingConfig(max_tokens=tokens), emit)
        done.wait()
        out.append((ids, generated))
    return out


def proposer_chain(max_ngram: int, min_ngram: int):
    """propose(history, depth) -> [chain] through the draft service's PromptLookupProposer."""
    def make():
        proposer, state = PromptLookupProposer(max_ngram, min_ngram), SequenceState("replay", "", 0)

        def propose(history: list[int], depth: int) -> list[list[int]]:
            new = history[state.num_tokens:]
            state.token_ids.extend(new)
            proposer.observe("replay", new)
            return [list(proposer.propose([state], depth, depth)[0].token_ids)]
        return propose
    return make


def tree_of_continuations(k: int, max_ngram: int = 3, min_ngram: int = 1):
    """What-if: the k most recent distinct continuations of the longest matching n-gram."""
    def make():
        def propose(history: list[int], depth: int) -> list[list[int]]:
            for n in range(max_ngram, min_ngram - 1, -1):
                if len(history) <= n:
                    continue
                suffix, found = history[-n:], []
                for start in range(len(history) - n - 1, -1, -1):  # most recent first
                    if history[start:start + n] == suffix:
                        cont = history[start + n:start + n + depth]
                        if cont not in found:
                            found.append(cont)
                        if len(found) == k:
                            break
                if found:
                    return found
            return [[]]
        return propose
    return make


def replay(outputs, make_proposer, depth: int) -> tuple[float, int]:
    """(tokens committed per verify step, steps) over every output; the first token is the prefill's."""
    steps = committed = 0
    for prompt_ids, generated in outputs:
        propose, history, pos = make_proposer(), [*prompt_ids, generated[0]], 1
        while pos < len(generated):
            accepted = 0
            for chain in propose(history, depth):
                n = 0
                while n < len(chain) and pos + n < len(generated) and chain[n] == generated[pos + n]:
                    n += 1
                accepted = max(accepted, n)
            advance = min(accepted + 1, len(generated) - pos)  # accepted nodes + the bonus token
            history.extend(generated[pos:pos + advance])
            pos, steps, committed = pos + advance, steps + 1, committed + advance
    return committed / max(steps, 1), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--depths", type=int, nargs="+", default=[5, 10])
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype))
    engine.start()
    try:
        outputs = greedy_outputs(engine, make_prompts(engine.tokenizer), args.tokens)
    finally:
        engine.shutdown()
    rows = [("n 1..3, most recent (the draft service's)", proposer_chain(3, 1)),
            ("n 2..4, most recent (compare.py's vLLM n-gram lengths)", proposer_chain(4, 2)),
            ("what-if tree, 2 continuations", tree_of_continuations(2)),
            ("what-if tree, 4 continuations", tree_of_continuations(4))]
    print(f"\nmodel={args.model} dtype={args.dtype} tokens={args.tokens}, nine prompts of compare.py, "
          "tokens committed per verify step (the most a step can commit is depth + 1)")
    print("| proposer | " + " | ".join(f"depth {d}" for d in args.depths) + " |")
    print("|---|" + "---|" * len(args.depths))
    for label, make in rows:
        print(f"| {label} | " + " | ".join(f"{replay(outputs, make, d)[0]:.2f}" for d in args.depths) + " |")


if __name__ == "__main__":
    main()
