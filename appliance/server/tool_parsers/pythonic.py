"""Pythonic tool calls (Llama 3.2 / Llama 4 style): the whole output is a Python list of calls,
``[get_weather(city="Paris", unit="c"), get_time()]``, optionally inside ``<|python_start|>`` ...
``<|python_end|>``. Parsed with ``ast`` (literals only, never evaluated); keyword arguments only.

A call is committed once it is complete and well formed and the next ``,`` or ``]`` is seen, so its
name and arguments stream together; an output that is not such a list is plain content.
"""
from __future__ import annotations

import ast
import json
import re

from appliance.server.tool_parsers.base import Scan, ToolParser, skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _close_paren(s: str, j: int) -> int | None:
    """``s[j] == '('``: the index after its matching ')', or None if the text ends first. Python
    string literals (quotes, escapes, triple quotes) are skipped."""
    depth, k, n = 0, j, len(s)
    while k < n:
        c = s[k]
        if c in "'\"":
            q = c * 3 if s.startswith(c * 3, k) else c
            k += len(q)
            while True:
                if k >= n:
                    return None
                if s[k] == "\\":
                    k += 2
                    continue
                if s.startswith(q, k):
                    k += len(q)
                    break
                k += 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return None


def _call(src: str) -> tuple[str, str] | None:
    """``name(k=literal, ...)`` -> (name, JSON arguments), or None if it is not such a call."""
    try:
        node = ast.parse(src, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    name = ".".join([func.id, *reversed(parts)])
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None  # **kwargs
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        return name, json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):  # sets, bytes, complex: not JSON
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start, end = "<|python_start|>", "<|python_end|>"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        j = skip_ws(text, 0)
        rest = text[j:]
        if not final and (not rest or self.start.startswith(rest)):
            return out
        if rest.startswith(self.start):
            j = skip_ws(text, j + len(self.start))
            if j >= len(text) and not final:
                return out
        if j >= len(text) or text[j] != "[":
            out.content = text
            return out
        k = skip_ws(text, j + 1)
        while True:
            if k >= len(text):
                if final:
                    break
                return out  # wait for more
            m = _NAME.match(text, k)
            if m is None:
                break  # invalid element
            p = skip_ws(text, m.end())
            if p >= len(text):
                if final:
                    break
                return out
            if text[p] != "(":
                break
            e = _close_paren(text, p)
            if e is None:
                if final:
                    break
                return out
            call = _call(text[k:e])
            if call is None:
                break
            q = skip_ws(text, e)
            if q >= len(text):
                if final:
                    break
                return out
            if text[q] not in ",]":
                break
            out.calls.append(call)
            if text[q] == "]":
                return out
            k = skip_ws(text, q + 1)
            if k >= len(text) and not final:
                return out
        # Not (or no longer) a list of calls: with no call found the output is text.
        if not out.calls:
            out.content = text
        return out
