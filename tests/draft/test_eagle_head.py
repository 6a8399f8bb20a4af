"""The feature head on its own (services/draft/eagle): training (loss falls, resumable, saved
with the target's identity, refused for another model), the attention used in training equals
the one used in serving, chains and trees follow the head step by step, and the proposer's
feature bookkeeping (the newest feature missing -> no draft; a gap -> the context restarts)."""

from __future__ import annotations

import pytest
import torch

from services.cli import main
from services.common.models.tiny import build_tiny_model
from services.draft.eagle.checkpoint import HeadMismatch, load_head, read_metadata
from services.draft.eagle.drafter import HeadContext, HeadDrafter
from services.draft.eagle.head import FeatureHead, HeadConfig
from services.draft.eagle.proposer import EagleProposer
from services.draft.eagle.target_parts import TargetParts, target_identity
from services.draft.eagle.train import train_head
from services.draft.proposers.base import DraftSampling
from services.draft.state import DraftStateStore
from tests.eagle_head import tiny_train_config, train_tiny_head


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head.safetensors"
    return tiny_llama_dir, train_tiny_head(tiny_llama_dir, out, draft_vocab_size=256)  # of 384: a reduced vocabulary


def test_training_loss_falls_and_the_saved_head_loads(trained):
    model_dir, result = trained
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.85 * first, (first, last)
    metadata = read_metadata(result.path)
    assert metadata["target_identity"] == target_identity(model_dir)
    head = load_head(result.path, target_identity(model_dir))
    parts = TargetParts.load(model_dir)
    assert head.config == HeadConfig.for_target(parts.text_config, len(head.draft_vocab))
    vocab = head.draft_vocab  # the draft vocabulary: labelled tokens only, ascending, saved as int64
    assert 0 < len(vocab) < parts.vocab_size and bool((vocab[1:] > vocab[:-1]).all())
    assert result.path.stat().st_size < 200_000  # the head's own weights only (bf16), not the target's


def test_a_head_for_another_model_is_refused(trained, tmp_path):
    _, result = trained
    other = build_tiny_model(tmp_path / "other", "llama", seed=1)  # same config, other weights
    with pytest.raises(HeadMismatch, match="trained for another target model"):
        EagleProposer.load(result.path, other)
    code = main(["draft", "train", "--model", str(other), "--out", str(tmp_path / "x.safetensors"),
                 "--num-prompts", "0"])
    assert code == 2  # a bad flag value is a one-line error, not a traceback


def test_training_resumes_from_its_checkpoint(tiny_llama_dir, tmp_path):
    out = tmp_path / "head.safetensors"
    short = train_head(tiny_train_config(tiny_llama_dir, out, epochs=2), progress=False)
    longer = train_head(tiny_train_config(tiny_llama_dir, out, epochs=4), progress=False)
    assert longer.resumed_from == short.steps == 8 and longer.steps == 16
    assert longer.losses[:8] == short.losses
    fresh = train_head(tiny_train_config(tiny_llama_dir, out, epochs=4, resume=False), progress=False)
    assert fresh.resumed_from == 0 and fresh.losses[:8] == short.losses  # same seed, same run


def test_specmesh_draft_train_writes_a_head(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cli.safetensors"
    assert main(["draft", "train", "--model", str(tiny_llama_dir), "--out", str(out), "--num-prompts", "4",
                 "--max-new-tokens", "8", "--epochs", "1"]) == 0
    assert "saved to" in capsys.readouterr().out
    load_head(out, target_identity(tiny_llama_dir))
    import json
    record = json.loads(out.with_name(out.name + ".json").read_text())  # how the head was made, beside it
    assert "draft train" in record["command"] and record["seed"] == 0 and record["steps"] == 1
    assert record["target_identity"] == target_identity(tiny_llama_dir) and record["train_seconds"] >= 0


def test_training_attention_step_one_equals_serving_attention():
    torch.manual_seed(0)
    head = FeatureHead(HeadConfig(32, 2, 8, 64))
    emb, feat = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    positions = torch.arange(7)[None].expand(2, -1)
    trained, k1, v1 = head.forward_ttt(emb, feat, positions, None, [])
    served, _, _ = head(emb[1], feat[1], positions[1])
    torch.testing.assert_close(trained[1], served)
    # Step 2 row j (position j + 1) sees context keys 0..j and itself: serving with a cache of
    # positions 0..j and the new row after it gives the same output.
    emb2, feat2 = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    step2, _, _ = head.forward_ttt(emb2, feat2, positions + 1, (k1, v1), [])
    j = 4
    _, k, v = head(emb[0, :j + 1], feat[0, :j + 1], positions[0, :j + 1])
    served2, _, _ = head(emb2[0, j:j + 1], feat2[0, j:j + 1], positions[0, j:j + 1] + 1, k, v)
    torch.testing.assert_close(step2[0, j], served2[0])


def test_few_query_attention_equals_sdpa_of_many(monkeypatch):
    """Drafting's few-row attention (plain matmuls, float32) gives what SDPA gives."""
    import services.draft.eagle.head as head_module
    torch.manual_seed(0)
    head = FeatureHead(HeadConfig(32, 2, 8, 64))
    emb, feat = torch.randn(5, 32), torch.randn(5, 32)
    _, k, v = head(emb[:3], feat[:3], torch.arange(3))
    mask = torch.tensor([[True, False, True, True, False], [True, True, True, True, True]])  # [n, s + n]
    few, _, _ = head(emb[3:], feat[3:], torch.arange(3, 5), k, v, mask)
    monkeypatch.setattr(head_module, "_SMALL_QUERIES", 0)  # every call through SDPA
    sdpa, _, _ = head(emb[3:], feat[3:], torch.arange(3, 5), k, v, mask)
    torch.testing.assert_close(few, sdpa)


def test_a_bf16_drafter_multiplies_through_the_kernel_within_one_rounding(trained):
    from services.target.kernels import cpu_linear
    from services.target.model.linear import AVX512LinearBF16
    model_dir, result = trained
    served = EagleProposer.load(result.path, model_dir, torch.bfloat16).drafter.head
    if not cpu_linear.available():
        assert isinstance(served.qkv, torch.nn.Linear)  # no kernel: torch's linears stay
        return
    assert all(isinstance(getattr(served, n), AVX512LinearBF16) for n in ("fc", "qkv", "o_proj", "gate_up", "down"))
    x = torch.randn(3, served.config.hidden_size).to(torch.bfloat16)
    plain = load_head(result.path, target_identity(model_dir), torch.bfloat16)
    torch.testing.assert_close(served.qkv(x).float(), plain.qkv(x).float(), atol=0.05, rtol=2 ** -7)


@pytest.fixture(scope="module")
def drafter(trained):
    model_dir, result = trained
    return EagleProposer.load(result.path, model_dir).drafter


def _context(drafter: HeadDrafter, tokens: list[int]) -> HeadContext:
    """A context over random features for positions 0 .. len(tokens) - 2."""
    ctx = HeadContext()
    gen = torch.Generator().manual_seed(1)
    feats = drafter.parts.final_norm(torch.randn(len(tokens) - 1, drafter.head.config.hidden_size, generator=gen))
    drafter.feed(ctx, tokens[1:], feats)
    return ctx


def test_greedy_chain_follows_the_head_step_by_step(drafter):
    tokens = [1, 40, 41, 42, 43, 44]
    ctx = _context(drafter, tokens)
    chain = drafter.chain(ctx, "s", 4, DraftSampling(), None, 16)
    feature, k, v = ctx.last, ctx.k, ctx.v
    expected = []
    vocab = drafter.head.draft_vocab  # the head scores only its draft vocabulary
    for i in range(4):  # one row at a time, the context never changed
        expected.append(int(vocab[drafter.parts.features_to_logits(feature)[vocab].argmax()]))
        out, nk, nv = drafter.head(drafter.parts.embed(torch.tensor(expected[-1:])), feature[None],
                                   torch.tensor([ctx.end + i]), k, v)
        k, v, feature = torch.cat([k, nk], 1), torch.cat([v, nv], 1), drafter.parts.final_norm(out[0])
    assert list(chain.token_ids) == expected
    assert ctx.end == len(tokens) - 1 and ctx.k.shape[1] == len(tokens) - 1  # drafts are scratch


@pytest.mark.parametrize("depth,nodes", [(3, 3), (4, 10), (2, 8)])
def test_tree_holds_the_greedy_chain_within_the_budget(drafter, depth, nodes):
    tokens = [1, 50, 51, 52]
    ctx = _context(drafter, tokens)
    chain = drafter.chain(ctx, "s", depth, DraftSampling(), None, 16)
    tree = drafter.tree(ctx, "s", depth, nodes, top_k=3)
    assert tree.num_nodes == nodes and max(tree.depths) <= depth
    assert tree.token_ids[:depth] == chain.token_ids and tree.parents[:depth] == tuple(range(-1, depth - 1))
    assert ctx.k.shape[1] == len(tokens) - 1
    assert set(tree.token_ids) <= set(drafter.head.draft_vocab.tolist())  # ids, not draft-vocabulary indices


def test_sampled_chain_sends_the_distribution_each_token_came_from(drafter):
    ctx = _context(drafter, [1, 60, 61])
    chain = drafter.chain(ctx, "s", 3, DraftSampling(0.8, 4, 0.0, 7), torch.Generator().manual_seed(7), 16)
    assert len(chain.distributions) == 3 and chain.distribution_problem(drafter.parts.vocab_size) is None
    assert all(len(d.token_ids) == 4 for d in chain.distributions)
    vocab = set(drafter.head.draft_vocab.tolist())
    for token, d in zip(chain.token_ids, chain.distributions):  # q over token ids of the draft vocabulary
        assert token in d.token_ids and set(d.token_ids) <= vocab


def test_a_sampled_tree_plan_gets_a_tree_of_deterministic_proposals_ranked_at_its_temperature(drafter):
    """A sampled request whose plan allows more nodes than depth gets the EAGLE-2 tree (no q: its
    siblings are the head's distinct top tokens); its confidence is taken at the request's
    temperature, so a colder request's tree is the tree ranked by sharper probabilities."""
    proposer = EagleProposer(drafter, top_k=3)
    store = DraftStateStore()
    state = store.append("a", [1, 50, 51, 52], "", 7)
    proposer.observe("a", [1, 50, 51, 52])
    proposer.add_features("a", 0, drafter.parts.final_norm(
        torch.randn(3, drafter.head.config.hidden_size, generator=torch.Generator().manual_seed(1))))
    proposer.set_sampling("a", DraftSampling(0.8, 0, 0.0, 7))
    tree = proposer.propose([state], 3, 8)[0]
    ctx = proposer._seqs["a"].context
    assert tree == drafter.tree(ctx, "a", 3, 8, top_k=3, temperature=0.8)
    assert tree.num_nodes == 8 and tree.distributions == () and len(set(tree.parents)) < tree.num_nodes
    assert tree.token_ids[:3] == drafter.chain(ctx, "a", 3, DraftSampling(), None, 16).token_ids  # argmax path kept
    assert proposer.propose([state], 3, 3)[0].distributions  # a chain plan keeps real q
    cold = [drafter.tree(ctx, "a", 3, 8, top_k=3, temperature=t) for t in (1.0, 0.05)]
    assert cold[0] != cold[1]  # the temperature reaches the ranking


def test_proposer_drafts_only_with_the_newest_feature_and_restarts_after_a_gap(drafter):
    proposer = EagleProposer(drafter)
    store = DraftStateStore()
    hidden = drafter.head.config.hidden_size
    rows = lambda n: drafter.parts.final_norm(torch.randn(n, hidden))  # noqa: E731
    state = store.append("a", [1, 70, 71, 72], "", 7)
    proposer.observe("a", [1, 70, 71, 72])
    proposer.add_features("a", 0, rows(2))  # positions 0, 1: position 2 is missing
    assert proposer.propose([state], 3, 3)[0].num_nodes == 0
    proposer.add_features("a", 2, rows(1))
    assert proposer.propose([state], 3, 3)[0].num_nodes == 3
    assert proposer.context_span("a") == (0, 3)
    store.append("a", [73, 74], "", 7)
    proposer.observe("a", [73, 74])
    proposer.add_features("a", 4, rows(1))  # position 3 lost: a gap
    assert proposer.propose([state], 2, 2)[0].num_nodes == 2
    assert proposer.context_span("a") == (4, 5)
    proposer.release("a")
    assert proposer.context_span("a") == (0, 0)


async def test_the_draft_server_built_from_settings_serves_eagle_and_refuses_a_foreign_head(trained, tmp_path):
    from services.builders import build_server
    from services.settings import read_settings
    from specmesh.proto.v1 import common_pb2

    model_dir, result = trained
    settings = read_settings({}, dev=True, port=0, model=str(model_dir), eagle_head=str(result.path))
    server = build_server("draft", settings)
    service = server._on_drain.__self__  # the DraftService the server drains
    assert isinstance(service.proposers[common_pb2.SPECULATION_METHOD_EAGLE], EagleProposer)
    await server.stop(0)
    other = build_tiny_model(tmp_path / "other", "llama", seed=2)
    with pytest.raises(HeadMismatch):
        build_server("draft", read_settings({}, dev=True, port=0, model=str(other), eagle_head=str(result.path)))
    # The mesh's own choice (`eagle_head` auto) is never a reason to refuse to start: none ships for
    # this model, so eagle is off; and a chosen head that does not fit is skipped with a warning.
    from services.common.server import ServerConfig
    auto = build_server("draft", read_settings({}, dev=True, model=str(other)), ServerConfig(port=0))
    assert common_pb2.SPECULATION_METHOD_EAGLE not in auto._on_drain.__self__.proposers
    await auto.stop(0)
    from services.draft.config import DraftConfig
    from services.draft.service import DraftService
    skipped = DraftService(DraftConfig(eagle_head_path=result.path, eagle_target_dir=other, eagle_optional=True))
    assert common_pb2.SPECULATION_METHOD_EAGLE not in skipped.proposers


def test_eagle_head_setting_resolves_the_shipped_head(tmp_path):
    from services.draft.eagle.shipped import HEADS_DIR, SHIPPED, resolve_eagle_head
    assert resolve_eagle_head("auto", "default") == HEADS_DIR / SHIPPED["default"]
    assert resolve_eagle_head("auto", str(tmp_path)) is None  # no head ships for another model
    assert resolve_eagle_head("none", "default") is None and resolve_eagle_head("", "default") is None
    assert resolve_eagle_head(str(tmp_path / "h.safetensors"), "default") == tmp_path / "h.safetensors"


def test_a_batch_of_sequences_gets_the_chains_and_trees_of_single_calls(drafter):
    """propose_batch feeds every sequence's features in one head forward, then drafts every chain
    of the batch in one head forward per depth, and every tree likewise (contexts of different lengths and frontiers of different widths, padding masked):
    the same drafts as one call per sequence."""
    hidden = drafter.head.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    histories = [[1, 80, 81, 82, 83, 84, 85], [1, 90, 91], [1, 100, 101, 102, 103], [1, 110, 111, 112],
                 [1, 120, 121, 122, 123, 124], [1, 130, 131], [1, 140, 141, 142]]
    features = [drafter.parts.final_norm(torch.randn(len(h) - 1, hidden, generator=gen)) for h in histories]
    samplings = [DraftSampling(), DraftSampling(0.8, 4, 0.0, 11), DraftSampling(), DraftSampling(0.7, 0, 0.9, 5),
                 DraftSampling(), DraftSampling(), DraftSampling()]
    # chains, a sampled request asking for a tree (ranked at its temperature), and greedy trees of different shapes
    limits = [(4, 4), (3, 3), (2, 2), (4, 8), (4, 8), (3, 10), (2, 5)]

    def open_all(proposer):
        store = DraftStateStore()
        states = []
        for i, (tokens, rows, sampling) in enumerate(zip(histories, features, samplings)):
            states.append(store.append(str(i), tokens, "", 7))
            proposer.observe(str(i), tokens)
            proposer.add_features(str(i), 0, rows)
            proposer.set_sampling(str(i), sampling)
        return states

    batched = EagleProposer(drafter)
    head_forwards = []
    hook = drafter.head.register_forward_hook(lambda module, args, out: head_forwards.append(args[0].shape))
    try:
        trees = batched.propose_batch(open_all(batched), [d for d, _ in limits], [n for _, n in limits])
    finally:
        hook.remove()
    # One forward feeds every sequence's features; per depth below the deepest, one for the chains
    # and one for the trees (not one per sequence).
    assert len(head_forwards) == 1 + (4 - 1) + (4 - 1)
    single = EagleProposer(drafter)
    states = open_all(single)
    alone = [single.propose([state], d, n)[0] for state, (d, n) in zip(states, limits)]
    assert [(t.token_ids, t.parents) for t in trees] == [(t.token_ids, t.parents) for t in alone]
    assert [t.num_nodes for t in trees] == [4, 3, 2, 8, 8, 10, 5]
    for got, want in zip(trees, alone):
        assert len(got.distributions) == len(want.distributions)
        for a, b in zip(got.distributions, want.distributions):
            assert a.token_ids == b.token_ids
            assert a.probs == pytest.approx(b.probs, abs=1e-5)


def _eagle_sequence(sequence_id, tokens, features=None, **fields):
    from specmesh.proto.v1 import common_pb2, draft_service_pb2
    return draft_service_pb2.DraftSequence(sequence_id=sequence_id, new_token_ids=tokens, max_depth=3,
                                           method=common_pb2.SPECULATION_METHOD_EAGLE, features=features, **fields)


def test_the_draft_service_checks_features_and_drafts_from_them(drafter):
    import grpc
    from services.common import feature_rows
    from services.draft.config import DraftConfig
    from services.draft.service import DraftService, RequestError
    from specmesh.proto.v1 import draft_service_pb2

    hidden = drafter.head.config.hidden_size
    rows = drafter.parts.final_norm(torch.randn(3, hidden))  # [3, hidden]
    service = DraftService(DraftConfig(), eagle=EagleProposer(drafter))
    bad = {"wrong hidden size": feature_rows.encode(0, torch.randn(3, hidden + 1)),
           "past the last token": feature_rows.encode(1, rows),
           "short data": draft_service_pb2.FeatureRows(start=0, num_rows=3, hidden_size=hidden, data=b"\0" * 10)}
    for what, features in bad.items():
        with pytest.raises(RequestError) as info:
            service.propose(draft_service_pb2.ProposeRequest(sequences=[_eagle_sequence("a", [1, 5, 6, 7], features)]))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, what
        assert "a" not in service.store  # nothing changed
    answer = service.propose(draft_service_pb2.ProposeRequest(
        sequences=[_eagle_sequence("a", [1, 5, 6, 7], feature_rows.encode(0, rows))]))
    assert len(answer.trees[0].token_ids) == 3
    no_features = service.propose(draft_service_pb2.ProposeRequest(sequences=[_eagle_sequence("a", [8])]))
    assert len(no_features.trees[0].token_ids) == 0  # the newest position's feature is missing: no draft
    without_head = DraftService(DraftConfig())
    with pytest.raises(RequestError) as info:
        without_head.propose(draft_service_pb2.ProposeRequest(sequences=[_eagle_sequence("b", [1, 2])]))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "feature head" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_from_the_table_equals_the_per_call_computation(dtype):
    """The cached table (grown past its first size) gives the bits a per-call computation gives."""
    from services.draft.eagle import head as head_module
    positions = torch.tensor([[0, 1, 7, 300], [4095, 4096, 9000, 12]])  # [2, 4]: 9000 grows the table
    cos, sin = head_module._rope(positions, 64, 10000.0, dtype)
    inv = head_module._inverse_frequencies(64, 10000.0, positions.device)
    angles = positions.float()[..., None] * inv  # [2, 4, 32]
    emb = torch.cat([angles, angles], dim=-1)[..., None, :, :]  # [2, 1, 4, 64]
    assert torch.equal(cos, emb.cos().to(dtype)) and torch.equal(sin, emb.sin().to(dtype))
    with pytest.raises(ValueError, match=">= 0"):
        head_module._rope(torch.tensor([3, -1]), 64, 10000.0, dtype)


def test_a_lone_row_without_a_mask_attends_as_with_every_key_visible(drafter):
    """A chain step of one sequence passes no mask: the same output as an all-visible mask."""
    head, hidden = drafter.head, drafter.head.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    ctx = _context(drafter, [1, 40, 41, 42, 43])
    embeds, feature = torch.randn(1, 1, hidden, generator=gen), torch.randn(1, 1, hidden, generator=gen)
    positions = torch.tensor([[ctx.end]])
    k, v = ctx.k[None], ctx.v[None]  # [1, heads, s, head_dim]
    masked = head(embeds, feature, positions, k, v, torch.ones(1, 1, 1, k.shape[2] + 1, dtype=torch.bool))
    unmasked = head(embeds, feature, positions, k, v, None)
    for a, b in zip(masked, unmasked):
        assert torch.equal(a, b)
