"""Reasoning parsers (``--reasoning-parser NAME``): split a model's output into the reasoning between
``<think>`` and ``</think>`` (``message.reasoning_content``) and the answer after it (``content``).

Like the tool parsers, a parser is a pure ``scan(text, final) -> (reasoning, content)`` over a
prefix that is monotone in the prefix, so the streamed ``delta.reasoning_content`` and
``delta.content`` pieces concatenate to the non-streamed fields.
"""
from __future__ import annotations

from appliance.server.tool_parsers.base import partial_marker_len

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""

    def scan(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        r, c = self.scan(text, True)
        return r or None, c or None

    def streamer(self) -> "ReasoningStreamer":
        return ReasoningStreamer(self)


def _split_after_open(text: str, j: int, final: bool) -> tuple[str, str]:
    """Reasoning runs from ``j`` to ``</think>``; the content is what follows it."""
    e = text.find(END, j)
    if e >= 0:
        return text[j:e], text[e + len(END):]
    if final:
        return text[j:], ""  # never closed (e.g. cut by max_tokens): all of it was reasoning
    return text[j:len(text) - partial_marker_len(text, END)], ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the chat template already opened ``<think>``, so everything
    before ``</think>`` is reasoning. A ``<think>`` the model writes again is dropped."""

    name = "deepseek_r1"

    def scan(self, text, final):
        s = text.lstrip()
        if s.startswith(START):
            return _split_after_open(text, len(text) - len(s) + len(START), final)
        if not final and START.startswith(s):
            return "", ""  # may be a <think> still arriving
        return _split_after_open(text, 0, final)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the output opens with ``<think>``; with ``enable_thinking=False``
    the template closes the (empty) think block itself and the whole output is content."""

    name = "qwen3"

    def scan(self, text, final):
        s = text.lstrip()
        if s.startswith(START):
            return _split_after_open(text, len(text) - len(s) + len(START), final)
        if not final and START.startswith(s):
            return "", ""
        return "", text


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}") from None


class ReasoningStreamer:
    """Feeds pieces; returns (reasoning delta, content delta) each time."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._diff(*self.parser.scan(self.text, False))

    def finish(self) -> tuple[str, str]:
        return self._diff(*self.parser.scan(self.text, True))

    def _diff(self, r: str, c: str) -> tuple[str, str]:
        dr = r[len(self.reasoning):] if r.startswith(self.reasoning) else ""
        dc = c[len(self.content):] if c.startswith(self.content) else ""
        self.reasoning += dr
        self.content += dc
        return dr, dc
