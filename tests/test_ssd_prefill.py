"""The speculator's prefill in its idle time (``ssd/prefill_work.py``, ``ssd/host.py``): a prefill arriving during
a build neither cuts it short nor is fed before the next round's response; its pieces run only while nothing
waits; what is left at admission is fed then; a prompt released mid-prefill gives its draft blocks back and is
fed no further; and greedy SSD with a long prompt arriving mid-stream equals AR, token for token."""
from collections import deque
from typing import Callable

import pytest

from saguaro import LLM, SamplingParams
from saguaro.engine.model_runner import ModelRunner
from saguaro.engine.prefill_chunks import FixedChunks
from saguaro.ssd import host
from saguaro.ssd.plan import SpecPlan
from saguaro.ssd.prefill_work import PrefillWork
from saguaro.ssd.protocol import CMD_PREFILL, Admission, Outcome, RoundRequest
from saguaro.ssd.speculator import Speculator
from tests.tiny import PROMPTS, greedy_tokens, weak_pair

LONG = [(7 * i + 3) % 64 for i in range(203)]  # 203 tokens: chunks and pieces end mid-block (block_size 4)
PIECE = 16


@pytest.fixture(scope="module")
def pair():
    return weak_pair()


class Script:
    """A transport whose requests arrive when the test says (``arrive``, or a hook run after the n-th event of a
    kind), and a log of what the speculator did: ("arrive", name), ("respond", name), ("reply", name),
    ("build-start",), ("build", steps completed), ("piece", tokens fed)."""

    def __init__(self, spec: Speculator):
        self.spec, self.queue, self.log = spec, deque(), []
        self.hooks: dict[tuple[str, int], Callable[[], None]] = {}
        self.answering = ""  # the request being answered
        respond, build, piece = spec.respond, spec.build, spec.prefill_piece

        def logged_respond(req: RoundRequest):
            self.answering = req.name
            self._event(("respond", req.name))
            return respond(req)

        def logged_build(interrupted):
            self._event(("build-start",))
            stats = build(interrupted)
            self._event(("build", stats.steps))
            return stats

        def logged_piece() -> bool:
            before = self.fed()
            ran = piece()
            if ran:
                self._event(("piece", self.fed() - before))
            return ran
        spec.respond, spec.build, spec.prefill_piece = logged_respond, logged_build, logged_piece

    def fed(self) -> int:
        """Prefill tokens in the draft caches of the sequences not yet admitted."""
        return sum(s.draft.num_cached for s in self.spec.states.values() if s.prefilled is not None)

    def arrive(self, name: str, req: RoundRequest) -> None:
        req.name = name
        self.log.append(("arrive", name))
        self.queue.append(req)

    def _event(self, event: tuple) -> None:
        self.log.append(event)
        hook = self.hooks.pop((event[0], sum(1 for e in self.log if e[0] == event[0])), None)
        if hook is not None:
            hook()

    def serve(self) -> None:
        """``host.serve`` over this transport, until no request is left (the other side then counts as gone)."""
        host.serve(self.spec, lambda: self.queue.popleft() if self.queue else None,
                   lambda response: self._event(("reply", self.answering)), lambda: bool(self.queue))


def _speculator(pair) -> Speculator:
    spec = Speculator(ModelRunner(pair[1].model, 256, 4), SpecPlan.fixed([1, 1, 1, 2]))  # K = 3
    spec.prefills.chunks = FixedChunks(PIECE)  # pieces of a known size
    return spec


def _prefill(seq_id: int, tokens: list[int]) -> RoundRequest:
    return RoundRequest(admissions=[Admission(seq_id, tokens, SamplingParams(), 0)], command=CMD_PREFILL)


def _between(log: list[tuple], first: tuple, last: tuple) -> list[tuple]:
    return log[log.index(first) + 1:log.index(last)]


def test_a_round_never_waits_on_pending_prefill(pair):
    """The long prompt's prefill arrives at the start of a build: the build still takes its K steps, and the
    pieces run after it. The next round arrives after two pieces and is answered before any further piece, with
    most of the prompt still pending; the rest is fed in the idle time after that round's build."""
    spec = _speculator(pair)
    script = Script(spec)
    params = SamplingParams(max_tokens=64)
    script.arrive("r1", RoundRequest(admissions=[Admission(0, PROMPTS[1], params, 0)], order=[0]))
    script.hooks[("build-start", 1)] = lambda: script.arrive("prefill", _prefill(9, LONG))
    script.hooks[("piece", 2)] = lambda: script.arrive("r2", RoundRequest([Outcome(0, 0, 5)], order=[0]))
    pending = []
    script.hooks[("reply", 2)] = lambda: pending.append(len(LONG) - 1 - script.fed())
    script.serve()
    log = script.log
    assert [e for e in log if e[0] == "build"][0] == ("build", 3)  # not cut short by the prefill that arrived
    assert all(e[0] != "piece" for e in _between(log, ("arrive", "r2"), ("reply", "r2")))
    assert pending == [len(LONG) - 1 - 2 * PIECE]  # r2 was answered with the prefill pending
    pieces = [e[1] for e in log if e[0] == "piece"]
    assert sum(pieces) == len(LONG) - 1 and max(pieces) == PIECE
    assert log.index(("build", 3), log.index(("reply", "r2"))) < log.index(("piece", PIECE), log.index(("reply", "r2")))


def test_admission_feeds_what_is_pending_and_a_release_frees_the_blocks(pair):
    """Admitted before its pieces are done, a prompt's prefill is finished at admission (the draft cache then
    equals a fresh prefill's: tests/test_ssd_glue.py); released mid-prefill, it is fed no further and every
    draft block comes back."""
    spec = _speculator(pair)
    script = Script(spec)
    runner = spec.runner
    script.arrive("p", _prefill(9, LONG))
    script.arrive("p2", _prefill(7, LONG[:50]))
    states = {}
    script.hooks[("piece", 1)] = lambda: script.arrive("admit", RoundRequest(
        admissions=[Admission(7, LONG[:50] + [1], SamplingParams(), 0)], order=[7]))
    script.hooks[("reply", 1)] = lambda: states.update(admitted=spec.states[7].draft.num_cached,
                                                       left=len(LONG) - 1 - spec.states[9].draft.num_cached)
    script.hooks[("piece", 2)] = lambda: script.arrive("release", RoundRequest(releases=[7, 9]))
    free = []
    script.hooks[("reply", 2)] = lambda: free.append((runner.blocks.num_free, 9 in spec.states))
    script.serve()
    assert states["admitted"] >= 50 and states["left"] > 0  # 7 caught up at admission, 9 still pending
    assert free == [(runner.blocks.num_blocks, False)]
    assert [e for e in script.log[script.log.index(("reply", "release")):] if e[0] == "piece"] == []


@pytest.mark.parametrize("transport, piece", [("thread", 3), ("thread", None), ("process", None)],
                         ids=["thread-pieces-of-3", "thread-timed", "process-timed"])
def test_greedy_ssd_equals_ar_with_a_long_prompt_mid_stream(pair, transport, piece, monkeypatch):
    """Two streams decode while a 203-token prompt arrives, prefilled in chunks of 8 by the target and in pieces
    by the speculator while idle (pieces of 3 fall behind the chunks of 8: the admission feeds the rest; timed
    pieces keep up). The order of these events is the unit tests' above; here the tokens are checked."""
    reference = greedy_tokens(pair[0], PROMPTS[:2] + [LONG], 24)
    pieces = []
    if transport == "thread":
        real_piece, real_init = PrefillWork.piece, PrefillWork.__init__

        def init(self, runner, budget_s=None, **kw):
            real_init(self, runner, budget_s, **kw)
            if piece is not None:
                self.chunks = FixedChunks(piece)
        monkeypatch.setattr(PrefillWork, "__init__", init)
        monkeypatch.setattr(PrefillWork, "piece", lambda self, states: real_piece(self, states) and
                            (pieces.append(1) or True))
    with LLM(target=pair[0], draft=pair[1], mode="ssd", num_speculative_tokens=3, fan_out=[2, 2, 2, 4],
             block_size=4, max_prefill_tokens=8, adaptive=False, speculator_transport=transport,
             worker_timeout_s=60) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=24)
        seqs = [engine.add_request(p, params) for p in PROMPTS[:2]]
        while not all(s.output_ids for s in seqs):
            engine.step()
        seqs.append(engine.add_request(LONG, params))
        while engine.has_unfinished:
            engine.step()
        assert engine.decoder.failure is None
        assert engine.target.blocks.num_free == engine.target.blocks.num_blocks
    assert [s.output_ids for s in seqs] == reference
    if transport == "thread" and piece is None:
        assert pieces  # the speculator fed pieces in its idle time (26 chunks' worth of it)
