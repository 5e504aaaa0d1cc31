"""Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (a JSON array after the special
token), possibly after some text."""
from __future__ import annotations

from appliance.server.tool_parsers.base import Scan, ToolParser, held_content, scan_call_object, skip_ws


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
            out.content = text
            return out
        calls: list = []
        _, invalid = scan_call_array(text, j, final, calls)
        out.content = text if invalid else seg.rstrip()
        out.calls = calls
        return out
