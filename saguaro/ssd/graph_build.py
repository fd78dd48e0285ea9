"""The speculator's build as one captured graph per (batch bucket, tree layout): no host work between its passes.

Why: on a GPU the Python build (``Speculator._glue`` and ``_decode_branches``) spends far more host time than its
passes take (about 250 torch calls, 60 eager kernels and a blocking read of the glue's ranking per round), and
that time is taken from the target's thread too. Here the host packs one int64 staging row per sequence, copies
it once, and replays one graph that does the rest on the device:

1. the glue pass: K + 1 rows per sequence, the last verified token and d_1..d_K, ghosts where the draft cache
   already holds a position (their ranked ids come staged, from the last response);
2. the branch roots: each depth's top F_k ids (the drafted token excluded) scored as ``predict_outcomes`` does
   and sorted likeliest first, all on the device; the cache keys (k, t*) stay there;
3. the K tree steps, every sequence's first ``widths[j]`` branches at step j, their k/v in scratch slots;
4. sampling: argmax, or inverse-CDF from ``counter_rng`` uniforms keyed by the request's seed and the draw;
5. the writes of the token table, the rank table and the distributions.

A shape (``BuildShape``) fixes everything a graph's buffers depend on: B sequences (a bucket; ghost sequences pad
it), K, the fan-outs, the step widths, the ranked ids kept, the block tables' width, and whether any row samples
or filters. A build whose sequences do not share one shape (a plan per temperature, a short speculation, an
EAGLE-3 head, Saguaro C < 1, a calibration recorder) goes through the Python build, which gives the same results.

Staging row of a sequence (int64; floats as their float64 bits), in this order:

    valid | base | known | greedy | temperature | top_k | top_p | seed | fed [K+1] | table [MB] | scratch [S]
    | ranked ids [(K+1) W] | ranked probs [(K+1) W]

``base``: the last verified token's position; ``known``: how many leading depths the draft cache already holds
(their ranked ids are staged); ``fed``: the tokens at positions base..base+K.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from saguaro.backends.paged.graphs import CAPTURE_LOCK
from saguaro.backends.paged.metadata import PagedMetadata
from saguaro.device import to_device
from saguaro.sampling.ranked import rank_table
from saguaro.sampling.sampler import inverse_cdf
from saguaro.ssd.counter_rng import branch_counter, counter_uniforms
from saguaro.ssd.spoken import Spoken

log = logging.getLogger("saguaro.ssd")
HEAD = ("valid", "base", "known", "greedy", "temperature", "top_k", "top_p", "seed")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def float_bits(x: float) -> int:
    return _I64.unpack(_F64.pack(float(x)))[0]


@dataclass(frozen=True)
class BuildShape:
    seqs: int  # B, a bucket of SEQ_BUCKETS
    k: int
    counts: tuple[int, ...]  # outcomes prepared at each depth 0..K (F_k, capped by what the ranking holds)
    widths: tuple[int, ...]  # branches decoded at each step 0..K-1 (non-increasing)
    width: int  # W: ranked ids kept per position
    table_width: int  # MB: block-table entries staged per sequence
    sampled: bool  # some row samples (else every draw is the argmax of the logits)
    filters: bool  # some row uses top-k or top-p

    @property
    def branches(self) -> int:
        return sum(self.counts)

    @property
    def offsets(self) -> list[int]:
        """Scratch index of each step's first slot (``BranchLayout.step_offsets``), and the scratch size last."""
        return list(accumulate(self.widths, initial=0))

    @property
    def columns(self) -> dict[str, tuple[int, int]]:
        """Each staging field's (first column, width)."""
        sizes = [1] * len(HEAD) + [self.k + 1, self.table_width, self.offsets[-1], (self.k + 1) * self.width,
                                   (self.k + 1) * self.width]
        names = HEAD + ("fed", "table", "scratch", "rank_ids", "rank_probs")
        return {n: (s - w, w) for n, w, s in zip(names, sizes, accumulate(sizes))}

    @property
    def row_size(self) -> int:
        return sum(w for _, w in self.columns.values())

    @property
    def pass_rows(self) -> list[int]:
        """Rows of step j's pass (numbered across the build's steps) before it, for each j, and their total."""
        return list(accumulate((self.seqs * w for w in self.widths), initial=0))


@dataclass
class BuildOutputs:
    """A build's results, in the graph's static buffers: read them before its next replay."""
    keys: torch.Tensor  # [B, branches, 2] long: outcome (k, t*) of each sequence's branch q, likeliest first
    tokens: torch.Tensor  # [B * branches, K] long: branch q of sequence n is row n * branches + q; -1 unbuilt
    rank_ids: torch.Tensor  # [pass rows, W]: step j's row n * widths[j] + q is pass row pass_rows[j] + that
    rank_probs: torch.Tensor  # [pass rows, W] float32
    probs: torch.Tensor | None  # [pass rows, V] the distributions drawn from; None when no row samples


def tempered(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             filters: bool) -> torch.Tensor:
    """``probs_from_logits`` with its choices made by the shape, not read from the rows (a graph cannot read
    them), op for op, so the distributions are bitwise the Python build's; greedy rows' are one-hot."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    x = shifted / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    if filters:
        use_k = (top_k > 0) & (top_k < vocab) & ~greedy
        kth = x.sort(dim=-1, descending=True).values.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        x = x.masked_fill(x < torch.where(use_k.unsqueeze(1), kth, torch.full_like(kth, float("-inf"))), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if filters:
        use_p = (top_p < 1) & ~greedy
        sorted_p = probs.sort(dim=-1, descending=True).values
        cum = torch.cumsum(sorted_p.double(), dim=-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        cutoff = sorted_p.gather(1, (n_keep - 1).unsqueeze(1))
        cut = probs.masked_fill(probs < cutoff, 0.0)
        probs = torch.where(use_p.unsqueeze(1), cut / cut.sum(dim=-1, keepdim=True), probs)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), one_hot, probs)


class GraphBuild:
    """The build graphs of one draft (``PagedCausalLM`` over its KV cache), captured per ``BuildShape`` with the
    paged backend's capture (a CUDA graph, or on the CPU the stand-in that checks what a capture forbids)."""

    def __init__(self, net, cache, capture: Callable, device: torch.device):
        self.net, self.cache, self.capture, self.device = net, cache, capture, device
        self.graphs: dict[BuildShape, tuple[torch.Tensor, torch.Tensor, Callable[[], None], BuildOutputs]] = {}
        self._copied = None  # on a GPU: an event after the last staging copy
        self.started = False  # capture_all ran: a capture now is one beside the target

    @torch.inference_mode()
    def run(self, shape: BuildShape, rows: list[list[int]], spoken: Spoken | None = None,
            from_spoken: list[tuple[int, int]] = ()) -> BuildOutputs:
        """Stage ``rows`` (one per real sequence, ``graph_staging``) in one copy and replay ``shape``'s graph.
        ``from_spoken``: (staging row, ``spoken`` row) of the sequences whose d_1..d_K and ranked ids are still on
        the device, written into their staging rows there (a constant number of calls, no read)."""
        host, staged, replay, out = self._graph(shape)
        if self._copied is not None:
            self._copied.synchronize()  # the last build's copy out of its pinned buffer has run (long since)
        host[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        host[len(rows):] = 0  # ghost sequences
        staged.copy_(host, non_blocking=True)
        if staged.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if from_spoken:
            _stage_spoken(shape, staged, spoken, from_spoken)
        replay()
        return out

    def capture_all(self, shapes: list[BuildShape]) -> None:
        """Capture ``shapes`` now, at start-up (``graph_staging.startup_shapes``); a shape outside them is still
        captured on first use, with a warning: on a GPU that capture runs while the target serves."""
        for shape in shapes:
            self._graph(shape)
        self.started = True
        log.info("captured %d build graphs of the speculator at start-up", len(shapes))

    def _graph(self, shape: BuildShape):
        if shape not in self.graphs:
            with CAPTURE_LOCK:
                (log.warning if self.started else log.info)("capturing the speculator's build graph for %s%s", shape,
                                                            " after start-up" if self.started else "")
                self.graphs[shape] = self._make(shape)
        return self.graphs[shape]

    @torch.inference_mode()
    def _make(self, shape: BuildShape):
        rows, dev = shape.pass_rows[-1], self.device
        host = torch.zeros(shape.seqs, shape.row_size, dtype=torch.int64, pin_memory=dev.type == "cuda")
        staged = host.to(dev, copy=True)  # all ghosts: the capture writes no cache slot
        out = BuildOutputs(torch.zeros(shape.seqs, shape.branches, 2, dtype=torch.long, device=dev),
                           torch.full((shape.seqs * shape.branches, shape.k), -1, dtype=torch.long, device=dev),
                           torch.zeros(rows, shape.width, dtype=torch.long, device=dev),
                           torch.zeros(rows, shape.width, device=dev),
                           torch.zeros(rows, self.net.config.vocab_size, device=dev) if shape.sampled else None)
        depths = torch.tensor([d for d, n in enumerate(shape.counts) for _ in range(n)], dtype=torch.long, device=dev)
        replay, _ = self.capture(lambda: self._build(shape, staged, depths, out))
        return host, staged, replay, out

    def _build(self, shape: BuildShape, staged: torch.Tensor, depths: torch.Tensor, out: BuildOutputs
               ) -> torch.Tensor:
        """The whole build on the device, from ``staged`` into ``out``'s buffers; returns the keys. ``depths``:
        the fork depth of each outcome before sorting (``counts`` spelled out)."""
        f = _Fields(shape, staged)
        ranks_ids, ranks_probs = self._glue(shape, f)
        keys = _outcomes(shape, f, ranks_ids, ranks_probs, depths)
        out.keys.copy_(keys)
        out.tokens.fill_(-1)
        table = out.tokens.view(shape.seqs, shape.branches, shape.k)
        offsets, done, drawn = shape.offsets, shape.pass_rows, None
        for j, w in enumerate(shape.widths):
            ids = keys[:, :w, 1] if j == 0 else drawn.view(shape.seqs, -1)[:, :w]
            logits = self._tree_step(shape, f, keys[:, :w, 0], ids, offsets, j)
            top = rank_table(logits, shape.width)
            out.rank_ids[done[j]:done[j + 1]].copy_(top.ids)
            out.rank_probs[done[j]:done[j + 1]].copy_(top.probs)
            drawn = self._draw(shape, f, logits, keys[:, :w, 0], j, out, done)
            table[:, :w, j] = drawn.view(shape.seqs, w)
        return out.keys

    def _glue(self, shape: BuildShape, f: "_Fields") -> tuple[torch.Tensor, torch.Tensor]:
        """Feed positions base+known..base+K of every sequence; the ranked ids at each depth 0..K [B, K+1, W]:
        staged for the known depths, fresh from the pass for the others."""
        b, k, bs = shape.seqs, shape.k, self.cache.block_size
        depth = torch.arange(k + 1, device=self.device)
        pos = f.base[:, None] + depth
        real = f.valid[:, None] & (depth >= f.known[:, None])
        block = f.table.gather(1, (pos // bs).clamp(max=shape.table_width - 1))
        meta = PagedMetadata(torch.where(real, block * bs + pos % bs, -1).reshape(-1), f.table.to(torch.int32),
                             _groups(b, k + 1, self.device), torch.where(real, pos + 1, 0).to(torch.int32).reshape(-1),
                             torch.zeros(b * (k + 1), 0, dtype=torch.long, device=self.device),
                             torch.zeros(b * (k + 1), dtype=torch.int32, device=self.device), bs)
        hidden = self.net(torch.where(real, f.fed, 0).reshape(-1), torch.where(real, pos, 0).reshape(-1),
                          self.cache, meta)
        fresh = rank_table(self.net.logits(hidden), shape.width)
        known = (depth < f.known[:, None])[..., None]
        ids = torch.where(known, f.rank_ids, fresh.ids.view(b, k + 1, -1))
        probs = torch.where(known, f.rank_probs, fresh.probs.view(b, k + 1, -1))
        return ids, probs

    def _tree_step(self, shape: BuildShape, f: "_Fields", forks: torch.Tensor, ids: torch.Tensor,
                   offsets: list[int], j: int) -> torch.Tensor:
        """Logits [B * w, V] of step j: branch q of sequence n (row n * w + q) at position L + k_q + j, seeing the
        table up to its fork and its own scratch slots of steps 0..j (``BranchLayout.step_item``)."""
        b, w = forks.shape
        valid = f.valid[:, None]
        own = torch.stack([f.scratch[:, o:o + w] for o in offsets[:j + 1]], -1)  # [B, w, j + 1]
        prefix = f.base[:, None] + 1 + forks
        meta = PagedMetadata(torch.where(valid, own[..., j], -1).reshape(-1), f.table.to(torch.int32),
                             _groups(b, w, self.device), torch.where(valid, prefix, 0).to(torch.int32).reshape(-1),
                             own.reshape(b * w, j + 1),
                             torch.where(valid, j + 1, 0).to(torch.int32).expand(b, w).reshape(-1).contiguous(),
                             self.cache.block_size)
        hidden = self.net(ids.reshape(-1), (prefix + j).reshape(-1), self.cache, meta)
        return self.net.logits(hidden)

    def _draw(self, shape: BuildShape, f: "_Fields", logits: torch.Tensor, forks: torch.Tensor, j: int,
              out: BuildOutputs, done: list[int]) -> torch.Tensor:
        """Step j's tokens: the argmax, or inverse-CDF draws from each request's counter uniforms."""
        if not shape.sampled:
            return logits.argmax(dim=-1)
        b, w = forks.shape

        def per_row(x):
            return x[:, None].expand(b, w).reshape(-1)
        probs = tempered(logits, per_row(f.temperature).float(), per_row(f.top_k), per_row(f.top_p), shape.filters)
        out.probs[done[j]:done[j + 1]].copy_(probs)
        branch = torch.arange(w, device=self.device)[None, :]
        u = counter_uniforms(f.seed[:, None], branch_counter(f.base[:, None] + 1, forks, branch, j)).reshape(-1)
        return torch.where(per_row(f.greedy), probs.argmax(dim=-1), inverse_cdf(probs, u))


def _stage_spoken(shape: BuildShape, staged: torch.Tensor, spoken: Spoken, pairs: list[tuple[int, int]]) -> None:
    """Write d_1..d_K and the ranked ids of depths 0..K-1 (past what a sequence brought they are masked by its
    ``known``) from ``spoken`` into the staging rows, on the device: one index copy, three gathers."""
    index = to_device(torch.tensor(pairs, dtype=torch.long).T, staged.device)
    dst, src = index[0], index[1]
    cols, k, width = shape.columns, shape.k, shape.width
    fed, ids, probs = cols["fed"][0], cols["rank_ids"][0], cols["rank_probs"][0]
    staged[dst, fed + 1:fed + 1 + k] = spoken.tokens[src]
    staged[dst, ids:ids + k * width] = spoken.rank_ids[src].reshape(len(pairs), -1)
    staged[dst, probs:probs + k * width] = spoken.rank_probs[src].double().view(torch.int64).reshape(len(pairs), -1)


class _Fields:
    """The staged fields, as views and typed tensors on the device."""

    def __init__(self, shape: BuildShape, staged: torch.Tensor):
        cols = shape.columns

        def col(name):
            start, width = cols[name]
            return staged[:, start:start + width]
        head = {n: col(n)[:, 0] for n in HEAD}
        self.valid, self.greedy = head["valid"] != 0, head["greedy"] != 0
        self.base, self.known, self.top_k, self.seed = head["base"], head["known"], head["top_k"], head["seed"]
        self.temperature = col("temperature").contiguous().view(torch.float64)[:, 0]
        self.top_p = col("top_p").contiguous().view(torch.float64)[:, 0].float().double()  # as sampling_tensors
        self.fed, self.table, self.scratch = col("fed"), col("table"), col("scratch")
        b = shape.seqs
        self.rank_ids = col("rank_ids").reshape(b, shape.k + 1, shape.width)
        probs = col("rank_probs").contiguous().view(torch.float64)
        self.rank_probs = probs.reshape(b, shape.k + 1, shape.width).float()


def _groups(seqs: int, per: int, device: torch.device) -> torch.Tensor:
    # contiguous: with one sequence the reshape is a stride-0 view, which the kernels would read past
    return torch.arange(seqs, dtype=torch.int32, device=device)[:, None].expand(seqs, per).reshape(-1).contiguous()


def _outcomes(shape: BuildShape, f: _Fields, ids: torch.Tensor, probs: torch.Tensor, depths: torch.Tensor
              ) -> torch.Tensor:
    """``predict_outcomes`` on the device: [B, branches, 2] (k, t*), likeliest first (ties in depth order)."""
    k = shape.k
    drafted = f.fed[:, 1:]  # d_1..d_K
    q_drafted = ((ids[:, :k] == drafted[..., None]) * probs[:, :k].double()).sum(-1)  # q_k(d_{k+1}), 0 if unranked
    reach = torch.cat([torch.ones_like(q_drafted[:, :1]), torch.cumprod(q_drafted, 1)], 1)  # [B, K + 1]
    tokens, scores = [], []
    for d, n in enumerate(shape.counts):
        if n == 0:
            continue
        c, p = ids[:, d, :n + (d < k)], probs[:, d, :n + (d < k)]
        if d < k:  # the first n of the top n + 1 that are not d_{d+1}
            pick = torch.sort((c == drafted[:, d:d + 1]).to(torch.int8), dim=1, stable=True).indices[:, :n]
            c, p = c.gather(1, pick), p.gather(1, pick)
        tokens.append(c)
        scores.append(reach[:, d:d + 1] * p.double())
    order = torch.sort(torch.cat(scores, 1), dim=1, descending=True, stable=True).indices
    return torch.stack([depths[order], torch.cat(tokens, 1).gather(1, order)], -1)
