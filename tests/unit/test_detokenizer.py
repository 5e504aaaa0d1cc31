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


# -- ChoiceText: the per-sequence text and stop rules, as the offline engine and the server's
# frontend both run them -------------------------------------------------------------------------

def _params(**kw):
    from appliance.sampling_params import SamplingParams

    return SamplingParams(**kw)


def test_choice_text_stop_string_cuts_tokens_and_sets_reason(tok):
    from appliance.engine.detokenizer import ChoiceText

    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    ct = ChoiceText(tok, [], _params(stop=["fox jum"]))
    # all tokens offered in one delta (the core may be ahead): only those up to the stop string count
    k = ct.update(ids)
    assert ct.finished and (ct.finish_reason, ct.stop_reason) == ("stop", "fox jum")
    assert tok.decode(ids[:k]).find("fox jum") != -1 and tok.decode(ids[:k - 1]).find("fox jum") == -1
    assert ct.new_text() == "The quick brown " and ct.new_text() == ""
    assert ct.update(ids[:3]) == 0  # nothing more once ended


def test_choice_text_min_tokens_defers_stop_strings(tok):
    from appliance.engine.detokenizer import ChoiceText

    ids = tok.encode(" stop here and stop again", add_special_tokens=False)
    first_stop = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[:i + 1]))
    ct = ChoiceText(tok, [], _params(stop=["stop"], min_tokens=first_stop + 2))
    k = ct.update(ids)
    # the first "stop" is inside the first min_tokens tokens: ignored; the second one ends the text
    assert ct.stop_reason == "stop" and ct.text == " stop here and " and k > first_stop + 1


def test_choice_text_stopping_token_text_is_dropped_unless_asked(tok):
    from appliance.engine.detokenizer import ChoiceText

    ids = tok.encode("Hello world", add_special_tokens=False)
    eos = ids[-1]
    for include, want in ((False, tok.decode(ids[:-1])), (True, tok.decode(ids))):
        ct = ChoiceText(tok, [], _params(include_stop_str_in_output=include))
        ct.update(ids[:-1])
        assert ct.update([eos], "stop", eos) == 1
        assert ct.text == want and (ct.finish_reason, ct.stop_reason) == ("stop", eos)


def test_choice_text_length_end_that_completes_a_stop_string_is_a_stop(tok):
    from appliance.engine.detokenizer import ChoiceText

    ids = tok.encode("abc END", add_special_tokens=False)
    ct = ChoiceText(tok, [], _params(stop=["END"]))
    ct.update(ids, "length", None)
    assert (ct.finish_reason, ct.stop_reason, ct.text) == ("stop", "END", "abc ")


def test_fast_decoder_equals_transformers_decode(tok):
    # The Rust decode the detokenizer calls directly must give exactly transformers' decode (clean-up
    # off), special tokens kept or skipped.
    from appliance.engine.detokenizer import _fast_decoder

    fast = _fast_decoder(tok)
    assert fast is not None, type(tok)
    ids = tok.encode(TEXTS[0] + " " + TEXTS[2], add_special_tokens=False)
    specials = [i for i in tok.all_special_ids if i is not None][:2]
    assert specials
    for seq in (ids, specials + ids[:5] + specials + ids[5:], ids[3:4]):
        for skip in (True, False):
            assert fast(seq, skip_special_tokens=skip) == tok.decode(
                seq, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_fast_decoder_declines_overridden_decode(tok):
    from appliance.engine.detokenizer import _fast_decoder

    class Custom(type(tok)):
        def decode(self, *a, **k):  # a subclass with its own decoding keeps it
            return "custom"

    t = Custom.__new__(Custom)
    t.__dict__.update(tok.__dict__)
    assert _fast_decoder(t) is None
    word = tok.encode("hello", add_special_tokens=False)
    assert tok.decode(word)  # a token with text: the library's decode would emit it
    d = IncrementalDetokenizer(t, [], skip_special_tokens=True)
    d.add_tokens(word)
    assert d.text == ""  # "custom" decodes every prefix the same: nothing new
