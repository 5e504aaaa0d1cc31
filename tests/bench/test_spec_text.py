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
                          {"dtype": "float32"}, log=lambda *a: None)
    ngram = next(r for r in rows if r["setting"] == "ngram")
    assert ngram["num_drafts"] > 0
    assert ngram["parts_from_plain_at"] == -1
    assert "text = plain" in spec.format_row(ngram)
    assert "token_ids" not in ngram  # ids stay out of the JSON rows
    bad = dict(ngram, parts_from_plain_at=7)
    assert "TEXT PARTS FROM PLAIN AT TOKEN 7" in spec.format_row(bad)
