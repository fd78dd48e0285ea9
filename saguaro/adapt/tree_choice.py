"""What each of the plan's cache trees predicts for a request's SSD round: the pieces ``speed.ssd_gains`` needs
that depend on the tree (``AdaptiveK`` scores every tree with them and builds the batch's round in the best).

* Hit rate: p_hit = sum_d P(d) p_hit^d(F_d) (Appendix A, proof of Thm 13), P(d) the request's outcome law from
  its running estimate (``AcceptanceEstimate.outcome_pmf``), p_hit^d the profile's hit curves at its temperature,
  F the tree's fan-outs at the batch size. ``model_hits`` gives it for a batch of requests at once.
* Tokens of a hit: a tapered tree's branches carry S tokens, except its ``deep_branches`` likeliest ones, which
  carry K: E_hit(k) = (1 - s) E(min(k, S)) + s E(k), s the share of the hit probability on those branches
  (``calibration.hits.deep_share``, with the request's outcome law).
* Build (``TreeBuild``): at each K, the branches a K-draft speculation gets (``branches_at``: its guesses at
  depths 0..K - 1 and the all-accepted outcome's), the profile's time for the glue and K steps of them at the batch
  size beside the verification (``calibration.timeline.build_cost``: the wide steps first, then a tapered tree's
  narrow ones), in the profile's units; how many of the K steps a build makes before the verification's end cuts
  it (``build_time``: the pass in flight finishes), and the verification's bus slowdown beside a pass that wide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from saguaro.calibration.hits import deep_share, depth_curves
from saguaro.calibration.profile import Source, Timing
from saguaro.calibration.timeline import build_cost, build_time, slowdowns
from saguaro.engine.sequence import Sequence
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.speculator import seq_temperature
from saguaro.ssd_settings import DraftedBy


@dataclass
class TreeBuild:
    """A build in one tree for one batch, at K = 0..max_k (profile units)."""
    cost: np.ndarray  # [max_k + 1]: seconds of the glue and K steps, all made
    done: np.ndarray  # [max_k + 1]: the steps a build asked for K makes before the verification ends (<= K)
    cut_s: np.ndarray  # [max_k + 1]: seconds until a build asked for K stops (its steps made, the one in flight)
    slowdown: np.ndarray  # [max_k + 1]: the verification's, beside the passes of a build at K


def branches_at(fan_outs: np.ndarray) -> np.ndarray:
    """[B, K + 1]: the branches a speculation of k = 0..K drafts builds in a tree of ``fan_outs`` [B, K + 1]: its
    guesses at depths 0..k - 1 and the all-accepted outcome's F_K (``ssd.outcomes.predict_outcomes``)."""
    k = fan_outs.shape[1] - 1
    shallow = np.concatenate([np.zeros((len(fan_outs), 1)), np.cumsum(fan_outs[:, :k], axis=1)], axis=1)
    return shallow + fan_outs[:, [k]]


@dataclass
class TreeModel:
    plan: SpecPlan  # its trees: its own (0) and its options
    timing: Timing  # the profile's costs
    sources: list[Source]  # the profile's primary source per prior temperature (``Priors.temperatures`` order)
    curves: list[np.ndarray] = field(init=False)  # per source: [K + 1, F + 1] p_hit^d(F), index K all accepted
    _builds: dict[tuple, TreeBuild] = field(default_factory=dict)

    def __post_init__(self) -> None:
        width = max(len(c) for s in self.sources for c in s.hit_curves) if self.sources else 1
        self.curves = [np.array([np.pad(c, (0, width - len(c)), mode="edge") for c in depth_curves(s, self.plan.k)])
                       for s in self.sources]

    @property
    def trees(self) -> int:
        return self.plan.trees

    def fan_outs(self, seqs: list[Sequence], tree: int, batch: int) -> np.ndarray:
        """[B, K + 1]: each sequence's F_0..F_K in ``tree`` (after a primary speculation)."""
        temperatures = [seq_temperature(s) for s in seqs]
        lists = {t: self.plan.fan_out(t, DraftedBy.PRIMARY, batch, tree) for t in set(temperatures)}
        return np.array([lists[t] for t in temperatures]).reshape(len(seqs), self.plan.k + 1)

    def model_hits(self, fan_outs: np.ndarray, weights: np.ndarray, sources: list[int]) -> np.ndarray:
        """[B]: p_hit of each request's K-draft speculation, ``weights[b]`` its outcome law over depths 0..K
        (K = ``weights.shape[1] - 1`` <= the plan's; its all-accepted outcome takes the plan's F_K)."""
        k = weights.shape[1] - 1
        depths = np.r_[np.arange(k), self.plan.k]
        rows, out = np.asarray(sources), np.empty(len(sources))
        for i in set(sources):  # one gather per prior temperature
            mine, curves = rows == i, self.curves[i]
            hits = curves[depths[None, :], np.minimum(fan_outs[mine][:, depths], curves.shape[1] - 1)]
            out[mine] = (weights[mine] * hits).sum(axis=1)
        return np.clip(out, 0.0, 1.0)

    def hit_tokens(self, seqs: list[Sequence], tree: int, fan_outs: np.ndarray, tokens: np.ndarray,
                   weights: np.ndarray, sources: list[int]) -> np.ndarray:
        """[B, K + 1]: E_hit(k) of each request in ``tree`` (``tokens[b, k]`` = E(k), its untapered value)."""
        k = tokens.shape[1] - 1
        out = tokens.copy()
        for b, seq in enumerate(seqs):
            steps = self.plan.steps_for(seq_temperature(seq), tree)
            if steps is None or steps >= k:
                continue
            f = list(fan_outs[b, :k]) + [int(fan_outs[b, -1])]
            share = deep_share(self.sources[sources[b]], f, k, self.plan.deep_branches, weights[b])
            out[b] = (1 - share) * tokens[b, np.minimum(np.arange(k + 1), steps)] + share * tokens[b]
        return out

    def build(self, seqs: list[Sequence], tree: int, batch: int, max_k: int, depth: int | None = None) -> TreeBuild:
        """A build in ``tree`` for this batch at K = 0..max_k: its sequences' mean branch count at each K, the
        tree's taper at the first one's temperature. ``depth``: the batch's build goes that many steps (the
        deepest K asked of it: ``AdaptiveK._deepest``), so at a K below it the verification is shorter than
        the build and cut it, and the pass in flight is waited for; None (or a K above it): K steps."""
        rows = branches_at(self.fan_outs(seqs, tree, batch)).mean(axis=0)[:max_k + 1]
        rows = tuple(int(n) for n in np.maximum(1, np.round(rows)))
        steps = self.plan.steps_for(seq_temperature(seqs[0]), tree)
        key = (rows, steps, batch, depth)
        if key not in self._builds:
            deep, cost, done, cut, slow = self.plan.deep_branches, [], [], [], []
            for k, n in enumerate(rows):
                d = k if depth is None else max(k, depth)  # the steps the build goes, each n rows per sequence
                whole = build_cost(self.timing, d, batch, n, steps, deep)
                made = build_time(self.timing, d, batch, n, steps, deep, verify_rows=batch * (k + 1)).deep_steps
                done.append(min(made, k))  # a hit carries at most the K asked
                cost.append(whole[k])
                cut.append(whole[made])
                slow.append(slowdowns(self.timing, batch * n)[0])
            self._builds[key] = TreeBuild(*(np.array(v) for v in (cost, done, cut, slow)))
        return self._builds[key]
