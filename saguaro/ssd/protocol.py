"""The two messages of an SSD round, as typed dataclasses, and their wire format.

Verifier -> speculator (``RoundRequest``): per sequence the verification outcome (sequence id,
accepted count k, bonus token, and for an EAGLE-3 head the target's features of the verified positions),
plus admissions of new sequences (their tokens and sampling settings) and releases of finished ones.

Speculator -> verifier (``RoundResponse``): per requested sequence one ``SpecRow``: a hit flag,
up to K tokens, and for sampled rows the distributions the tokens were drawn from.

Wire format
-----------
Only the process transport packs messages (in-process transports pass the objects). A packed
message is a short list of flat tensors (``Channel`` sends each with its dtype and length, from where it lives):

* request:  ``[int64 fields]``, plus ``[features]`` in the target's dtype when an EAGLE-3 speculator is sent
  the target's features (a prefill chunk's, a round's verified positions'), on the target's device;
* response: ``[int64 fields, float32 probs]``, the probs stacked on the speculator's device.

The int64 fields are built on the host and read there once per message; nothing else is copied to the host.

Every row of a response carries explicit flags in the columns of ``RowColumns``, the one table
both sides index: ``HAS_PROBS`` says whether a [K, V] block for this row follows in ``probs``
(blocks come in row order), ``POINT_MASS`` whether the row was drafted deterministically. No
field's meaning is inferred from another one: a greedy row (no block, not a point mass), a
sampled row (a block), a point-mass row and an empty row (no tokens, with or without a block)
all round-trip as they were sent, in any order. Unpacking checks that the number of blocks
matches the flags.

What crosses the process boundary per request, and why nothing else needs to: the speculator
drafts from ``temperature``, ``top_k`` and ``top_p`` (the processed distribution it samples
from, which the verifier must receive) and from its own generator, seeded per sequence by
``Admission.seed``. ``max_tokens`` (the draft budget), stop strings and ``ignore_eos`` stay with
the verifier: it truncates each speculation to the request's budget before verifying.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from saguaro.device import read_together, stack_padded
from saguaro.sampling.params import SamplingParams

CMD_ROUND, CMD_STOP = 1, 2
# admissions only, sent before the target's own prefill: the speculator fills its draft cache with them
# meanwhile (on its own device) and sends no response
CMD_PREFILL = 3
# a round whose every K is 0: the speculator applies it as any round, and sends no response, since every row of it
# would be empty; the verifier goes on without waiting for it (an AR step costs the speculator's exchange nothing)
CMD_QUIET = 4


@dataclass
class Outcome:
    seq_id: int
    num_accepted: int  # k: drafts the verifier kept
    bonus: int  # t*: the token it drew after them
    # an EAGLE-3 speculator's: the target's features of the verified positions (the last token and the k accepted
    # drafts) [k+1, A*H_t], a view of the verification pass's tap
    features: torch.Tensor | None = None


@dataclass
class Admission:
    seq_id: int
    tokens: list[int]  # every token so far (prompt and generated)
    params: SamplingParams  # only temperature, top_k and top_p cross the wire (see the module docstring)
    seed: int  # seeds the speculator's own generator for this sequence
    # an EAGLE-3 speculator's prefill: the target's features of positions features_start.. [n, A*H_t]
    features: torch.Tensor | None = None
    features_start: int = 0


@dataclass
class RoundRequest:
    outcomes: list[Outcome] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # sequence ids to answer, in response order
    command: int = CMD_ROUND
    # per ``order`` entry: the most drafts its answer may hold (the verifier's K for it, saguaro.adapt; 0: none,
    # and no build for it unless ``prepare`` asks one); None: K for every sequence
    ks: list[int] | None = None
    # the plan's tree (fan-outs and taper, ``SpecPlan.trees``) the build this request starts uses: one for the
    # round, chosen by the verifier's schedule (saguaro.adapt); 0: the plan's own
    tree: int = 0
    # per ``order`` entry: the K the build this request starts prepares for, where it differs from ``ks``: a
    # request at K = 0 whose next round probes has its probe's speculation built beside this AR step, so the
    # probe is answered like any round (a hit at once) and not drafted just in time behind a catch-up; None: ks
    prepare: list[int] | None = None
    # sequence ids at K = 0 whose probe is two rounds away and whose skipped tokens would make the build that
    # prepares it outlast the verification (``KSchedule.catch_up``): the speculator feeds their draft caches the
    # tokens verified since they last speculated in its idle time, so that build glues two tokens, not all
    catch_up: list[int] = field(default_factory=list)
    # in a thread: a GPU event after the target's pass that wrote its features (``eagle.features.fence_features``)
    fence: Any = None

    def feature_tensors(self) -> list[torch.Tensor]:
        """The target's features it carries (an EAGLE-3 speculator's), outcomes' then admissions'."""
        return [x.features for x in [*self.outcomes, *self.admissions] if x.features is not None]


@dataclass
class SpecRow:
    """One sequence's next speculation. Kinds: greedy (``probs`` None), sampled (``probs`` given),
    point mass (an n-gram / random backup: ``point_mass`` and no ``probs``); any of them may be empty.

    On the graph-build path the tokens may still be on the draft's device, unread: ``tokens`` is None,
    ``device_tokens`` holds them (its first ``count``; the rest is padding) and the verifier reads them with its
    outcome, or a transport that packs the response reads every row's at once (``RoundResponse.read_tokens``)."""
    hit: bool
    tokens: list[int] | None
    probs: torch.Tensor | None  # [len(tokens), V]: the distributions the tokens were drawn from
    point_mass: bool = False  # drafted deterministically (the n-gram / random backup): no distribution
    device_tokens: torch.Tensor | None = None  # [>= count] long on the draft's device, while ``tokens`` is None
    count: int = 0  # tokens in ``device_tokens``

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.device_tokens is None):
            raise ValueError("a row holds either its token list or device_tokens")
        if self.point_mass and self.probs is not None:
            raise ValueError("a point-mass row carries no distributions")
        if self.probs is not None and self.probs.shape[0] != self.size:
            raise ValueError(f"{self.size} tokens but {self.probs.shape[0]} distributions")

    @property
    def size(self) -> int:
        """How many tokens it holds, read or not."""
        return len(self.tokens) if self.tokens is not None else self.count


@dataclass
class RoundResponse:
    rows: list[SpecRow]
    build_s: float = 0.0  # time the speculator spent building the previous cache
    respond_s: float = 0.0  # time from receiving the request to sending this response
    build_steps: int = 0  # branch steps the previous cache build completed

    def read_tokens(self) -> RoundResponse:
        """Every row's tokens as Python lists, the rows still on the device read together (one read)."""
        unread = [r for r in self.rows if r.tokens is None]
        if unread:
            values = read_together([pad_sequence([r.device_tokens for r in unread], batch_first=True)])[0]
            for row, tokens in zip(unread, values):
                row.tokens, row.device_tokens = tokens[:row.count], None
        return self


class RowColumns(IntEnum):
    """Columns of one response row in the packed int64 fields; token ids follow from ``TOKENS`` on."""
    HIT = 0
    POINT_MASS = 1
    HAS_PROBS = 2  # a [K, V] block of ``probs`` belongs to this row
    NUM_TOKENS = 3
    TOKENS = 4  # K columns, zero padded past NUM_TOKENS


_INT64, _FLOAT64 = struct.Struct("<q"), struct.Struct("<d")  # one word, read as either


def _bits(x: float) -> int:
    """A float64 carried exactly in an int64 field."""
    return _INT64.unpack(_FLOAT64.pack(x))[0]


def _float(bits: int) -> float:
    return _FLOAT64.unpack(_INT64.pack(bits))[0]



# -- request ------------------------------------------------------------------------
# int64 fields: [command, #outcomes, #admissions, #releases, #order, feature width, #ks, tree, #prepare,
#               #catch_up]
#               + per outcome [seq_id, k, bonus, #feature rows]
#               + per admission [seq_id, #tokens, temperature bits, top_k, top_p bits, seed, #feature rows,
#                                features_start, tokens...]
#               + releases + order + ks + prepare + catch_up
# features (a second frame, only when some are sent; the target's dtype): every outcome's rows, then every
#               admission's, [rows * width]

HEADER = 10  # the int64 fields before the first outcome


def _rows(features: torch.Tensor | None) -> int:
    return 0 if features is None else len(features)


def pack_request(req: RoundRequest) -> list[torch.Tensor]:
    sent = [f for f in [o.features for o in req.outcomes] + [a.features for a in req.admissions] if f is not None]
    width = sent[0].shape[-1] if sent else 0
    ks, prepare = req.ks or [], req.prepare or []
    out = [req.command, len(req.outcomes), len(req.admissions), len(req.releases), len(req.order), width, len(ks),
           req.tree, len(prepare), len(req.catch_up)]
    for o in req.outcomes:
        out += [o.seq_id, o.num_accepted, o.bonus, _rows(o.features)]
    for a in req.admissions:
        p = a.params
        out += [a.seq_id, len(a.tokens), _bits(p.temperature), p.top_k, _bits(p.top_p), a.seed, _rows(a.features),
                a.features_start, *a.tokens]
    out += req.releases
    out += req.order
    out += ks
    out += prepare
    out += req.catch_up
    fields = torch.tensor(out, dtype=torch.int64)
    # the features stay on the target's device: the NCCL link carries them from there (``channel.py``)
    return [fields, torch.cat([f.reshape(-1) for f in sent])] if sent else [fields]


def unpack_request(frames: list[torch.Tensor]) -> RoundRequest:
    v = frames[0].tolist()
    command, n_out, n_adm, n_rel, n_ord, width, n_ks, tree, n_prepare, n_catch = v[:HEADER]
    flat = frames[1].view(-1, width) if len(frames) > 1 else None
    taken = 0

    def take(rows: int) -> torch.Tensor | None:  # the next rows of the features frame: views, no copy
        nonlocal taken
        if not rows:
            return None
        taken += rows
        return flat[taken - rows:taken]

    i = HEADER
    outcomes = []
    for _ in range(n_out):
        seq_id, k, bonus, rows = v[i:i + 4]
        outcomes.append(Outcome(seq_id, k, bonus, take(rows)))
        i += 4
    admissions = []
    for _ in range(n_adm):
        seq_id, n_tok, temp, top_k, top_p, seed, rows, start = v[i:i + 8]
        params = SamplingParams(temperature=_float(temp), top_k=top_k, top_p=_float(top_p))
        admissions.append(Admission(seq_id, v[i + 8:i + 8 + n_tok], params, seed, take(rows), start))
        i += 8 + n_tok
    releases = v[i:i + n_rel]
    order = v[i + n_rel:i + n_rel + n_ord]
    i += n_rel + n_ord
    ks, prepare = v[i:i + n_ks] or None, v[i + n_ks:i + n_ks + n_prepare] or None
    i += n_ks + n_prepare
    catch_up, end = v[i:i + n_catch], i + n_catch
    if end != len(v):
        raise ValueError(f"request holds {len(v)} fields, its counts describe {end}")
    if flat is not None and taken != len(flat):
        raise ValueError(f"request carries {len(flat)} feature rows, its counts describe {taken}")
    return RoundRequest(outcomes, admissions, releases, order, command, ks, tree, prepare, catch_up)


# -- response -----------------------------------------------------------------------
# int64 fields: [build_s bits, respond_s bits, build_steps, #rows, K, V] + #rows x RowColumns (K tokens)
# float32 probs: one [K, V] block per row with HAS_PROBS, in row order, zero padded past NUM_TOKENS
_HEAD = 6


def pack_response(resp: RoundResponse, k: int) -> list[torch.Tensor]:
    resp = resp.read_tokens()  # rows left on the draft's device cross as values
    blocks = [row.probs for row in resp.rows if row.probs is not None]
    vocab = blocks[0].shape[-1] if blocks else 0
    meta = []
    for r, row in enumerate(resp.rows):
        n = len(row.tokens)
        if n > k:
            raise ValueError(f"row {r} holds {n} tokens, more than K = {k}")
        meta += [int(row.hit), int(row.point_mass), int(row.probs is not None), n, *row.tokens, *[0] * (k - n)]
    # stacked on the device the distributions are on (the speculator's GPU: the NCCL link sends them from there)
    probs = stack_padded(blocks, k, vocab, blocks[0].device if blocks else torch.device("cpu"))
    head = [_bits(resp.build_s), _bits(resp.respond_s), resp.build_steps, len(resp.rows), k, vocab]
    return [torch.tensor(head + meta, dtype=torch.int64), probs.reshape(-1)]


def unpack_response(frames: list[torch.Tensor], k: int, vocab: int) -> RoundResponse:
    """The response of ``frames``: its int64 fields read to the host at once (one read), its distributions
    left where they arrived (views of the probs frame, on the verifier's device over the NCCL link)."""
    fields, flat_probs = frames
    v = fields.tolist()
    build_s, respond_s, steps, n, sent_k, sent_vocab = v[:_HEAD]
    if sent_k != k:
        raise ValueError(f"response packed for K = {sent_k}, expected K = {k}")
    width = RowColumns.TOKENS + k
    if len(v) != _HEAD + n * width:
        raise ValueError(f"response holds {len(v)} fields, {n} rows of K = {k} need {_HEAD + n * width}")
    meta = [v[_HEAD + r * width:_HEAD + (r + 1) * width] for r in range(n)]
    num_blocks = sum(1 for m in meta if m[RowColumns.HAS_PROBS])
    if num_blocks and sent_vocab != vocab:
        raise ValueError(f"response distributions have {sent_vocab} entries, expected the vocabulary {vocab}")
    if flat_probs.numel() != num_blocks * k * sent_vocab:
        raise ValueError(f"{num_blocks} rows flag distributions but {flat_probs.numel()} values follow")
    probs = flat_probs.view(num_blocks, k, sent_vocab)
    rows, b = [], 0
    for m in meta:
        count = m[RowColumns.NUM_TOKENS]
        row_probs = None
        if m[RowColumns.HAS_PROBS]:
            row_probs = probs[b, :count]
            b += 1
        tokens = m[RowColumns.TOKENS:RowColumns.TOKENS + count]
        rows.append(SpecRow(bool(m[RowColumns.HIT]), tokens, row_probs, bool(m[RowColumns.POINT_MASS])))
    return RoundResponse(rows, _float(build_s), _float(respond_s), steps)
