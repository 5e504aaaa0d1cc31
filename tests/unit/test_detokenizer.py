"""Incremental detokenization: never emits half a UTF-8 character, ends equal to a full decode,
and matches stop strings across token boundaries."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from appliance.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Héllo wörld, ünïcode ✓ 東京 and 🚀🤖 emoji", "plain ascii text with spaces", "東京東京✓✓ 🚀"]


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(str(llama_dir))


def stream(tok, prompt_ids, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    seen = []
    for t in ids:
        d.add_tokens([t])
        seen.append(d.visible_text(False))
    d.flush()
    return d, seen


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_multibyte_chars_are_never_split(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if not text.isascii():  # the byte-level BPE splits some multi-byte characters across tokens
        assert any("\ufffd" in tok.decode([t]) for t in ids)
    d, seen = stream(tok, tok.encode("Prompt:", add_special_tokens=False), ids)
    for s in seen:
        assert "\ufffd" not in s
        assert text.startswith(s)  # every intermediate text is a prefix of the final one
    assert d.text == text


def test_random_token_streams_end_equal_to_full_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        d, seen = stream(tok, [5, 6], ids)
        assert d.text == tok.decode(ids, skip_special_tokens=True)
        for a, b in zip(seen, seen[1:]):
            assert b.startswith(a)  # text only ever grows


def test_stop_string_across_tokens_and_holdback(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    d, seen = stream(tok, [], ids, stop=["fox jum"])
    assert d.stopped_by == "fox jum" and d.text == "The quick brown "
    # while running, nothing that could still turn out to be a stop string is shown
    assert all(not s.endswith("fox ju") for s in seen)
    d2, _ = stream(tok, [], ids, stop=["fox jum"], include_stop_str_in_output=True)
    assert d2.text == "The quick brown fox jum"
