"""Llama 3.1 / 3.2 JSON tool calls: the whole output is ``{"name": "f", "parameters": {...}}``, possibly
after ``<|python_tag|>``, several separated by ``;``. An output that does not start that way is
plain content (as the model answered in words)."""
from __future__ import annotations

from appliance.server.tool_parsers.base import Scan, ToolParser, scan_call_object, skip_ws


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        j = skip_ws(text, 0)
        rest = text[j:]
        if not final and (not rest or (self.python_tag.startswith(rest))):
            return out  # may still become a tool call
        if rest.startswith(self.python_tag):
            j = skip_ws(text, j + len(self.python_tag))
            if j >= len(text) and not final:
                return out
        if j >= len(text) or text[j] != "{":
            out.content = text
            return out
        while True:
            c = scan_call_object(text, j, final)
            if c.invalid:
                if not out.calls:
                    out.content = text  # not a tool call: the model answered in text
                return out
            if c.call is None:
                return out
            out.calls.append(c.call)
            if c.end is None:
                return out
            k = skip_ws(text, c.end)
            if k >= len(text):
                return out
            if text[k] != ";":
                return out  # text after the calls is not part of the answer
            j = skip_ws(text, k + 1)
            if j >= len(text):
                return out
            if text[j] != "{":
                return out
