"""The two messages of an SSD round, as typed dataclasses packed into one tensor each.

Verifier -> speculator (``RoundRequest``, int64): per sequence the verification outcome
(sequence id, accepted count k, bonus token), plus admissions of new sequences (their
tokens and sampling settings) and releases of finished ones.

Speculator -> verifier (``RoundResponse``, float32): per requested sequence a hit flag,
up to K tokens, and for sampled (non-greedy) rows the K draft distributions the tokens
were drawn from. Token ids travel as float32, exact below 2**24 (any real vocabulary).
Distributions follow the per-row header, one [K, V] block for each row that carries one.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

from saguaro.sampling.params import SamplingParams

CMD_ROUND, CMD_STOP = 1, 2
# admissions only, sent before the target's own prefill: the speculator fills its draft cache with them
# meanwhile (on its own device) and sends no response
CMD_PREFILL = 3


@dataclass
class Outcome:
    seq_id: int
    num_accepted: int  # k: drafts the verifier kept
    bonus: int  # t*: the token it drew after them


@dataclass
class Admission:
    seq_id: int
    tokens: list[int]  # every token so far (prompt and generated)
    params: SamplingParams
    seed: int  # seeds the speculator's own generator for this sequence


@dataclass
class RoundRequest:
    outcomes: list[Outcome] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # sequence ids to answer, in response order
    command: int = CMD_ROUND


@dataclass
class SpecRow:
    hit: bool
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V]; None for greedy rows and point-mass rows
    point_mass: bool = False  # drafted deterministically (n-gram/random fallback): no distribution


@dataclass
class RoundResponse:
    rows: list[SpecRow]
    build_s: float = 0.0  # time the speculator spent building the previous cache
    respond_s: float = 0.0  # time from receiving the request to sending this response
    build_steps: int = 0  # branch steps the previous cache build completed


def _f2i(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _i2f(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


def pack_request(req: RoundRequest) -> torch.Tensor:
    out = [req.command, len(req.outcomes), len(req.admissions), len(req.releases), len(req.order)]
    for o in req.outcomes:
        out += [o.seq_id, o.num_accepted, o.bonus]
    for a in req.admissions:
        p = a.params
        out += [a.seq_id, len(a.tokens), _f2i(p.temperature), p.top_k, _f2i(p.top_p), a.seed, *a.tokens]
    out += req.releases
    out += req.order
    return torch.tensor(out, dtype=torch.int64)


def unpack_request(t: torch.Tensor) -> RoundRequest:
    v = t.tolist()
    command, n_out, n_adm, n_rel, n_ord = v[:5]
    i = 5
    outcomes = []
    for _ in range(n_out):
        outcomes.append(Outcome(*v[i:i + 3]))
        i += 3
    admissions = []
    for _ in range(n_adm):
        seq_id, n_tok, temp, top_k, top_p, seed = v[i:i + 6]
        params = SamplingParams(temperature=_i2f(temp), top_k=top_k, top_p=_i2f(top_p))
        admissions.append(Admission(seq_id, v[i + 6:i + 6 + n_tok], params, seed))
        i += 6 + n_tok
    releases = v[i:i + n_rel]
    order = v[i + n_rel:i + n_rel + n_ord]
    return RoundRequest(outcomes, admissions, releases, order, command)


def pack_response(resp: RoundResponse, k: int) -> torch.Tensor:
    """Layout: [build_s, respond_s, build_steps, n_rows] + per row [hit, point_mass, n, tok*K]
    + a [K, V] block (zero padded past n) for each row that carries probabilities."""
    head = [resp.build_s, resp.respond_s, float(resp.build_steps), float(len(resp.rows))]
    meta = []
    probs = []
    for row in resp.rows:
        meta += [float(row.hit), float(row.point_mass), float(len(row.tokens))]
        meta += [float(t) for t in row.tokens] + [0.0] * (k - len(row.tokens))
        if row.probs is not None:
            pad = torch.zeros(k, row.probs.shape[-1])
            pad[:row.probs.shape[0]] = row.probs
            probs.append(pad.reshape(-1))
    return torch.cat([torch.tensor(head + meta, dtype=torch.float32), *probs])


def unpack_response(t: torch.Tensor, k: int, vocab: int) -> RoundResponse:
    build_s, respond_s, steps, n = t[:4].tolist()
    n = int(n)
    meta = t[4:4 + n * (3 + k)].view(n, 3 + k).tolist()
    probs = t[4 + n * (3 + k):]
    rows, offset = [], 0
    for m in meta:
        count = int(m[2])
        tokens = [int(x) for x in m[3:3 + count]]
        row_probs = None
        if offset < probs.numel() and _has_probs(m):
            row_probs = probs[offset:offset + k * vocab].view(k, vocab)[:count]
            offset += k * vocab
        rows.append(SpecRow(bool(m[0]), tokens, row_probs, bool(m[1])))
    return RoundResponse(rows, build_s, respond_s, int(steps))


def _has_probs(meta_row: list[float]) -> bool:
    return meta_row[1] == 0.0 and meta_row[2] > 0
