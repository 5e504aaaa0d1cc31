"""The n-gram proposer and the per-request draft length, on constructed token sequences: exact
proposals, the adaptive length after accepted and rejected runs, and no drafts past max_tokens."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from appliance.engine.spec_decode import SpecDecoder, next_draft_length
from appliance.engine.spec_decode.ngram import propose_ngram
from appliance.engine.spec_decode.policy import DraftLengthPolicy


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: the 3-gram occurs at 0 (followed by 10, 11); the 2-gram [2, 3] also at 6,
    # more recently (followed by 20): the longest match comes first
    toks = [1, 2, 3, 10, 11, 9, 2, 3, 20, 5, 1, 2, 3]
    assert propose_ngram(toks, 2, 3, 2) == [10, 11]
    assert propose_ngram(toks, 2, 2, 2) == [20, 5]  # with max 2 only the 2-gram is looked for


def test_most_recent_of_equal_length_matches():
    toks = [4, 5, 6, 7, 4, 5, 8, 9, 4, 5]
    assert propose_ngram(toks, 2, 4, 3) == [8, 9, 4]
    assert propose_ngram(toks, 3, 4, 3) == []  # [9, 4, 5] occurs nowhere else: under the minimum


def _propose_brute_force(toks, min_n, max_n, k):
    """The definition, directly: for n from max_n down, every earlier window equal to the suffix."""
    for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
        hits = [i for i in range(len(toks) - n) if toks[i:i + n] == toks[len(toks) - n:]]
        if hits:
            return toks[hits[-1] + n:hits[-1] + n + k]
    return []


def test_matches_the_definition_on_random_sequences():
    """Small alphabets make many overlapping and partial matches; lengths from 1 (nothing before the
    suffix) up, min_n from 1, max_n past the sequence."""
    rng = random.Random(7)
    for _ in range(5000):
        toks = [rng.randrange(rng.choice([2, 3, 5, 40])) for _ in range(rng.randint(1, 50))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(1, 5)
        assert propose_ngram(toks, lo, hi, k) == _propose_brute_force(toks, lo, hi, k), (toks, lo, hi, k)


def test_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    assert next_draft_length(3, 5, 3, 3) == 4  # all accepted: one more
    assert next_draft_length(5, 5, 5, 5) == 5  # capped at k
    assert next_draft_length(4, 5, 2, 2) == 5  # a short proposal fully accepted does not shrink it
    assert next_draft_length(5, 5, 5, 0) == 1  # rejected at the first draft
    assert next_draft_length(5, 5, 5, 2) == 3  # rejected at the third: the accepted run plus one
    assert next_draft_length(1, 5, 1, 1) == 2


def _decoder(k=4, lo=1, hi=3):
    cfg = SimpleNamespace(disable_by_batch_size=8, prompt_lookup_min=lo, prompt_lookup_max=hi, cost_aware=True)
    return SimpleNamespace(config=cfg, k=k, draft=None, num_steps_off=0, policy=DraftLengthPolicy())


def _request(tokens, num_prompt, max_tokens, spec_k=0):
    return SimpleNamespace(spec_token_ids=[], spec_allowed=True, num_tokens=len(tokens),
                           num_computed_tokens=len(tokens) - 1, spec_paused_steps=0, spec_k=spec_k,
                           max_tokens=max_tokens, num_output_tokens=len(tokens) - num_prompt,
                           all_token_ids=list(tokens), spec_run_counts=(0.0, 0.0))


@pytest.mark.parametrize("spec_k, max_tokens, want", [
    (0, 100, [1, 2, 3, 4]),  # no history yet: k
    (2, 100, [1, 2]),        # the request's adaptive length
    (0, 4, [1]),             # 2 outputs of 4: a verified step emits drafts + 1, so 1 draft at most
    (0, 3, []),              # 1 output left: nothing to draft
])
def test_before_schedule_uses_the_request_draft_length_and_stops_at_max_tokens(spec_k, max_tokens, want):
    tokens = [9, 1, 2, 3, 4, 5, 6, 9]  # prompt of 6, 2 outputs; [9] recurs at 0, followed by 1, 2, 3, ...
    req = _request(tokens, 6, max_tokens, spec_k)
    SpecDecoder.before_schedule(_decoder(), [req])
    assert req.spec_token_ids == want
