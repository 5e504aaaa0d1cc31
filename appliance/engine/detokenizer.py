"""Incremental detokenization that never splits a multi-byte UTF-8 character, and stop strings
matched across token boundaries.

``ChoiceText`` is what turns one sequence's token ids into its text and decides where a stop string
ends it. It runs wherever the text is needed: in the offline ``LLMEngine`` right after each step,
and in the server's frontend process (never in the engine core's loop), which then tells the core
to stop the sequence.
"""
from __future__ import annotations

# Prompt tokens kept as left context so that tokenizers whose decoding of a token depends on its
# neighbours (leading spaces in SentencePiece) produce the same text as a full decode.
_CONTEXT_TOKENS = 5


def _fast_decoder(tokenizer):
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer whose ``decode``
    and ``_decode`` are the library's own: with clean-up off that is all they do, and calling it
    directly skips ~10 us of Python argument handling per call (two calls per token per request on
    every step). None for any other tokenizer (slow ones, subclasses that override decoding).
    A ``GGUFTokenizer``'s decode is that Rust call too (and needs no transformers import)."""
    from appliance.engine.tokenizer import GGUFTokenizer

    if type(tokenizer) is GGUFTokenizer:
        return tokenizer.backend_tokenizer.decode
    try:
        import tokenizers
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(backend, tokenizers.Tokenizer)
            and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode
            and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode):
        return backend.decode
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self._fast = _fast_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all text decoded so far (may end inside a possible stop string)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.stopped_by: str | None = None
        self._searched = 0  # text before this was added with check_stop False: never a stop match

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> None:
        """Decode new tokens; text that would end in an incomplete UTF-8 sequence is held back.
        After a stop string matched, the text is final and further tokens are ignored. With
        ``check_stop`` False (before ``min_tokens``), new text is not searched for stop strings."""
        if self.stopped_by is not None:
            return
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            prev_len = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if check_stop:
                self._check_stop(prev_len)
            else:
                self._searched = len(self.text)

    def flush(self) -> None:
        """At the end of a request: emit whatever is still held back (even an incomplete char)."""
        if self.read_offset < len(self.ids) and self.stopped_by is None:
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            prev_len = len(self.text)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
            self._check_stop(prev_len)

    def _check_stop(self, prev_len: int) -> None:
        if not self.stop or self.stopped_by is not None:
            return
        best = None
        for s in self.stop:
            idx = self.text.find(s, max(0, prev_len - len(s) + 1, self._searched))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
            self.stopped_by = s

    def visible_len(self, finished: bool) -> int:
        """Characters of ``text`` safe to show: while running, a tail that could begin a stop string
        is held back."""
        if finished or self.stopped_by is not None or self.max_stop_len <= 1:
            return len(self.text)
        return max(0, len(self.text) - (self.max_stop_len - 1))

    def visible_text(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)]


class ChoiceText:
    """One sequence's text as its tokens arrive, with the stop rules that need the text.

    The engine decides the token-level ends (EOS, ``stop_token_ids``, ``max_tokens``, the context);
    this decides the text-level ones. A stopping token's own text is not part of the output (as in
    vLLM) unless ``include_stop_str_in_output``; stop strings are only looked for once
    ``min_tokens`` tokens exist; a sequence that ends by length but whose held-back tail completes
    a stop string ends by that stop string."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                            params.stop_strings, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._sent = 0  # characters of text already handed out by ``new_text``

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> int:
        """Take the engine's new tokens for this sequence and, if it ended, how. Returns how many
        of ``token_ids`` belong to the output: fewer than given when a stop string ends the text
        early (the engine then still runs the sequence until told to stop it). Afterwards
        ``finished`` / ``finish_reason`` / ``stop_reason`` are final for this sequence."""
        if self.finished:
            return 0
        sp = self.params
        for j, tok in enumerate(token_ids):
            self.num_tokens += 1
            stopping_token = (j == len(token_ids) - 1 and finish_reason == "stop"
                              and not isinstance(stop_reason, str))
            if not stopping_token or sp.include_stop_str_in_output:
                self.detok.add_tokens([tok], check_stop=self.num_tokens >= sp.min_tokens)
                if self.detok.stopped_by is not None:
                    self.detok.flush()
                    self.finish_reason, self.stop_reason = "stop", self.detok.stopped_by
                    return j + 1
        if finish_reason is not None:
            self.detok.flush()
            if finish_reason == "length" and self.detok.stopped_by is not None:
                finish_reason, stop_reason = "stop", self.detok.stopped_by
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return len(token_ids)

    @property
    def text(self) -> str:
        """All the text that is safe to show now (a tail that may begin a stop string is held back
        while the sequence runs)."""
        return self.detok.visible_text(self.finished)

    def new_text(self) -> str:
        """The text not handed out before (per token: copies only the new characters)."""
        end = self.detok.visible_len(self.finished)
        out, self._sent = self.detok.text[self._sent:end], max(self._sent, end)
        return out
