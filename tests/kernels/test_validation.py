"""Wrappers reject wrong shapes, dtypes and non-contiguous inputs with clear errors,
before launching anything; and backend selection."""

from __future__ import annotations

import re

import pytest
import torch

from services.target.kernels import BACKENDS, get_kernels
from services.target.kernels.paged_attention import paged_attention_reference
from services.target.kernels.paged_attention_cpu import paged_attention_cpu

from .conftest import DEVICE
from .helpers import SeqSpec, make_batch

BACKEND_NAMES = ["reference", "triton"]


def _kernels(name: str):
    # Without CUDA, conftest.py turns the interpreter on; get_kernels raises a clear error otherwise.
    return get_kernels(name)


def _attention_args():
    g = torch.Generator().manual_seed(0)
    batch = make_batch([SeqSpec(3, 2), SeqSpec(0, 1)], 4, 2, 16, 4, torch.float32, g, DEVICE)
    return batch.args(0.25)


ATTENTION_BREAKS = [
    ("query", lambda a: a["query"][:, :, :8], ValueError, "query must be contiguous"),
    ("query", lambda a: a["query"].double(), TypeError, "query must have dtype"),
    ("query", lambda a: a["query"][0], ValueError, "query must have shape [num_tokens, num_heads, head_dim]"),
    ("query", lambda a: a["query"][:, :3].contiguous(), ValueError, "num_heads (3) must be a multiple of num_kv_heads (2)"),
    ("k_cache", lambda a: a["k_cache"][..., :8].contiguous(), ValueError, "k_cache must have shape"),
    ("k_cache", lambda a: a["k_cache"].transpose(0, 1), ValueError, "k_cache must be contiguous"),
    ("v_cache", lambda a: a["v_cache"].half(), TypeError, "v_cache must have dtype"),
    ("block_tables", lambda a: a["block_tables"].long(), TypeError, "block_tables must have dtype in (int32)"),
    ("block_tables", lambda a: a["block_tables"].t(), ValueError, "block_tables must be contiguous"),
    ("context_lens", lambda a: a["context_lens"][:1], ValueError, "context_lens must have shape [num_seqs=2]"),
    ("query_start_loc", lambda a: a["query_start_loc"][:2], ValueError, "query_start_loc must have shape [num_seqs + 1=3]"),
    ("query_positions", lambda a: a["query_positions"].float(), TypeError, "query_positions must have dtype"),
    ("tree_mask", lambda a: torch.ones(3, 2, dtype=torch.int32, device=DEVICE), TypeError, "tree_mask must have dtype in (bool)"),
    ("tree_mask", lambda a: torch.ones(2, 2, dtype=torch.bool, device=DEVICE), ValueError, "tree_mask must have shape [num_tokens=3, max_q_len]"),
    ("k_scale", lambda a: torch.ones(1, device=DEVICE), ValueError, "k_scale/v_scale must be None"),
    ("sliding_window", lambda a: 0, ValueError, "sliding_window must be None or a positive int"),
    ("scale", lambda a: torch.tensor(0.5), TypeError, "scale must be a Python float"),
]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("arg,breaker,exc,message", ATTENTION_BREAKS, ids=[f"{b[0]}-{i}" for i, b in enumerate(ATTENTION_BREAKS)])
def test_paged_attention_rejects_bad_input(backend, arg, breaker, exc, message):
    kernels = _kernels(backend)
    args = _attention_args()
    args[arg] = breaker(args)
    with pytest.raises(exc, match=re.escape(message)):
        kernels.paged_attention(**args)


def test_paged_attention_fp8_needs_scales():
    args = _attention_args()
    args["k_cache"] = args["k_cache"].to(torch.float8_e4m3fn)
    args["v_cache"] = args["v_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        get_kernels("reference").paged_attention(**args)


def _store_args():
    k_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    key = torch.randn(3, 2, 16, device=DEVICE)
    return dict(key=key, value=key.clone(), k_cache=k_cache, v_cache=k_cache.clone(),
                slot_mapping=torch.tensor([0, 5, -1], device=DEVICE))


STORE_BREAKS = [
    ("key", lambda a: a["key"][:, :1], ValueError, "key must have shape [num_tokens, num_kv_heads=2, head_dim=16]"),
    ("key", lambda a: a["key"].transpose(0, 1).contiguous().transpose(0, 1), ValueError, "key must be contiguous"),
    ("key", lambda a: a["key"].double(), TypeError, "key must have dtype in (float32, bfloat16, float16), got float64"),
    ("value", lambda a: a["value"].half(), TypeError, "value must have dtype in (float32), got float16"),
    ("value", lambda a: a["value"][:2], ValueError, "value must have shape"),
    ("slot_mapping", lambda a: a["slot_mapping"].float(), TypeError, "slot_mapping must have dtype in (int32, int64)"),
    ("slot_mapping", lambda a: a["slot_mapping"][:2], ValueError, "slot_mapping must have shape [num_tokens=3]"),
    ("k_cache", lambda a: a["k_cache"].to(torch.float8_e4m3fn), TypeError, "v_cache must have dtype"),
]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("arg,breaker,exc,message", STORE_BREAKS, ids=[f"{b[0]}-{i}" for i, b in enumerate(STORE_BREAKS)])
def test_store_kv_rejects_bad_input(backend, arg, breaker, exc, message):
    kernels = _kernels(backend)
    args = _store_args()
    args[arg] = breaker(args)
    with pytest.raises(exc, match=re.escape(message)):
        kernels.store_kv(**args)


def _tree_args():
    t = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    return dict(draft_tokens=t([[0, 1, 2]]), parents=t([[-1, 0, 1]]), num_nodes=t([3]),
                target_probs=torch.full((1, 3, 4), 0.25, device=DEVICE), draft_probs=torch.zeros(1, 3, 4, device=DEVICE),
                uniforms=torch.rand(1, 4, device=DEVICE))


TREE_BREAKS = [
    ("draft_tokens", lambda a: a["draft_tokens"].int(), TypeError, "draft_tokens must have dtype in (int64)"),
    ("parents", lambda a: a["parents"][:, :2].contiguous(), ValueError, "parents must have shape [S=1, max_nodes=3]"),
    ("num_nodes", lambda a: a["num_nodes"].float(), TypeError, "num_nodes must have dtype"),
    ("target_probs", lambda a: a["target_probs"].double(), TypeError, "target_probs must have dtype in (float32)"),
    ("draft_probs", lambda a: a["draft_probs"][..., :3].contiguous(), ValueError, "draft_probs must have shape [S=1, max_nodes=3, vocab=4]"),
    ("uniforms", lambda a: a["uniforms"][:, :3].contiguous(), ValueError, "uniforms must have shape [S=1, max_nodes + 1=4]"),
    ("target_probs", lambda a: a["target_probs"].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "target_probs must be contiguous"),
]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("arg,breaker,exc,message", TREE_BREAKS, ids=[f"{b[0]}-{i}" for i, b in enumerate(TREE_BREAKS)])
def test_accept_tree_rejects_bad_input(backend, arg, breaker, exc, message):
    kernels = _kernels(backend)
    args = _tree_args()
    args[arg] = breaker(args)
    with pytest.raises(exc, match=re.escape(message)):
        kernels.accept_tree_sampling(**args)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_accept_greedy_rejects_bad_argmax(backend):
    args = _tree_args()
    with pytest.raises(ValueError, match=re.escape("target_argmax must have shape [S, max_nodes]")):
        _kernels(backend).accept_tree_greedy(args["draft_tokens"], args["parents"], args["num_nodes"],
                                             torch.zeros(1, 2, dtype=torch.int64, device=DEVICE))


def test_get_kernels_selection():
    assert BACKENDS == ("auto", "triton", "cpu", "reference")
    assert get_kernels("reference").backend == "reference"
    assert get_kernels("reference").paged_attention is paged_attention_reference
    assert get_kernels("cpu").backend == "cpu"
    assert get_kernels("cpu").paged_attention is paged_attention_cpu
    assert get_kernels("auto").backend == ("triton" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        get_kernels("cuda")


def test_forcing_triton_without_cuda_or_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kernel backend 'triton' needs a CUDA device"):
        get_kernels("triton")
    assert get_kernels("auto").backend == "cpu"
