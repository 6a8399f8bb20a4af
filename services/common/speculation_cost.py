"""The cost side of speculation, shared by the router's plan and the target's per-step choice.

Words (docs/speculation.md): α = acceptance rate, E[A](d) = accepted + bonus tokens per verify
pass of a chain of d draft tokens. The router predicts α per request and puts it in the plan
(`SpeculationPlan.acceptance_prior`); the target decides per engine step how deep the plan's
sequences draft, from what it measures:

- `StepCostModel`: the step's forward time as a function of the tokens it computes and
  the logit rows it needs, t = a + b·tokens + c·rows, fitted online from every step;
- the draft call's time (a moving mean of the measured calls);
- each sequence's own α (`sequence_alpha`), starting from the router's prediction.

Speculation spends idle compute: with a small batch a verify pass of d+1 tokens per sequence
costs about as much as a decode step, with a large one it costs d+1 times more, and a step
that prefills a waiting request makes that request's TTFT pay for every verified draft token
(`LoadAwareDepth.choose`, `prefill_tokens`). So does a request that arrives while the step
runs: it waits for the step before its prefill can start (`arrival_rate`).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

DEFAULT_ALPHA = 0.3  # a sequence's α before it is measured, when the router predicted none


def expected_tokens(alpha: float, depth: int) -> float:
    """E[A](d): accepted + bonus tokens per verify pass of a chain of `depth` draft tokens."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


def sequence_alpha(proposed: int, accepted: int, prior: float | None = None, prior_tokens: float = 2.0) -> float:
    """A sequence's acceptance estimate: its own counts with a weak prior — the router's
    prediction for its bucket, temperature and length when the plan carries one (one pass of
    rejected drafts is enough to stop a sequence that does not accept)."""
    prior = DEFAULT_ALPHA if not prior else prior
    return (accepted + prior * prior_tokens) / (proposed + prior_tokens)


class StepCostModel:
    """Engine step time from what the forward pass computes: t ≈ a + b·tokens + c·rows + e·trees.

    tokens: positions computed (prompt chunks, decodes, draft-tree nodes); rows: positions
    that get logits (one per sampled position; every node of a verify pass). A logit row runs
    the LM head, which on a large vocabulary costs more than the rest of a token's forward
    (Gemma 3: 262k × 640), so a verify pass is dearer per token than a prompt chunk and one
    slope would underprice speculation. trees: sequences verifying a draft tree; each leaves
    the batched decode path (its attention is masked, row by row) and is accepted and compacted
    on its own, a cost per tree whatever its size (measured on Gemma 3 270M here, 2 cores: a
    step of 8 sequences 42 ms plain, 53-59 ms with ~4.5 draft nodes in all, far more than
    4.5 logit rows). Fitted online by exponentially weighted least
    squares (`decay` per step), so it follows the machine as it is now (other load, thermal
    state); a slope that comes out negative is dropped. Not thread-safe: the engine thread
    owns it.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 16, refit_every: int = 8) -> None:
        self.decay = decay
        self.min_steps = min_steps
        # Steps between refits once fitted: the fit moves ~2% a step at the default decay, and
        # a refit (a small least-squares solve) read before every step cost ~60 µs of the
        # engine thread's time there.
        self.refit_every = refit_every
        self._fitted_at = 0  # `steps` when the fit was last computed
        self._xx = np.zeros((4, 4))  # decayed sum of x xᵀ, x = (1, tokens, rows, trees)
        self._xt = np.zeros(4)  # decayed sum of x t
        self._fit: tuple[float, float, float, float] | None = None
        self._stale = True
        self.steps = 0

    def observe(self, num_tokens: int, seconds: float, num_logits: int | None = None,
                num_trees: int = 0) -> None:
        """One step: its tokens, its time, its logit rows (None: one per token), its draft trees."""
        x = np.array([1.0, num_tokens, num_tokens if num_logits is None else num_logits, num_trees])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xt = self.decay * self._xt + x * seconds
        self.steps += 1
        self._stale = True

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps and self.coefficients() is not None

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, e): seconds, per token, per logit row, per draft tree; None while the steps
        do not vary in size. Where tokens and rows always move together (no prompt chunks
        seen yet) b and c share the common slope; e is 0 until trees are seen."""
        if self._stale and (self._fit is None or self.steps - self._fitted_at >= self.refit_every):
            self._fit, self._stale, self._fitted_at = self._solve(), False, self.steps
        return self._fit

    def predict(self, num_tokens: float, num_logits: float | None = None, num_trees: float = 0) -> float:
        a, b, c, e = self.coefficients() or (0.0, 0.0, 0.0, 0.0)
        return a + b * num_tokens + c * (num_tokens if num_logits is None else num_logits) + e * num_trees

    def _solve(self) -> tuple[float, float, float, float] | None:
        w = self._xx[0, 0]
        if w == 0 or self._xx[1, 1] / w - (self._xx[0, 1] / w) ** 2 <= 1e-9:
            return None
        active = [0, 1, 2, 3]
        while True:
            xx, xt = self._xx[np.ix_(active, active)], self._xt[active]
            coef = np.linalg.lstsq(xx, xt, rcond=1e-12)[0]  # minimum norm where rank-deficient
            negative = [i for i, k in zip(active[1:], coef[1:]) if k < 0]
            if not negative:
                break
            active.remove(negative[0])  # a slope the data cannot support: refit without it
        fit = dict.fromkeys(range(4), 0.0) | {i: float(k) for i, k in zip(active, coef)}
        return max(fit[0], 0.0), fit[1], fit[2], fit[3]


class LoadAwareDepth:
    """Per engine step: each candidate's draft depth, chosen so the step's rows wait least per
    output token (the mean TPOT users see) within the step's first-token and time-per-token
    bounds.

    `choose(plain_tokens, plain_outputs, alphas, max_depths, prefill_tokens, ...)`:
    - plain_tokens: tokens the step computes for sequences that do not speculate (prefill
      chunks, plain decodes); plain_outputs: tokens those commit (decodes only);
      plain_logits: their logit rows (default: plain_outputs); plain_trees: their draft trees
      (fixed plans);
    - alphas / max_depths: each speculation candidate's acceptance estimate and plan limit;
    - prefill_tokens: of plain_tokens, those of requests still waiting for their first token;
    - waiting: requests queued now that this step does not start (no seat, budget or blocks
      left);
    - arrival_rate: new requests per second lately (the scheduler's measure);
    - full: every seat is taken.
    Returns one depth per candidate (0 = decode normally this step).

    The objective: the step's time over each row's tokens, summed over rows (a plain row pays
    the whole step for one token, a speculating row the step over E[A]). Maximising the batch's
    tokens per second instead let one copy-heavy row's deep draft slow its three batch-mates:
    at 50% load that made code edits 20% faster and chat and tool rows 8-12% slower, mean TPOT
    2% worse (issue 32); summed time per token counts each row's wait.

    Depths per sequence, not one for the step: the k-th draft node of a chain at acceptance α
    adds α^k expected tokens (E[A](d) − E[A](d−1)) and costs the same as any other node, so the
    nodes worth verifying are the ones with the largest α^k, whoever's they are. The chooser
    prices every prefix of the candidates' nodes ranked by α^k (each sequence's nodes come in
    order, so a prefix is a depth per sequence) and every common depth, and takes the best that
    keeps the bounds; a copy-heavy sequence drafts deep beside a chat sequence that drafts
    little or not at all (per sequence what SmartSpec, "Optimizing Speculative Decoding for
    Serving LLMs Using Goodput", does per batch).

    Bounds, by what the step's time means to the requests around it:
    - a request queued for a seat, budget or blocks (`waiting`) waits until seated sequences
      finish: no row of the step may get its tokens more slowly than in a plain step, with the
      model's error margin — a plain row pays the whole step for its one token, a speculating
      row the step over its expected tokens E[A]. Near saturation that queue wait is most of the
      first-token tail, and it amplifies: at 85% load a 5% slower seat release made every
      bucket's P99 TTFT ~40% later (issue 32), where slowing no row releases seats no later;
    - a request prefilled in the step: its first token may come at most `ttft_slack` of the
      plain step later; one that may arrive while the step runs waits for it with chance
      1 − exp(−λ·t_spec), and that expected delay stays within the same slack;
    - every seat taken (nobody queued): no row's time per token beyond `tpot_slack` of a plain
      step (a faster batch frees no seat sooner for anyone already seated, so speculation must
      not be paid for by batch-mates' time per token). Below saturation the objective
      decides alone (idle compute is spare).
    """

    def __init__(self, cost: StepCostModel | None = None, ewma: float = 0.2, min_alpha: float = 0.05,
                 margin: float = 1.05, ttft_slack: float = 0.05, tpot_slack: float = 0.05) -> None:
        self.cost = cost or StepCostModel()
        self.draft_seconds: float | None = None  # moving mean of one batched draft call
        self.ewma = ewma
        self.min_alpha = min_alpha
        self.margin = margin  # speculation must beat plain decoding by this factor (model error)
        self.ttft_slack = ttft_slack  # expected first-token delay per step, of a plain step (the goal's 5%)
        self.tpot_slack = tpot_slack  # all seats taken: a row's time per token, of a plain step's

    def observe_draft(self, seconds: float) -> None:
        w = self.ewma
        self.draft_seconds = seconds if self.draft_seconds is None else (1 - w) * self.draft_seconds + w * seconds

    def choose(self, plain_tokens: int, plain_outputs: int, alphas: list[float],
               max_depths: list[int], prefill_tokens: int = 0, plain_logits: int | None = None,
               arrival_rate: float = 0.0, plain_trees: int = 0, waiting: int = 0,
               full: bool = False, draft_calls: list[bool] | None = None) -> list[int]:
        """Each candidate's depth (at most its own max depth; 0 = decode plainly).
        `draft_calls[i]`: whether candidate i's draft costs a draft-service call (default all);
        the step pays that call once if any such candidate drafts (a grammar's forced chain is
        drafted by the target itself).

        It runs before every step of a load-aware batch, so each candidate vector is priced
        from the one before in O(1): near saturation its time is the queue's (issue 32: at 85%
        load, plans that drafted nothing made steps 2-3% longer and every bucket's P99 TTFT
        ~20% later)."""
        n = len(alphas)
        if not n:
            return []
        if waiting and plain_outputs and self.margin >= 1:
            # A queued request: no row may get its tokens more slowly than in a plain step. A
            # plain row of this step gains nothing while every draft node lengthens the step
            # (the fit's slopes are never negative), so no vector qualifies: decided without
            # reading the fit, as on most steps near saturation.
            return [0] * n
        if not self.cost.ready:
            # Not measured yet: the plan as asked, except when a first token waits (its TTFT would pay).
            return [0] * n if prefill_tokens or waiting else list(max_depths)
        a, b, c, e = self.cost.coefficients()
        rows = (plain_outputs if plain_logits is None else plain_logits) + n  # logit rows without speculation
        tokens = plain_tokens + n
        plain_time = self.cost.predict(tokens, rows, plain_trees)
        known = bool(prefill_tokens or waiting)  # a first token certainly waits for this step
        rate = max(arrival_rate, 0.0)
        draft = self.draft_seconds or 0.0
        calls = [True] * n if draft_calls is None else draft_calls
        eligible = [al >= self.min_alpha for al in alphas]
        # The least any vector that may pass adds to the step: one node, one tree, and the draft
        # call unless a candidate drafts without one. Where that alone delays a first token past
        # the slack, every vector does (the usual verdict beside a queue or a prefill).
        if waiting and self.margin >= 1:
            # Beside a queue only a vector drafting for every row can pass (a row that does not
            # draft gains nothing): each candidate one node and one tree at least.
            if not all(eligible):
                return [0] * n
            least = n * (b + c + e) + (draft if any(calls) else 0.0)
        else:
            least = b + c + e + (0.0 if any(ok and not call for ok, call in zip(eligible, calls)) else draft)
        pending = 1.0 if known else 1.0 - math.exp(-rate * (plain_time + least))
        if not any(eligible) or pending * least > self.ttft_slack * plain_time:
            return [0] * n
        # gain[i][k]: tokens per verify pass of candidate i at depth k (E[A](k); 1 = a plain
        # decode), filled as the walk reaches k
        gain = [[1.0] for _ in range(n)]

        def gain_at(i: int, k: int) -> float:
            g = gain[i]
            while len(g) <= k:
                g.append(expected_tokens(alphas[i], len(g)))
            return g[k]

        def per_token(nodes: int, trees: int, calling: bool, slowest: float, inv_gains: float):
            """The objective for a vector with these totals: the step's rows' time per output
            token, summed (a plain row pays the step for one token, a speculating row the step
            over E[A]; the mean TPOT users see); None where a bound refuses it, PAST where the
            first-token bound does, which then refuses every vector with more nodes (the step
            only grows with them)."""
            step_time = a + b * (tokens + nodes) + c * (rows + nodes) + e * (plain_trees + trees) \
                + (draft if calling else 0.0)
            pending = 1.0 if known else 1.0 - math.exp(-rate * step_time)
            if pending * (step_time - plain_time) > self.ttft_slack * plain_time:
                return _PAST  # a first token would wait too long for this step
            if waiting and step_time * self.margin > plain_time * slowest:
                return None  # a seated row would finish later: the queue's seat later
            if full and step_time > (1 + self.tpot_slack) * plain_time * slowest:
                return None  # that row's time per token would grow past the slack
            return step_time * (plain_outputs + inv_gains)

        best_per_token = plain_time * (plain_outputs + n)
        best_common: list[int] | None = None  # the best vector where it is a common depth
        best_prefix = 0  # else the best is the walk's first best_prefix nodes (0: plain)

        def beats(value) -> bool:
            # The first speculating vector must beat plain decoding by the margin (model error).
            drafts = best_prefix or best_common is not None
            return value is not None and value * (1.0001 if drafts else self.margin) < best_per_token

        # Every prefix of the candidates' nodes ranked by their marginal gain α^k (a sequence's
        # nodes in order, so each prefix is a depth per sequence), one node more each: the
        # candidates' descending α^k merged, ties to the lower index.
        depths = [0] * n
        walked = []  # the candidate each node of the walk went to, in order
        nodes = trees = callers = 0
        inv_gains = float(n)  # Σ 1 / gain over the candidates
        drafted = []  # heap of (gain, i) over candidates with nodes: the least gain (stale entries skipped)
        ranked = [(-alphas[i], i) for i in range(n) if eligible[i] and max_depths[i] >= 1]
        heapq.heapify(ranked)
        while ranked:
            i = ranked[0][1]
            k = depths[i] = depths[i] + 1
            walked.append(i)
            if k < max_depths[i]:
                heapq.heapreplace(ranked, (-alphas[i] ** (k + 1), i))
            else:
                heapq.heappop(ranked)
            nodes += 1
            inv_gains += 1.0 / gain_at(i, k) - 1.0 / gain_at(i, k - 1)
            if k == 1:
                trees, callers = trees + 1, callers + bool(calls[i])
            heapq.heappush(drafted, (gain_at(i, k), i))
            slowest = 1.0  # a plain row or an undrafted candidate gains 1.0, the least there is
            if trees == n and not plain_outputs:
                while drafted[0][0] != gain[drafted[0][1]][depths[drafted[0][1]]]:
                    heapq.heappop(drafted)
                slowest = drafted[0][0]
            value = per_token(nodes, trees, callers > 0, slowest, inv_gains)
            if value is _PAST:
                break
            if beats(value):
                best_prefix, best_per_token = nodes, value
        # One common depth for all (where a bound needs every row to gain, the ones that accept
        # least included, as a row that does not speculate gains nothing).
        for d in range(1, max(max_depths, default=0) + 1):
            common = [min(d, m) if ok else 0 for m, ok in zip(max_depths, eligible)]
            gains = [gain_at(i, k) for i, k in enumerate(common)]
            value = per_token(sum(common), sum(1 for k in common if k),
                              any(k and call for k, call in zip(common, calls)),
                              min(gains + ([1.0] if plain_outputs else [])), sum(1.0 / g for g in gains))
            if value is _PAST:
                break
            if any(common) and beats(value):
                best_common, best_per_token = common, value
        if best_common is not None:
            return best_common
        best = [0] * n
        for i in walked[:best_prefix]:
            best[i] += 1
        return best


_PAST = object()  # LoadAwareDepth.choose: a vector past the first-token bound
