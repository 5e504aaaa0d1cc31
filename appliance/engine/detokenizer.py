"""Incremental detokenization that never splits a multi-byte UTF-8 character, and stop strings
matched across token boundaries."""
from __future__ import annotations

# Prompt tokens kept as left context so that tokenizers whose decoding of a token depends on its
# neighbours (leading spaces in SentencePiece) produce the same text as a full decode.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all text decoded so far (may end inside a possible stop string)
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> None:
        """Decode new tokens; text that would end in an incomplete UTF-8 sequence is held back.
        After a stop string matched, the text is final and further tokens are ignored."""
        if self.stopped_by is not None:
            return
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            prev_len = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(prev_len)

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
            idx = self.text.find(s, max(0, prev_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
            self.stopped_by = s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could begin a stop string."""
        if finished or self.stopped_by is not None or self.max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self.max_stop_len - 1))]
