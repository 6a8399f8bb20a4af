"""`specmesh draft train`: trains a feature head for a target model directory.

1. data (services/draft/eagle/data.py): the target's own greedy and sampled continuations of
   a prompt set with its features and next-token distributions; cached beside the checkpoint
   so a resumed run does not generate again;
2. training, EAGLE-3 style (training-time test): step 1 feeds the true features; step s feeds
   the head's own predicted features of step s - 1 (and the true next tokens), attending the
   true-feature context plus its own earlier steps, as drafting at depth s does. Loss per
   step: cross-entropy of the head's logits against the target's top-k distribution, plus
   `feature_weight` times smooth L1 between the predicted and the true feature;
3. the head saved as small safetensors (bf16) with the target's identity; a checkpoint (head,
   optimizer, step, losses) is written every `checkpoint_every` steps and resumed from.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from services.draft.eagle.checkpoint import save_head
from services.draft.eagle.data import Rollout, build_prompts, generate_continuations, record_rollouts
from services.draft.eagle.draft_vocab import DraftOutput, choose_draft_vocab
from services.draft.eagle.head import FeatureHead, HeadConfig
from services.draft.eagle.target_parts import TargetParts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    model_dir: Path
    out: Path  # the head's safetensors; `<out>.ckpt` and `<out>.data` beside it
    prompts_file: Path | None = None
    num_prompts: int = 200
    max_new_tokens: int = 96
    sampled_share: float = 0.5
    temperature: float = 0.8
    label_top_k: int = 8
    seed: int = 0
    epochs: int = 2
    batch_size: int = 4
    lr: float = 1e-3
    ttt_steps: int = 3  # recursion steps trained (EAGLE-3's training-time test)
    feature_weight: float = 0.1
    max_length: int = 512  # tokens per rollout used
    checkpoint_every: int = 20  # optimizer steps
    resume: bool = True
    loss_chunk_rows: int = 256  # rows whose full-vocabulary logits live at once
    chat_template: str = ""  # as the target's setting: "" = the model's own (Gemma 3's for the default model)
    rollout_dtype: str = "bfloat16"  # the engine's dtype for the continuations (as the target serves)
    draft_vocab_size: int = 16384  # tokens the head scores (draft_vocab.py); 0 or >= the vocabulary: all of it
    # "auto": the loss's matmuls in bf16 (autocast; weights and optimizer stay float32) where the
    # CPU multiplies bf16 natively (4x faster for the default model's head), else float32
    train_precision: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir).expanduser())
        object.__setattr__(self, "out", Path(self.out).expanduser())
        for name in ("num_prompts", "max_new_tokens", "label_top_k", "epochs", "batch_size", "ttt_steps",
                     "max_length", "checkpoint_every", "loss_chunk_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.rollout_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"rollout_dtype must be bfloat16, float16 or float32, got {self.rollout_dtype!r}")
        if self.train_precision not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"train_precision must be auto, bfloat16 or float32, got {self.train_precision!r}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if not (0.0 <= self.sampled_share <= 1.0 and self.temperature > 0 and self.lr > 0
                and self.feature_weight >= 0):
            raise ValueError("need 0 <= sampled_share <= 1, temperature > 0, lr > 0, feature_weight >= 0")

    @property
    def checkpoint_path(self) -> Path:
        return self.out.with_name(self.out.name + ".ckpt")

    @property
    def data_path(self) -> Path:
        return self.out.with_name(self.out.name + ".data")

    def data_key(self) -> dict:
        keys = ("prompts_file", "num_prompts", "max_new_tokens", "sampled_share", "temperature", "label_top_k", "seed",
                "rollout_dtype", "chat_template", "draft_vocab_size")
        return {k: str(getattr(self, k)) for k in keys}


@dataclass
class TrainResult:
    path: Path
    losses: list[float] = field(default_factory=list)  # per optimizer step
    steps: int = 0
    resumed_from: int = 0
    num_tokens: int = 0
    data_seconds: float = 0.0  # rollouts and features (0 when reused from `<out>.data`)
    train_seconds: float = 0.0  # this run's optimizer steps (not those of a run it resumed)


def train_head(config: TrainConfig, progress: bool = True, command: str = "") -> TrainResult:
    """Trains (or resumes) the head of `config`; writes the head and `<out>.json`, the record of
    how it was made (`command`, the configuration, the seed, the cost on this machine)."""
    from tqdm import tqdm
    from services.common.models.loading import load_causal_lm

    torch.manual_seed(config.seed)
    model, tokenizer = load_causal_lm(config.model_dir, torch.float32, "cpu")
    model.eval()
    parts = TargetParts.from_model(model, config.model_dir)
    started = time.perf_counter()
    rollouts, vocab = _data(config, model, tokenizer, parts, progress)
    data_seconds = time.perf_counter() - started
    head = FeatureHead(HeadConfig.for_target(parts.text_config, 0 if vocab is None else len(vocab)))
    if vocab is not None:
        head.draft_vocab.copy_(vocab)
    output = DraftOutput(parts, vocab)
    label_index = output.index_of(parts.vocab_size)  # [vocab]: label id -> draft-vocabulary index or -1
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    result = TrainResult(config.out, num_tokens=sum(len(r.token_ids) for r in rollouts), data_seconds=data_seconds)
    batches_per_epoch = math.ceil(len(rollouts) / config.batch_size)
    total = config.epochs * batches_per_epoch
    step = _resume(config, parts.identity, head, optimizer, result)
    bar = tqdm(total=total, initial=step, desc="training head", unit="step", disable=not progress)
    started = time.perf_counter()
    while step < total:
        epoch, index = divmod(step, batches_per_epoch)
        order = list(range(len(rollouts)))
        random.Random(config.seed * 7919 + epoch).shuffle(order)
        batch = [rollouts[i] for i in order[index * config.batch_size:(index + 1) * config.batch_size]]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=_autocast(config)):
            loss = _loss(head, parts, output, label_index, batch, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        result.losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        if step % config.checkpoint_every == 0 or step == total:
            _save_checkpoint(config, parts.identity, head, optimizer, step, result.losses)
    bar.close()
    result.steps = step
    result.train_seconds = time.perf_counter() - started
    save_head(config.out, head, parts.identity,
              {"target_dir": str(config.model_dir), "train": {k: str(v) for k, v in asdict(config).items()}})
    write_record(config, result, parts.identity, command, 0 if vocab is None else len(vocab))
    return result


def write_record(config: TrainConfig, result: TrainResult, identity: str, command: str,
                 draft_vocab_size: int) -> Path:
    """`<out>.json` beside the head: what produced it and what that cost here."""
    path = config.out.with_name(config.out.name + ".json")
    record = {
        "command": command, "seed": config.seed, "target_identity": identity,
        "config": {k: str(v) for k, v in asdict(config).items() if k not in ("model_dir", "out")},
        "head_bytes": config.out.stat().st_size, "draft_vocab_size": draft_vocab_size,
        "tokens": result.num_tokens, "steps": result.steps, "resumed_from": result.resumed_from,
        "loss_first": result.losses[0] if result.losses else None,
        "loss_last_20_mean": sum(result.losses[-20:]) / max(len(result.losses[-20:]), 1),
        "data_seconds": round(result.data_seconds, 1), "train_seconds": round(result.train_seconds, 1),
        "machine": {"cpu": _cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def batch_loss(head: FeatureHead, parts: TargetParts, batch: list[Rollout], config: TrainConfig) -> torch.Tensor:
    """The training loss of one batch (public for tests): mean over steps and valid rows."""
    output = DraftOutput(parts, head.draft_vocab)
    return _loss(head, parts, output, output.index_of(parts.vocab_size), batch, config)


# ---- helpers ------------------------------------------------------------------------------

def _data(config: TrainConfig, model, tokenizer, parts: TargetParts,
          progress: bool) -> tuple[list[Rollout], torch.Tensor | None]:
    """The rollouts and the draft vocabulary (None: the whole vocabulary), from `<out>.data` when
    it was made with the same settings."""
    from tqdm import tqdm
    key = {"identity": parts.identity, **config.data_key()}
    path = config.data_path
    if config.resume and path.exists():
        saved = torch.load(path, weights_only=False)
        if saved.get("key") == key:
            log.info("training data: reusing %s (%d rollouts)", path, len(saved["rollouts"]))
            return saved["rollouts"], saved["vocab"]
    prompts = build_prompts(tokenizer, config.num_prompts, config.seed, config.prompts_file, config.chat_template)
    with tqdm(total=len(prompts), desc="target rollouts", unit="prompt", disable=not progress) as bar:
        continuations = generate_continuations(config.model_dir, prompts, config.max_new_tokens, config.seed,
                                               config.sampled_share, config.temperature, config.rollout_dtype, bar)
    # A reduced vocabulary only where it is smaller than the whole one: a small vocabulary (a tiny
    # test model's 384 tokens) is scored whole, since its top tokens need not all be written.
    vocab = choose_draft_vocab(continuations, config.draft_vocab_size, parts.vocab_size) \
        if 0 < config.draft_vocab_size < parts.vocab_size else None
    # Features as the serving target computes them: the model in the dtype it serves in.
    dtype = getattr(torch, config.rollout_dtype)
    recorder, recorder_parts = model, parts
    if dtype != next(model.parameters()).dtype:
        from services.common.models.loading import load_causal_lm
        recorder = load_causal_lm(config.model_dir, dtype, "cpu")[0].eval()
        recorder_parts = TargetParts.from_model(recorder, config.model_dir)
    with tqdm(total=len(prompts), desc="target features", unit="rollout", disable=not progress) as bar:
        rollouts = record_rollouts(recorder, recorder_parts, prompts, continuations, config.label_top_k, bar, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "rollouts": rollouts, "vocab": vocab}, path)
    return rollouts, vocab


def _autocast(config: TrainConfig) -> bool:
    if config.train_precision == "auto":
        from services.target.model.linear import native_bf16_cpu
        return native_bf16_cpu()
    return config.train_precision == "bfloat16"


def _pad(batch: list[Rollout], max_length: int) -> tuple[torch.Tensor, ...]:
    """-> tokens [b, T], features [b, T, hidden] f32, label ids [b, T, k], label probs [b, T, k],
    lengths [b]."""
    lengths = [min(len(r.token_ids), max_length) for r in batch]
    t = max(lengths)
    b, hidden, k = len(batch), batch[0].features.shape[1], batch[0].label_ids.shape[1]
    tokens = torch.zeros(b, t, dtype=torch.long)
    features = torch.zeros(b, t, hidden)
    label_ids = torch.zeros(b, t, k, dtype=torch.long)
    label_probs = torch.zeros(b, t, k)
    for i, (r, n) in enumerate(zip(batch, lengths)):
        tokens[i, :n], features[i, :n] = r.token_ids[:n], r.features[:n].float()
        label_ids[i, :n], label_probs[i, :n] = r.label_ids[:n], r.label_probs[:n]
    return tokens, features, label_ids, label_probs, torch.tensor(lengths)


def _loss(head: FeatureHead, parts: TargetParts, output: DraftOutput, index: torch.Tensor, batch: list[Rollout],
          config: TrainConfig) -> torch.Tensor:
    """`index`: [vocab] each token id's draft-vocabulary index (-1 outside: that label's mass is dropped)."""
    tokens, features, label_ids, label_probs, lengths = _pad(batch, config.max_length)
    b, t = tokens.shape
    rows = torch.arange(t - 1)  # row j of every step; step s predicts position j + s
    embeds_of = lambda idx: parts.embed(tokens.gather(1, idx[None].expand(b, -1))).float()  # noqa: E731
    inputs = features[:, :t - 1]  # step 1: the true features f_j
    context, diagonal, total, count = None, [], 0.0, 0
    for s in range(1, config.ttt_steps + 1):
        target_pos = (rows + s).clamp(max=t - 1)  # [t - 1]
        valid = (rows + s)[None] < lengths[:, None]  # [b, t - 1]
        if not valid.any():
            break
        positions = (rows + s - 1)[None].expand(b, -1)  # [b, t - 1]
        out, k, v = head.forward_ttt(embeds_of(target_pos), inputs, positions, context, diagonal)
        predicted = parts.final_norm(out)  # [b, t - 1, hidden]
        ce = _soft_ce(output, predicted[valid], index[label_ids[:, target_pos][valid]],
                      label_probs[:, target_pos][valid], config.loss_chunk_rows)
        reg = F.smooth_l1_loss(predicted[valid], features[:, target_pos][valid], reduction="sum")
        total = total + ce + config.feature_weight * reg / predicted.shape[-1]
        count += int(valid.sum())
        if context is None:
            context = (k, v)
        else:
            diagonal.append((k, v))
        inputs = predicted  # step s + 1 feeds the head's own predictions
    return total / max(count, 1)


DIRECT_LOGITS = 1 << 26  # logits (rows x draft vocabulary) the loss keeps for the backward pass: 256 MB


def _soft_ce(output: DraftOutput, predicted: torch.Tensor, label_index: torch.Tensor, label_probs: torch.Tensor,
             chunk: int) -> torch.Tensor:
    """Sum over rows of -sum_k p_k log q(id_k): predicted [n, hidden], labels [n, k] (draft-vocabulary
    indices, -1 for a token outside it: dropped). Where the logits would not fit in 256 MB (a
    large draft vocabulary) they are recomputed in the backward pass, `chunk` rows at a time."""
    def rows_loss(h, index, probs):
        logp = torch.log_softmax(output(h), dim=-1)  # [c, V']
        return -(probs * (index >= 0) * logp.gather(1, index.clamp(min=0))).sum()
    if len(predicted) * output.size <= DIRECT_LOGITS:
        return rows_loss(predicted, label_index, label_probs)
    total = predicted.new_zeros(())
    for i in range(0, len(predicted), chunk):
        total = total + checkpoint(rows_loss, predicted[i:i + chunk], label_index[i:i + chunk],
                                   label_probs[i:i + chunk], use_reentrant=False)
    return total


def _resume(config: TrainConfig, identity: str, head: FeatureHead, optimizer, result: TrainResult) -> int:
    path = config.checkpoint_path
    if not (config.resume and path.exists()):
        return 0
    saved = torch.load(path, weights_only=False)
    if saved.get("identity") != identity or saved.get("setup") != _setup(config):
        log.warning("checkpoint %s is for another target or setup: starting afresh", path)
        return 0
    head.load_state_dict(saved["head"])
    optimizer.load_state_dict(saved["optimizer"])
    result.losses = list(saved["losses"])
    result.resumed_from = saved["step"]
    log.info("resuming from %s at step %d", path, saved["step"])
    return saved["step"]


def _save_checkpoint(config: TrainConfig, identity: str, head: FeatureHead, optimizer, step: int,
                     losses: list[float]) -> None:
    path = config.checkpoint_path
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"identity": identity, "setup": _setup(config), "head": head.state_dict(),
                "optimizer": optimizer.state_dict(), "step": step, "losses": losses}, tmp)
    tmp.replace(path)


def _setup(config: TrainConfig) -> str:
    """What a checkpoint must agree on to be resumed (not `epochs`: a run may be extended)."""
    fields = {k: str(v) for k, v in asdict(config).items() if k not in ("epochs", "resume", "checkpoint_every")}
    return json.dumps(fields, sort_keys=True)
