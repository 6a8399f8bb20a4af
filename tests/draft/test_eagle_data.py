"""The feature head's training data (services/draft/eagle/data.py, draft_vocab.py) and loss
precision (train.py): batched recording gives each rollout what it gets alone, labels come
from the draft vocabulary's rows only, the draft vocabulary is the most written tokens, the
built-in prompts hold none of the benchmark's held-out prompts, and the loss without recompute
equals the chunked one."""

from __future__ import annotations

import pytest
import torch

from benchmarks.eagle_open_text import PROMPTS as HELD_OUT
from services.common.models.loading import load_causal_lm
from services.draft.eagle.data import builtin_prompt_texts, record_rollouts
from services.draft.eagle.draft_vocab import DraftOutput, choose_draft_vocab
from services.draft.eagle.target_parts import TargetParts
from services.draft.eagle import train
from services.draft.eagle.train import TrainConfig


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    model, _ = load_causal_lm(tiny_llama_dir, torch.float32, "cpu")
    return model.eval(), TargetParts.from_model(model.eval(), tiny_llama_dir)


def _sequences(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]
    answers = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in (11, 4, 20, 6, 9)]
    return prompts, answers


def test_batched_recording_gives_each_rollout_what_it_gets_alone(target):
    model, parts = target
    prompts, answers = _sequences(parts.vocab_size)
    batched = record_rollouts(model, parts, prompts, answers, batch_tokens=4096)  # all five right-padded together
    alone = record_rollouts(model, parts, prompts, answers, batch_tokens=1)  # one forward each
    for b, a, p, c in zip(batched, alone, prompts, answers):
        assert b.token_ids.tolist() == p + c and b.num_prompt_tokens == len(p)
        torch.testing.assert_close(b.features.float(), a.features.float(), atol=2e-2, rtol=1e-2)  # stored bf16
        assert b.label_ids.shape == (len(p) + len(c), 8)
        torch.testing.assert_close(b.label_probs, a.label_probs, atol=1e-4, rtol=1e-4)


def test_labels_come_from_the_draft_vocabulary_rows_renormalised(target):
    model, parts = target
    prompts, answers = _sequences(parts.vocab_size)
    vocab = torch.arange(3, parts.vocab_size, 7)  # ascending token ids
    rollouts = record_rollouts(model, parts, prompts, answers, label_top_k=4, vocab=vocab)
    r = rollouts[2]
    assert set(r.label_ids.flatten().tolist()) <= set(vocab.tolist())
    with torch.inference_mode():
        full = model.get_decoder()(r.token_ids[None]).last_hidden_state[0]  # [T, hidden]
        probs = torch.softmax(parts.features_to_logits(full)[:, vocab], dim=-1)  # the draft rows only
    top, index = torch.topk(probs, 4, dim=-1)
    assert r.label_ids.tolist() == vocab[index].tolist()
    torch.testing.assert_close(r.label_probs, top / top.sum(-1, keepdim=True), atol=1e-4, rtol=1e-4)


def test_the_draft_vocabulary_is_the_most_written_tokens_ascending():
    assert choose_draft_vocab([[5, 5, 3], [3, 9, 5]], 2, 20).tolist() == [3, 5]
    assert choose_draft_vocab([[7, 2]], 1, 10).tolist() == [2]  # a tie goes to the lower id
    assert choose_draft_vocab([[7, 2], []], 100, 10).tolist() == [2, 7]  # never a token nobody wrote


def test_the_built_in_prompts_hold_none_of_the_benchmarks_held_out_prompts():
    texts = builtin_prompt_texts()
    assert len(texts) == len(set(texts)) == 4920
    assert not set(HELD_OUT) & set(texts)


def test_the_loss_without_recompute_equals_the_chunked_loss(target, monkeypatch):
    _, parts = target
    output = DraftOutput(parts, None)
    g = torch.Generator().manual_seed(0)
    predicted = torch.randn(40, parts.text_config.hidden_size, generator=g, requires_grad=True)
    index = torch.randint(-1, parts.vocab_size, (40, 3), generator=g)
    probs = torch.softmax(torch.randn(40, 3, generator=g), -1)
    losses, grads = [], []
    for direct in (1 << 26, 0):  # everything kept, then 16-row chunks recomputed in the backward pass
        monkeypatch.setattr(train, "DIRECT_LOGITS", direct)
        loss = train._soft_ce(output, predicted, index, probs, chunk=16)
        (grad,) = torch.autograd.grad(loss, predicted)
        losses.append(loss.detach())
        grads.append(grad)
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_training_precision_is_checked_and_auto_follows_the_cpu(tiny_llama_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="train_precision"):
        TrainConfig(model_dir=tiny_llama_dir, out=tmp_path / "h", train_precision="fp8")
    import services.target.model.linear as linear
    for native in (True, False):
        monkeypatch.setattr(linear, "native_bf16_cpu", lambda native=native: native)
        assert train._autocast(TrainConfig(model_dir=tiny_llama_dir, out=tmp_path / "h")) is native
    pinned = TrainConfig(model_dir=tiny_llama_dir, out=tmp_path / "h", train_precision="float32")
    assert train._autocast(pinned) is False


def test_a_draft_vocabulary_no_smaller_than_the_whole_is_the_whole(tiny_llama_dir, tmp_path):
    """The tiny target's 384 tokens are under the default 16,384: the head scores all of them
    (a near-uniform random model's likeliest tokens need not be among those it wrote)."""
    from services.draft.eagle.checkpoint import load_head
    from services.draft.eagle.target_parts import target_identity
    from tests.eagle_head import train_tiny_head
    result = train_tiny_head(tiny_llama_dir, tmp_path / "head.safetensors", num_prompts=4, max_new_tokens=4, epochs=1)
    assert load_head(result.path, target_identity(tiny_llama_dir)).draft_vocab is None
