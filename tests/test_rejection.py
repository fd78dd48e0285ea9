"""Rejection sampling is lossless: the emitted tokens follow the target, whatever the draft.

The distribution tests use a tiny "language model": a bigram table ``P[prev, next]`` for the target and
``Q[prev, next]`` for the draft. Each of n = 50,000 rows starts from the same context token and runs
speculative rounds (draft K tokens from Q, verify against P at every position, append the accepted
drafts and the bonus token) until it has emitted L tokens. The first L tokens must then follow the
target's joint law ``P[c, t1] * P[t1, t2] * ...``, which is checked with the TV threshold of
``tests/stats.py``. Deliberately wrong verifiers must fail the same check.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from saguaro.sampling.processors import probs_from_logits
from saguaro.verify import VerifyResult, rejection_sample, rejection_sample_tensors

try:
    from tests.stats import assert_matches, empirical, tv_distance, tv_threshold
except ImportError:  # tests/ on sys.path instead of the repository root
    from stats import assert_matches, empirical, tv_distance, tv_threshold

N_TRIALS = 50_000
CONTEXT = 0

Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- harness


def bigram_tables(vocab: int, seed: int, alpha: float = 0.5, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target and draft tables, both processed with the same sampling settings."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    for _ in range(2):
        raw = torch._standard_gamma(torch.full((vocab, vocab), alpha, dtype=torch.float64), generator=gen)
        logits = torch.log(raw / raw.sum(-1, keepdim=True)).float()
        tables.append(probs_from_logits(
            logits, torch.full((vocab,), temperature), torch.full((vocab,), top_k), torch.full((vocab,), top_p)))
    return tables[0], tables[1]


def exact_joint(P: torch.Tensor, length: int) -> torch.Tensor:
    """Target law of the first ``length`` tokens after CONTEXT, flattened (first token most significant)."""
    vocab = P.shape[0]
    joint = P[CONTEXT].double()  # [V]: law of t1
    for _ in range(length - 1):
        last = torch.arange(joint.numel()) % vocab  # last token of each prefix
        joint = (joint.unsqueeze(1) * P.double()[last]).reshape(-1)
    return joint


def simulate(verifier: Verifier, P: torch.Tensor, Q: torch.Tensor, k_max: int, length: int, seed: int,
             n: int = N_TRIALS, point_mass_rows: torch.Tensor | None = None, proposer: torch.Tensor | None = None,
             random_num_draft: bool = False, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Run speculative rounds for ``n`` independent rows; return their first ``length`` tokens [n, length].

    Rows in ``point_mass_rows`` draft with a deterministic ``proposer[prev]`` table (or from Q when it is
    None) and are verified as point-mass drafts; the others draft from Q and pass Q to the verifier.
    """
    gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.arange(n)
    out = torch.full((n, length), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    prev = torch.full((n,), CONTEXT, dtype=torch.int64)
    pm = point_mass_rows if point_mass_rows is not None else torch.zeros(n, dtype=torch.bool)
    greedy = greedy if greedy is not None else torch.zeros(n, dtype=torch.bool)
    for _ in range(length):
        if bool((count >= length).all()):
            break
        contexts = [prev]
        drafts = []
        for _ in range(k_max):
            d = torch.multinomial(Q[contexts[-1]], 1, generator=gen).squeeze(1)
            if proposer is not None:
                d = torch.where(pm, proposer[contexts[-1]], d)
            drafts.append(d)
            contexts.append(d)
        ctx = torch.stack(contexts, dim=1)  # [n, K+1]
        draft_tokens = ctx[:, 1:]
        num_draft = (torch.randint(0, k_max + 1, (n,), generator=gen) if random_num_draft
                     else torch.full((n,), k_max, dtype=torch.int64))
        if random_num_draft:  # padding past num_draft is garbage the verifier must ignore
            pad = torch.arange(k_max).unsqueeze(0) >= num_draft.unsqueeze(1)
            draft_tokens = torch.where(pad, torch.full_like(draft_tokens, -7), draft_tokens)
        k, bonus = verifier(P[ctx], draft_tokens, Q[ctx[:, :k_max]], num_draft, pm, None, greedy,
                            shared_generator=verify_gen)
        assert bool(((k >= 0) & (k <= num_draft)).all())
        emitted = torch.cat([draft_tokens, torch.zeros(n, 1, dtype=torch.int64)], dim=1)
        emitted[rows, k] = bonus
        for j in range(k_max + 1):
            pos = count + j
            write = (j <= k) & (pos < length)
            out[rows[write], pos[write]] = emitted[write, j]
        count += k + 1
        prev = bonus
    assert bool((out >= 0).all())
    return out


def joint_index(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    index = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for j in range(tokens.shape[1]):
        index = index * vocab + tokens[:, j]
    return index


def check_lossless(verifier: Verifier, P, Q, k_max, length=2, seed=0, **kw) -> float:
    tokens = simulate(verifier, P, Q, k_max, length, seed, **kw)
    return assert_matches(joint_index(tokens, P.shape[0]), exact_joint(P, length))


def tv_of(verifier: Verifier, P, Q, k_max, length=2, seed=0, **kw) -> tuple[float, float]:
    tokens = simulate(verifier, P, Q, k_max, length, seed, **kw)
    exact = exact_joint(P, length)
    tv = tv_distance(empirical(joint_index(tokens, P.shape[0]), exact.numel()), exact)
    return tv, tv_threshold(tokens.shape[0], int((exact > 0).sum()))


def via_lists(*args, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The public list API, converted back to tensors (and cross-checked for consistency)."""
    res: VerifyResult = rejection_sample(*args, **kw)
    drafts = args[1].tolist()
    for b, (k, t, out) in enumerate(zip(res.num_accepted, res.bonus_tokens, res.output_tokens)):
        assert out == drafts[b][:k] + [t]
    return torch.tensor(res.num_accepted), torch.tensor(res.bonus_tokens)


def textbook(bug: str | None = None) -> Verifier:
    """A plain re-implementation of SD verification, optionally with a deliberate bug (negative controls)."""

    def verify(p, d, q, num_draft, point_mass, generators, greedy, shared_generator=None):
        n, k1, vocab = p.shape
        p, q = p.double(), q.double()
        q = torch.where(point_mass.view(-1, 1, 1), torch.nn.functional.one_hot(d.clamp(min=0), vocab).double(), q)
        rows = torch.arange(n)
        k = torch.zeros(n, dtype=torch.int64)
        alive = torch.ones(n, dtype=torch.bool)
        for i in range(k1 - 1):
            di = d[:, i].clamp(min=0)
            pi, qi = p[rows, i, di], q[rows, i, di]
            ratio = torch.minimum(torch.ones_like(pi), (qi / pi) if bug == "accept_q_over_p" else (pi / qi))
            ok = torch.rand(n, generator=shared_generator, dtype=torch.float64) < ratio
            alive = alive & ok & (i < num_draft)
            k += alive.long()
        pk = p[rows, k]
        residual = (pk - q[rows, k.clamp(max=k1 - 2)]).clamp(min=0)
        if bug == "bonus_from_p":
            residual = pk
        dist = torch.where((k < num_draft).unsqueeze(1), residual, pk)
        return k, torch.multinomial(dist, 1, generator=shared_generator).squeeze(1)

    return verify


# ----------------------------------------------------------------------------- distribution tests


@pytest.mark.parametrize("k_max", [1, 3])
def test_lossless_plain(k_max):
    P, Q = bigram_tables(8, seed=10 + k_max)
    check_lossless(rejection_sample_tensors, P, Q, k_max, seed=k_max)


def test_lossless_through_list_api():
    P, Q = bigram_tables(8, seed=20)
    check_lossless(via_lists, P, Q, 2, seed=21)


@pytest.mark.parametrize("k_max", [1, 3])
def test_lossless_with_temperature_and_top_p(k_max):
    # Draft and target both filtered: q has zeros where p has mass and vice versa.
    P, Q = bigram_tables(16, seed=30 + k_max, alpha=0.8, temperature=0.8, top_p=0.8)
    assert bool(((P > 0) != (Q > 0)).any())
    check_lossless(rejection_sample_tensors, P, Q, k_max, seed=31)


def test_lossless_with_top_k_and_top_p():
    P, Q = bigram_tables(8, seed=40, temperature=1.3, top_k=4, top_p=0.9)
    check_lossless(rejection_sample_tensors, P, Q, 2, seed=41)


@pytest.mark.parametrize("k_max", [1, 3])
def test_lossless_point_mass_deterministic_proposer(k_max):
    P, Q = bigram_tables(8, seed=50 + k_max)
    proposer = torch.randint(0, 8, (8,), generator=torch.Generator().manual_seed(5))
    proposer[P.argmax(-1) == proposer] = 0  # not just the target's favourite
    check_lossless(rejection_sample_tensors, P, Q, k_max, seed=51,
                   point_mass_rows=torch.ones(N_TRIALS, dtype=torch.bool), proposer=proposer)


def test_lossless_point_mass_random_proposals():
    # Point-mass verification is exact for proposals drawn at random too (independent of the verifier).
    P, Q = bigram_tables(8, seed=60)
    check_lossless(rejection_sample_tensors, P, Q, 3, seed=61, point_mass_rows=torch.ones(N_TRIALS, dtype=torch.bool))


def test_lossless_mixed_batch_random_num_draft():
    P, Q = bigram_tables(8, seed=70, alpha=1.0, temperature=1.2, top_p=0.9)
    pm = torch.rand(N_TRIALS, generator=torch.Generator().manual_seed(7)) < 0.5
    proposer = torch.randperm(8, generator=torch.Generator().manual_seed(8))
    check_lossless(rejection_sample_tensors, P, Q, 3, seed=71, point_mass_rows=pm, proposer=proposer,
                   random_num_draft=True)


def test_lossless_deep_positions():
    # Four tokens over a 4-token vocabulary: covers acceptance at every depth of K=3 and a second round.
    P, Q = bigram_tables(4, seed=80)
    check_lossless(rejection_sample_tensors, P, Q, 3, length=4, seed=81)


def test_draft_equal_to_target_accepts_everything():
    P, _ = bigram_tables(8, seed=90)
    n = 5000
    gen = torch.Generator().manual_seed(9)
    ctx = torch.randint(0, 8, (n, 4), generator=gen)
    k, _ = rejection_sample_tensors(P[ctx], ctx[:, 1:], P[ctx[:, :3]], torch.full((n,), 3), None, None,
                                    torch.zeros(n, dtype=torch.bool), shared_generator=gen)
    # Drafts here are arbitrary tokens, so only those with p > 0 can be accepted; with q == p every one is.
    possible = (P[ctx[:, :3], ctx[:, 1:]] > 0).long().cumprod(1).sum(1)
    assert torch.equal(k, possible)
    check_lossless(rejection_sample_tensors, P, P, 3, seed=91)


def test_textbook_reference_passes():
    # The harness and the reference verifier agree with the theory; the bugs below are the only changes.
    P, Q = bigram_tables(8, seed=100)
    check_lossless(textbook(), P, Q, 1, seed=101)


@pytest.mark.parametrize("bug", ["bonus_from_p", "accept_q_over_p"])
@pytest.mark.parametrize("k_max", [1, 3])
def test_negative_control_buggy_verifier_fails(bug, k_max):
    P, Q = bigram_tables(8, seed=100)
    tv, threshold = tv_of(textbook(bug), P, Q, k_max, seed=101)
    assert tv > threshold, f"{bug}: TV {tv:.4f} <= threshold {threshold:.4f}; the test has no power"


# ----------------------------------------------------------------------------- greedy


def _greedy_case(n: int, k_max: int, seed: int, one_hot: bool):
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    logits = torch.randn(vocab, vocab, generator=gen)
    P = probs_from_logits(logits, torch.zeros(vocab) if one_hot else torch.ones(vocab),
                          torch.zeros(vocab, dtype=torch.long), torch.ones(vocab))
    best = logits.argmax(-1)
    prev = torch.randint(0, vocab, (n,), generator=gen)
    drafts, ctx = [], prev
    for _ in range(k_max):  # follow the argmax chain, but deviate now and then
        d = torch.where(torch.rand(n, generator=gen) < 0.7, best[ctx], torch.randint(0, vocab, (n,), generator=gen))
        drafts.append(d)
        ctx = d
    draft_tokens = torch.stack(drafts, 1)
    contexts = torch.cat([prev.unsqueeze(1), draft_tokens], 1)
    num_draft = torch.randint(0, k_max + 1, (n,), generator=gen)
    return P, best, contexts, draft_tokens, num_draft


@pytest.mark.parametrize("one_hot", [True, False])
def test_greedy_is_exact_argmax_chain_without_randomness(one_hot):
    n, k_max = 400, 3
    P, best, contexts, draft_tokens, num_draft = _greedy_case(n, k_max, seed=11, one_hot=one_hot)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    states = [g.get_state().clone() for g in gens]
    shared = torch.Generator().manual_seed(1)
    shared_state = shared.get_state().clone()
    res = rejection_sample(P[contexts], draft_tokens, P[contexts[:, :k_max]] * 0 + 1 / 6, num_draft, None,
                           gens, torch.ones(n, dtype=torch.bool), shared_generator=shared)
    for b in range(n):
        expected_k = 0
        while expected_k < num_draft[b] and draft_tokens[b, expected_k] == best[contexts[b, expected_k]]:
            expected_k += 1
        assert res.num_accepted[b] == expected_k
        assert res.bonus_tokens[b] == int(best[contexts[b, expected_k]])
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    assert torch.equal(shared.get_state(), shared_state)


def test_greedy_speculative_run_equals_autoregressive_argmax():
    P, Q = bigram_tables(8, seed=12)
    n, length = 2000, 6
    greedy_P = probs_from_logits(torch.log(P), torch.zeros(8), torch.zeros(8, dtype=torch.long), torch.ones(8))
    tokens = simulate(rejection_sample_tensors, greedy_P, Q, 3, length, seed=13, n=n,
                      greedy=torch.ones(n, dtype=torch.bool))
    chain, prev = [], CONTEXT
    for _ in range(length):
        prev = int(P[prev].argmax())
        chain.append(prev)
    assert (tokens == torch.tensor(chain)).all()


# ----------------------------------------------------------------------------- seeds, edge cases


def test_seeded_row_independent_of_batch():
    P, Q = bigram_tables(8, seed=14)
    gen = torch.Generator().manual_seed(15)
    n, k_max = 6, 3
    ctx = torch.stack([torch.cat([torch.tensor([0]), torch.multinomial(Q[0], 3, True, generator=gen)])
                       for _ in range(n)])

    def run(order: list[int], seeds: list[int | None], greedy_rows: set[int]) -> dict[int, tuple]:
        c = ctx[order]
        gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
        greedy = torch.tensor([r in greedy_rows for r in order])
        num_draft = torch.tensor([min(r, k_max) for r in order])
        res = rejection_sample(P[c], c[:, 1:], Q[c[:, :k_max]], num_draft, None, gens, greedy,
                               shared_generator=torch.Generator().manual_seed(len(order)))
        return {r: (res.num_accepted[i], res.bonus_tokens[i]) for i, r in enumerate(order)}

    outcomes = []
    for trial in range(40):
        alone = run([3], [1000 + trial], set())
        crowded = run([5, 0, 3, 1], [None, 7, 1000 + trial, None], {5})
        shuffled = run([2, 4, 1, 0, 3], [1, 2, None, 3, 1000 + trial], {2, 4})
        assert alone[3] == crowded[3] == shuffled[3]
        outcomes.append(alone[3])
    assert len(set(outcomes)) > 1


def test_uniform_consumption_is_num_draft_plus_one():
    P, Q = bigram_tables(8, seed=16)
    ctx = torch.tensor([[0, 1, 2, 3], [0, 3, 3, 1]])
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    rejection_sample(P[ctx], ctx[:, 1:], Q[ctx[:, :3]], torch.tensor([2, 0]), None, gens, torch.tensor([False, False]))
    for g, count, seed in zip(gens, [3, 1], [1, 2]):
        ref = torch.Generator().manual_seed(seed)
        torch.rand(count, generator=ref, dtype=torch.float64)
        assert torch.equal(g.get_state(), ref.get_state())


def test_zero_draft_probability_is_rejected_and_empty_residual_falls_back_to_p():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]]).repeat(20_000, 1, 1)
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]]).repeat(20_000, 1, 1)
    # The drafted token 3 has q = 0 (cannot happen when sampled from q): it must be rejected, and since
    # p == q the residual is empty, so the bonus comes from p.
    d = torch.full((20_000, 1), 3)
    k, bonus = rejection_sample_tensors(p, d, q, torch.full((20_000,), 1), None, None,
                                        torch.zeros(20_000, dtype=torch.bool),
                                        shared_generator=torch.Generator().manual_seed(3))
    assert (k == 0).all()
    assert_matches(bonus, p[0, 0])
    # Same draft, q with mass elsewhere: bonus from the residual max(p - q, 0) ∝ (0, 0.5, 0, 0) here.
    q2 = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]]).repeat(20_000, 1, 1)
    k, bonus = rejection_sample_tensors(p, d, q2, torch.full((20_000,), 1), None, None,
                                        torch.zeros(20_000, dtype=torch.bool))
    assert (k == 0).all() and (bonus == 1).all()


def test_point_mass_certain_acceptance_and_residual_excludes_draft():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]).repeat(5000, 1, 1)
    d = torch.tensor([[1], [0]]).repeat(5000, 1)
    k, bonus = rejection_sample_tensors(p, d, None, torch.ones(10_000, dtype=torch.long), None, None,
                                        torch.zeros(10_000, dtype=torch.bool),
                                        shared_generator=torch.Generator().manual_seed(4))
    assert (k[0::2] == 1).all()  # p(d) = 1: always accepted, bonus from p_1
    assert_matches(bonus[0::2], p[0, 1])
    rejected = k[1::2] == 0
    assert (bonus[1::2][rejected] == 1).all()  # residual of p = (0.5, 0.5, 0) without token 0
    assert (bonus[1::2][~rejected] == 0).all()  # accepted: bonus from p_1 = one-hot at 0
    assert abs(rejected.double().mean().item() - 0.5) < 0.03


def test_no_drafts_at_all():
    p = torch.tensor([[[0.1, 0.9]], [[1.0, 0.0]]])
    k, bonus = rejection_sample_tensors(p, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 2),
                                        torch.zeros(2, dtype=torch.long), None, None, torch.tensor([True, False]))
    assert k.tolist() == [0, 0] and bonus.tolist() == [1, 0]
    res = rejection_sample(p, torch.zeros(2, 0, dtype=torch.long), None, torch.zeros(2, dtype=torch.long), None,
                           [None, torch.Generator().manual_seed(0)], torch.tensor([False, False]))
    assert res.num_accepted == [0, 0] and res.output_tokens[1] == [0]


def test_input_validation():
    p = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError):
        rejection_sample(p, torch.zeros(1, 2, dtype=torch.long), None, torch.tensor([3]), None, None,
                         torch.tensor([False]))
    with pytest.raises(ValueError):
        rejection_sample(p, torch.zeros(1, 2, dtype=torch.long), None, torch.tensor([2]), torch.tensor([False]),
                         None, torch.tensor([False]))
