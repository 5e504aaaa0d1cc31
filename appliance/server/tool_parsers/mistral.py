"""Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (a JSON array after the special
token; Mistral 7B v0.3, Nemo, Small 3.1), or the newer ``[TOOL_CALLS]f[ARGS]{...}`` with one
``[TOOL_CALLS]`` per call (tokenizer v11+: Small 3.2, Magistral), possibly after some text."""
from __future__ import annotations

import re

from appliance.server.tool_parsers.base import (
    Incomplete, Scan, ToolParser, held_content, scan_call_object, skip_ws, value_end,
)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def scan_call_array(text: str, j: int, final: bool, calls: list, args_keys=("arguments", "parameters")):
    """The array of call objects starting at ``text[j] == '['``: appends committed calls to ``calls``.
    Returns (end index or None, invalid: whether the first element is not a call)."""
    k = skip_ws(text, j + 1)
    first = True
    while True:
        if k >= len(text):
            return None, False
        if text[k] == "]" and first:
            return k + 1, False
        if text[k] != "{":
            return None, first
        c = scan_call_object(text, k, final, args_keys)
        if c.invalid:
            return None, first
        if c.call is None:
            return None, False
        calls.append(c.call)
        first = False
        if c.end is None:
            return None, False
        k = skip_ws(text, c.end)
        if k >= len(text):
            return None, False
        if text[k] == "]":
            return k + 1, False
        if text[k] != ",":
            return None, False
        k = skip_ws(text, k + 1)


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    needs_special_tokens = True  # [TOOL_CALLS] is a special token

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        i = text.find(self.start)
        if i < 0:
            out.content = held_content(text, (self.start,), final)
            return out
        seg = text[:i]
        j = skip_ws(text, i + len(self.start))
        if j >= len(text):
            out.content = seg.rstrip()
            return out
        if text[j] == "{":  # a single call without the array
            c = scan_call_object(text, j, final)
            if c.invalid:
                out.content = text
            else:
                out.content = seg.rstrip()
                if c.call is not None:
                    out.calls.append(c.call)
            return out
        if text[j] != "[":
            self._scan_v11(text, i, final, out)
            if not out.calls and out.content is None:
                out.content = text
            elif out.content is None:
                out.content = seg.rstrip()
            return out
        calls: list = []
        _, invalid = scan_call_array(text, j, final, calls)
        out.content = text if invalid else seg.rstrip()
        out.calls = calls
        return out

    _args = "[ARGS]"

    def _scan_v11(self, text: str, i: int, final: bool, out: Scan) -> None:
        """``[TOOL_CALLS]name[ARGS]{...}``, repeated. Leaves ``out.content`` None when the text is not
        such calls after all (the caller then makes all of it content)."""
        seg = text[:i]
        out.content = None
        while True:
            m = _NAME.match(text, i + len(self.start))
            end = m.end() if m else i + len(self.start)
            rest = text[end:end + len(self._args)]
            if not rest.startswith(self._args):
                if not final and self._args.startswith(rest):
                    out.content = seg.rstrip()  # the name or its [ARGS] is still arriving
                    return
                break
            if m is None:
                break
            a = end + len(self._args)
            if a >= len(text) and not final:
                out.content = seg.rstrip()
                return
            if a >= len(text) or text[a] != "{":
                break
            out.content = seg.rstrip()
            try:
                ve = value_end(text, a)
            except Incomplete:
                out.calls.append((m.group(), text[a:]))
                return
            out.calls.append((m.group(), text[a:ve]))
            k = skip_ws(text, ve)
            if not text.startswith(self.start, k):
                return  # text after the last call is not part of the answer
            i = k
        if out.calls:
            out.content = seg.rstrip()
