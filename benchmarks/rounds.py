"""Per-round timings of a running engine, as lists of plain dicts (one per decode round).

AR and SD decoders keep no trace, so ``RoundTimer`` wraps the decoder instance's ``decode``
(and its proposer's ``propose``): drafting time is the proposer call, verification time is
the rest of the round (one target pass over [last token, drafts], rejection sampling,
rollback). SSD keeps its own trace (``SSDDecoder.trace``), read by ``SSDRounds``.

Fields, in milliseconds where named ``*_ms`` (None where a round has no such part):
  AR/SD: start, draft_ms, verify_ms, drafted
  SSD:   start, verify_ms, wait_ms, admit_wait_ms, build_ms, build_start, build_steps, hit, emitted (tokens
         the verification gave the sequence)
"""
from __future__ import annotations

import time
from typing import Any


class RoundTimer:
    """Times every ``decode`` call of an AR or SD decoder (batch 1: one round per call)."""

    def __init__(self, decoder: Any):
        self.rounds: list[dict] = []
        self._draft_s = 0.0
        self._drafted: int | None = None
        proposer = getattr(decoder, "proposer", None)
        if proposer is not None:
            propose = proposer.propose

            def timed_propose(seqs, budgets, **options):
                # host time: on a CPU the drafting itself; on a GPU, with the drafts left on the device
                # (read=False), only its launches, and the rest shows in the verification
                t = time.perf_counter()
                proposal = propose(seqs, budgets, **options)
                self._draft_s = time.perf_counter() - t
                self._drafted = max(proposal.num_drafts(), default=0)
                return proposal

            proposer.propose = timed_propose
        decode = decoder.decode

        def timed_decode(seqs):
            self._draft_s, self._drafted = 0.0, None
            t = time.perf_counter()
            out = decode(seqs)
            total = time.perf_counter() - t
            self.rounds.append({"start": t, "draft_ms": 1e3 * self._draft_s if proposer is not None else None,
                                "verify_ms": 1e3 * (total - self._draft_s), "drafted": self._drafted})
            return out

        decoder.decode = timed_decode  # an instance attribute: the engine calls self.decoder.decode(...)

    def __len__(self) -> int:
        return len(self.rounds)

    def slice(self, i0: int, i1: int) -> list[dict]:
        return [dict(r) for r in self.rounds[i0:i1]]


class SSDRounds:
    """Reads ``SSDDecoder.trace`` (``RoundTrace(start, verify_s, wait_s, build_s, build_steps, hits)``).

    Alignment of the worker's build: the worker sends response r-1, then builds the cache for
    the speculation it just sent until request r arrives, and reports that build's time with
    response r. So ``trace[r].build_s`` is the build that overlapped round r's verification.
    It began when response r-1 was sent; we take the moment the target held response r-1
    (start + verify + wait of round r-1) as its start, ignoring the transfer latency. The
    first round of a request verifies nothing (the sequence was just admitted and its
    speculation is drafted on the spot); its build time belongs to the previous request's
    tail and is dropped, and its wait is reported separately as ``admit_wait_ms``. A round
    verified at K = 0 (an AR step, adaptive K) emitted a token but neither hit nor missed.
    """

    def __init__(self, decoder: Any):
        self.trace = decoder.trace

    def __len__(self) -> int:
        return len(self.trace)

    def slice(self, i0: int, i1: int) -> list[dict]:
        rounds = []
        for j in range(i0, i1):
            r = self.trace[j]
            verified = bool(r.emitted)
            prev = self.trace[j - 1] if j > i0 else None
            rounds.append({
                "start": r.start,
                "verify_ms": 1e3 * r.verify_s if verified else None,
                "wait_ms": 1e3 * r.wait_s if verified else None,
                "admit_wait_ms": None if verified else 1e3 * r.wait_s,
                "build_ms": 1e3 * r.build_s if prev is not None else None,
                "build_start": prev.start + prev.verify_s + prev.wait_s if prev is not None else None,
                "build_steps": r.build_steps if prev is not None else None,
                "hit": r.hits[0] if r.hits else None,
                "emitted": r.emitted[0] if verified and r.emitted else None,
            })
        return rounds


def round_log(decoder: Any) -> RoundTimer | SSDRounds:
    return SSDRounds(decoder) if hasattr(decoder, "trace") else RoundTimer(decoder)
