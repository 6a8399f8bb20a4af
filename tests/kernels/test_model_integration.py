"""The kernels inside a real (tiny) model through the engine's attention hook: greedy
generation with the Triton path forced equals the reference path and Hugging Face
`generate`; a tree verify pass gives the same logits as running each root-to-leaf path
causally. Tiny Gemma 3 mixes sliding-window (16) and full attention layers."""

from __future__ import annotations

import pytest
import torch

from services.target.model.attention import AttentionMetadata, KVPool
from services.target.kernels import get_kernels

from .conftest import DEVICE
from .helpers import ancestors_or_self, binary_tree, depths

BLOCK_SIZE, NUM_BLOCKS = 4, 64
PROMPT = "Once upon a time, in a land far away, there lived a"


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from services.common.models.tiny import build_tiny_model
    from services.target.model.model_runner import load_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("kernels-tiny-gemma"), arch="gemma3", seed=1)
    model, tokenizer, spec = load_model(model_dir, torch.float32, device=DEVICE)
    return model_dir, model, tokenizer, spec


def _forward(model, kernels, pool, table, ctx, tokens, positions, tree_mask=None) -> torch.Tensor:
    """One pass of one sequence: new tokens at sequence indices ctx .. ctx + n - 1."""
    n = len(tokens)
    slots = [int(table[j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE for j in range(ctx, ctx + n)]
    dev = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    meta = AttentionMetadata(
        kv_pool=pool, kernels=kernels, slot_mapping=dev(torch.tensor(slots)), block_tables=dev(table[None].clone()),
        context_lens=dev(torch.tensor([ctx], dtype=torch.int32)),
        query_start_loc=dev(torch.tensor([0, n], dtype=torch.int32)),
        query_positions=dev(torch.tensor(positions, dtype=torch.int32)), tree_mask=dev(tree_mask),
    )
    with torch.inference_mode():
        out = model(input_ids=dev(torch.tensor([tokens])), position_ids=dev(torch.tensor([positions])),
                    use_cache=False, specmesh_meta=meta)
    return out.logits[0].float().cpu()  # [n, vocab]


def _new_pool(spec) -> tuple[KVPool, torch.Tensor]:
    pool = KVPool.allocate(spec.num_layers, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32, DEVICE)
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[:32].int()  # gappy blocks
    return pool, table


def _greedy(model, tokenizer, spec, backend: str, new_tokens: int, chunk: int = 7) -> list[int]:
    kernels = get_kernels(backend)
    pool, table = _new_pool(spec)
    ids, out, done = tokenizer(PROMPT).input_ids, [], 0
    while len(out) < new_tokens:
        seq = ids + out
        n = min(chunk, len(seq) - done)  # chunked prefill, then decode steps
        logits = _forward(model, kernels, pool, table, done, seq[done:done + n], list(range(done, done + n)))
        done += n
        if done >= len(ids):
            out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.triton
def test_greedy_triton_equals_reference_and_hf(tiny_gemma):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, model, tokenizer, spec = tiny_gemma
    ref = _greedy(model, tokenizer, spec, "reference", 12)
    assert _greedy(model, tokenizer, spec, "triton", 12) == ref
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids], device=DEVICE)
    hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    assert hf[0, ids.shape[1]:].tolist() == ref  # prompt + 12 tokens > sliding window 16


@pytest.mark.triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tree_verify_logits_equal_causal_paths(tiny_gemma, backend):
    _, model, tokenizer, spec = tiny_gemma
    kernels = get_kernels(backend)
    ids = tokenizer(PROMPT).input_ids
    ctx = len(ids) - 1  # committed KV; the last prompt token is the tree root
    parents = binary_tree(7)
    g = torch.Generator().manual_seed(3)
    tokens = [ids[-1]] + torch.randint(4, spec.vocab_size, (6,), generator=g).tolist()
    tree_mask = torch.tensor([[k in ancestors_or_self(parents, i) for k in range(7)] for i in range(7)])
    pool, table = _new_pool(spec)
    _forward(model, kernels, pool, table, 0, ids[:-1], list(range(ctx)))
    prefix_state = [t.clone() for t in pool.k_caches + pool.v_caches]
    tree_logits = _forward(model, kernels, pool, table, ctx, tokens, [ctx + d for d in depths(parents)], tree_mask)
    for leaf in (3, 4, 5, 6):
        path = sorted(ancestors_or_self(parents, leaf))
        for t, saved in zip(pool.k_caches + pool.v_caches, prefix_state):
            t.copy_(saved)
        path_logits = _forward(model, kernels, pool, table, ctx, [tokens[n] for n in path],
                               list(range(ctx, ctx + len(path))))
        torch.testing.assert_close(tree_logits[path], path_logits, atol=1e-4, rtol=1e-4)
