"""Rejection sampling preserves the target distribution exactly, whatever the draft: 200k draws on
an 8-token vocabulary against the target, total variation below 0.01 (the sampling error of 200k
draws over 8 outcomes is ~0.003). Greedy acceptance and n-gram proposals against hand-made cases."""
from __future__ import annotations

import pytest
import torch

from appliance.engine.spec_decode.ngram import propose_ngram
from appliance.engine.spec_decode.rejection import greedy_accept, rejection_sample, rejection_sample_batch

N_DRAWS = 200_000
V = 8
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01], dtype=torch.float64)
P_NEXT = torch.tensor([0.05, 0.05, 0.10, 0.10, 0.10, 0.10, 0.20, 0.30], dtype=torch.float64)


def _first_token_tv(q: torch.Tensor | None, point_draft: int | None, seed: int) -> tuple[float, float]:
    """Draw N_DRAWS first emitted tokens with one draft (drawn from ``q``, or ``point_draft``);
    returns (total variation to P, acceptance rate)."""
    g = torch.Generator().manual_seed(seed)
    if q is not None:
        drafts = torch.multinomial(q, N_DRAWS, replacement=True, generator=torch.Generator().manual_seed(seed + 1))
        qb = q.expand(N_DRAWS, 1, V)
    else:
        drafts, qb = torch.full((N_DRAWS,), point_draft, dtype=torch.long), None
    p = torch.stack([P, P_NEXT]).expand(N_DRAWS, 2, V)
    num_accepted, token = rejection_sample_batch(p, drafts[:, None], qb, g)
    first = torch.where(num_accepted == 1, drafts, token)
    counts = torch.bincount(first, minlength=V).double()
    return 0.5 * (counts / N_DRAWS - P).abs().sum().item(), num_accepted.double().mean().item()


@pytest.mark.parametrize("name", ["q_where_p_small", "point_mass_on_rare_token", "q_equals_p"])
def test_first_token_follows_target(name):
    if name == "q_where_p_small":  # adversarial: the draft puts its mass where the target has little
        q = torch.tensor([0.01, 0.01, 0.01, 0.02, 0.05, 0.10, 0.30, 0.50], dtype=torch.float64)
        tv, acc = _first_token_tv(q, None, 0)
        want_acc = torch.minimum(P, q).sum().item()  # P(accept) = sum min(p, q)
    elif name == "point_mass_on_rare_token":  # an n-gram draft on the target's least likely token
        tv, acc = _first_token_tv(None, 7, 1)
        want_acc = P[7].item()
    else:
        tv, acc = _first_token_tv(P.clone(), None, 2)
        want_acc = 1.0
    assert tv < 0.01, f"{name}: total variation {tv:.4f}"
    assert abs(acc - want_acc) < 0.01, f"{name}: acceptance {acc:.4f}, expected {want_acc:.4f}"


def test_second_token_follows_target_after_acceptance():
    """Two point-mass drafts: when the first is accepted, the second emitted token is distributed as
    the next position's target distribution (accepted draft or residual draw alike)."""
    g = torch.Generator().manual_seed(3)
    p = torch.stack([P, P_NEXT, P]).expand(N_DRAWS, 3, V)
    drafts = torch.tensor([0, 7]).expand(N_DRAWS, 2)
    num_accepted, token = rejection_sample_batch(p, drafts, None, g)
    after_first = num_accepted >= 1
    second = torch.where(num_accepted[after_first] == 2, 7, token[after_first])
    counts = torch.bincount(second, minlength=V).double()
    n = int(after_first.sum())
    tv = 0.5 * (counts / n - P_NEXT).abs().sum().item()
    assert abs(n / N_DRAWS - P[0].item()) < 0.01 and tv < 0.01, (n, tv)


def test_single_request_form_matches_batch():
    """``rejection_sample`` (what the engine calls per request) is the batch form at B = 1."""
    p = torch.stack([P, P_NEXT, P])
    q = torch.stack([P_NEXT, P])
    for seed in range(20):
        got = rejection_sample(p, [7, 0], q, torch.Generator().manual_seed(seed))
        a, t = rejection_sample_batch(p[None], torch.tensor([[7, 0]]), q[None], torch.Generator().manual_seed(seed))
        assert got == [7, 0][:int(a)] + [int(t)]


def test_greedy_accept():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, plus the bonus
    assert greedy_accept([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the target's token at the first mismatch
    assert greedy_accept([4, 6], [5]) == [4]


def test_ngram_longest_most_recent_match():
    # suffix [1, 2, 3] occurs at 0 (followed by 9 9) and at 5 (followed by 7 8): the latest wins
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert propose_ngram(toks, 1, 3, 2) == [7, 8]
    assert propose_ngram(toks, 1, 3, 10) == [7, 8, 0, 1, 2, 3]  # up to the end of the sequence
    # the longest n first: [5, 1, 2] matches nowhere... [1, 2] and [2] do; a 3-gram match beats them
    toks = [4, 2, 6, 5, 1, 2, 8, 5, 1, 2]
    assert propose_ngram(toks, 1, 3, 1) == [8]
    assert propose_ngram(toks, 1, 1, 1) == [8]
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []  # nothing repeats
    assert propose_ngram([7], 1, 3, 3) == []
    assert propose_ngram([3, 3, 3], 2, 2, 2) == [3]  # [3, 3] at 0 is followed by one token


def test_verify_samples_from_the_processed_target_distribution():
    """The engine's verification draws from the target distribution after temperature and top-k:
    a point-mass draft outside the top-k is never accepted, one inside it is accepted with its
    renormalized probability, and emitted tokens follow that distribution."""
    from appliance import SamplingParams
    from appliance.config import EngineConfig
    from appliance.engine.request import Request
    from appliance.engine.sampler import Sampler
    from appliance.engine.spec_decode import SpecDecoder

    spec = SpecDecoder(EngineConfig(model="unused", speculative_config={"method": "ngram",
                                                                        "num_speculative_tokens": 1}), None)
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.log(torch.stack([P, P_NEXT])).float() * 2.0  # temperature 2 gives back P / P_NEXT
    top2 = (P[:2] / P[:2].sum()).tolist()  # top_k = 2 at the first position: tokens 0 and 1
    n = 1500  # 4 sigma of the frequencies is ~0.05
    for draft, want_accept in ((7, 0.0), (1, top2[1])):
        counts, accepted = [0] * V, 0
        for i in range(n):
            req = Request(f"r{i}", [3, 4, 5], SamplingParams(temperature=2.0, top_k=2), (), 10)
            req.spec_token_ids = [draft]
            run = spec.verify(logits.clone(), [req], sampler)[0]
            counts[run[0].token_id] += 1
            accepted += len(run) == 2
        assert counts[2:] == [0] * (V - 2)
        assert abs(counts[0] / n - top2[0]) < 0.05 and abs(accepted / n - want_accept) < 0.05, (counts, accepted)
