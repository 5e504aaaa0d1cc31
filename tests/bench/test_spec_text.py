"""`bench spec` checks issue 19's greedy identity where it measures: each speculating row at concurrency 1
says whether its text equals the same engine's text without drafts, and where it parts."""
from __future__ import annotations

from appliance.bench import spec


def test_first_difference():
    assert spec.first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert spec.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert spec.first_difference([7], [8]) == 0
    assert spec.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert spec.first_difference([], []) == -1


def test_rows_report_the_text_against_the_plain_run(llama_dir, monkeypatch):
    # A prompt that repeats itself, so the n-gram proposer drafts; the tiny model has no tokenizer.
    ids = [5, 9, 14, 3, 22, 5, 9, 14, 3, 22, 5, 9, 14, 3, 22, 5, 9]
    monkeypatch.setattr(spec, "prompt_ids", lambda llm, w: list(ids))
    rows = spec.run_bench(str(llama_dir), None, ["none", "ngram"], ["code"], [1], 24, 3,
                          {"dtype": "float32"}, log=lambda *a: None, ignore_eos=True)
    ngram = next(r for r in rows if r["setting"] == "ngram")
    assert ngram["num_drafts"] > 0
    assert ngram["parts_from_plain_at"] == -1
    assert "text = plain" in spec.format_row(ngram)
    assert "token_ids" not in ngram  # ids stay out of the JSON rows
    assert ngram["output_tokens"] == 24 and " 24 tok " in spec.format_row(ngram)
    bad = dict(ngram, parts_from_plain_at=7)
    assert "TEXT PARTS FROM PLAIN AT TOKEN 7" in spec.format_row(bad)


def test_requests_end_at_their_end_of_turn(llama_dir, monkeypatch):
    """A user waits for the answer, not for what a model makes up after its own end of turn: the edit
    workload's rewrite ends after ~70 of 128 tokens, and measuring past it counted open-ended text as
    "edit". Requests stop at EOS (at most max_tokens); ``ignore_eos`` gives exactly max_tokens."""
    from appliance import LLM

    ids = [5, 9, 14, 3, 22, 5, 9, 14, 3, 22, 5, 9]
    for speculative_config in (None, {"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}):
        llm = LLM(str(llama_dir), dtype="float32", speculative_config=speculative_config)
        full = spec.run_requests(llm, [ids], 24, ignore_eos=True)
        assert full["output_tokens"] == 24 and len(full["token_ids"][0]) == 24
        out = full["token_ids"][0]
        # make a token the greedy text emits after its first one the end of turn
        j = next(i for i in range(3, len(out)) if out[i] not in out[:i])
        llm.engine.eos_token_ids = (out[j],)
        short = spec.run_requests(llm, [ids], 24)
        assert short["output_tokens"] == j + 1
        assert short["token_ids"][0] == out[:j + 1]
        again = spec.run_requests(llm, [ids], 24, ignore_eos=True)
        assert again["token_ids"][0] == out
        del llm
