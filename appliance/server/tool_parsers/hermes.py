"""Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``,
one block per call, possibly after some text."""
from __future__ import annotations

from appliance.server.tool_parsers.base import Scan, ToolParser, held_content, scan_call_object, skip_ws


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        pos, after_call = 0, False
        while True:
            i = text.find(self.start, pos)
            seg = text[pos:] if i < 0 else text[pos:i]
            if after_call:
                seg = seg.lstrip()  # whitespace next to a tool call is not content
            if i < 0:
                out.content += held_content(seg, (self.start,), final)
                return out
            j = skip_ws(text, i + len(self.start))
            if j >= len(text):  # the block has only begun
                out.content += seg.rstrip()
                return out
            if text[j] != "{":
                out.content += seg + text[i:]  # not a call after all: the rest is plain text
                return out
            c = scan_call_object(text, j, final)
            if c.invalid:
                out.content += seg + text[i:]
                return out
            out.content += seg.rstrip()
            if c.call is None:
                return out
            out.calls.append(c.call)
            if c.end is None:
                return out
            k = skip_ws(text, c.end)
            if text.startswith(self.end, k):
                pos = k + len(self.end)
            elif not final and len(text) - k < len(self.end) and self.end.startswith(text[k:]):
                return out  # the closing tag is still arriving
            else:
                pos = c.end  # no closing tag: the block ends with its object
            after_call = True
