"""What every tool-call parser shares: the result types, the streaming extractor and a lenient
incremental JSON scanner.

A parser is one pure function, ``scan(text, final)``, that reads a model's output (or a prefix of
it) and says what is already certain: the content text and the tool calls (name, arguments text so
far). The whole-text extract is ``scan(text, final=True)``; the streaming extractor calls
``scan(prefix, final=False)`` after every new piece and sends only the difference from what it
already sent, then ``scan(text, final=True)`` at the end. A scan must therefore be monotone: a
longer prefix may only extend the content and the calls of a shorter one, which is why scans hold
back text that could still turn out to be the start of a tool call (a partial marker, the
whitespace before one, an object whose function name is not known yet). The tests feed every
parser's outputs split at every character and check the stream adds up to the whole-text result.

Arguments are the model's own JSON text of the arguments object (not re-serialised), so streamed
fragments concatenate to exactly the non-streamed ``arguments`` string.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field

log = logging.getLogger("appliance.server")


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class Scan:
    """What a (prefix of a) model output certainly contains."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments text so far)


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # None when the output is only tool calls
    tool_calls: list[ToolCall]


class ToolParser:
    """One tool-call format. Subclasses set ``name`` and implement ``scan``."""

    name: str = ""
    # Formats whose markers are special tokens ([TOOL_CALLS], <|python_tag|>) need them in the text.
    needs_special_tokens: bool = False

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        s = self.scan(text, final=True)
        calls = [ToolCall(n, a) for n, a in s.calls]
        return ExtractedToolCalls(None if calls and not s.content else s.content, calls)

    def streamer(self) -> "ToolStreamer":
        return ToolStreamer(self.scan)


class ToolStreamer:
    """Turns output text, fed piece by piece, into OpenAI chat deltas: ``{"content": ...}``, then per
    call one ``{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}`` and
    ``{"tool_calls": [{index, function: {arguments: fragment}}]}`` deltas."""

    def __init__(self, scan):
        self._scan = scan
        self.text = ""
        self.content = ""
        self.calls: list[list] = []  # [id, name, arguments sent]
        self.finished = False

    def feed(self, piece: str) -> list[dict]:
        if not piece:
            return []
        self.text += piece
        return self._diff(self._scan(self.text, False))

    def finish(self) -> list[dict]:
        self.finished = True
        return self._diff(self._scan(self.text, True))

    def tool_calls(self) -> list[dict]:
        return [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self.calls]

    def _diff(self, s: Scan) -> list[dict]:
        out = []
        if s.content.startswith(self.content):
            if len(s.content) > len(self.content):
                out.append({"content": s.content[len(self.content):]})
                self.content = s.content
        else:  # a non-monotone scan is a parser bug; never send text that contradicts what was sent
            log.warning("tool parser: content %r does not extend the streamed %r", s.content[:80], self.content[:80])
        for i, (name, args) in enumerate(s.calls):
            if i == len(self.calls):
                self.calls.append([new_call_id(), name, ""])
                out.append({"tool_calls": [{"index": i, "id": self.calls[i][0], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            sent = self.calls[i][2]
            if name != self.calls[i][1] or not args.startswith(sent):
                log.warning("tool parser: call %d (%s, %r) does not extend the streamed one", i, name, args[:80])
                continue
            if len(args) > len(sent):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(sent):]}}]})
                self.calls[i][2] = args
        return out


# -- text helpers -----------------------------------------------------------------------------------

def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def held_content(seg: str, markers: tuple[str, ...], final: bool) -> str:
    """The part of an outside-a-call segment that is certainly content: at the end of a prefix, a
    partial marker and the whitespace before a possible marker are held back (whitespace next to a
    tool call is not content)."""
    if final:
        return seg
    hold = max(partial_marker_len(seg, m) for m in markers)
    return seg[: len(seg) - hold].rstrip()


_WS = " \t\r\n"


def skip_ws(s: str, j: int) -> int:
    n = len(s)
    while j < n and s[j] in _WS:
        j += 1
    return j


# -- lenient incremental JSON scanning ---------------------------------------------------------------
# Only what the parsers need: where strings and brackets end, and the spans of an object's top-level
# members. Interiors of nested values are not validated here (the arguments text is the model's).

class Incomplete(Exception):
    pass


class Invalid(Exception):
    pass


_STRUCT = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[-+0-9.eEa-z]+")


def string_end(s: str, j: int) -> int:
    """``s[j]`` is '"': the index after the closing quote."""
    k = j + 1
    while True:
        q = s.find('"', k)
        if q < 0:
            raise Incomplete
        b, slashes = q - 1, 0
        while b > j and s[b] == "\\":
            slashes += 1
            b -= 1
        if slashes % 2 == 0:
            return q + 1
        k = q + 1


def value_end(s: str, j: int) -> int:
    """The index after the JSON value starting at ``s[j]``."""
    if j >= len(s):
        raise Incomplete
    c = s[j]
    if c == '"':
        return string_end(s, j)
    if c in "{[":
        depth, k = 0, j
        while True:
            m = _STRUCT.search(s, k)
            if m is None:
                raise Incomplete
            k, ch = m.start(), m.group()
            if ch == '"':
                k = string_end(s, k)
                continue
            depth += 1 if ch in "{[" else -1
            k += 1
            if depth == 0:
                return k
    m = _SCALAR.match(s, j)
    if m is None:
        raise Invalid
    if m.end() == len(s):
        raise Incomplete  # a number or literal may go on
    try:
        json.loads(m.group())
    except ValueError:
        raise Invalid from None
    return m.end()


@dataclass
class ObjectScan:
    members: dict  # key -> (value start, value end or None while incomplete)
    end: int | None  # index after '}' once complete
    invalid: bool = False


def scan_object(s: str, i: int) -> ObjectScan:
    """Scan the JSON object starting at ``s[i] == '{'`` as far as ``s`` goes."""
    out = ObjectScan({}, None)
    n = len(s)
    j = skip_ws(s, i + 1)
    if j < n and s[j] == "}":
        out.end = j + 1
        return out
    while j < n:
        if s[j] != '"':
            out.invalid = True
            return out
        try:
            ke = string_end(s, j)
        except Incomplete:
            return out
        key = json.loads(s[j:ke])
        j = skip_ws(s, ke)
        if j >= n:
            return out
        if s[j] != ":":
            out.invalid = True
            return out
        j = skip_ws(s, j + 1)
        if j >= n:
            return out
        try:
            ve = value_end(s, j)
        except Incomplete:
            out.members[key] = (j, None)
            return out
        except Invalid:
            out.invalid = True
            return out
        out.members[key] = (j, ve)
        j = skip_ws(s, ve)
        if j >= n:
            return out
        if s[j] == "}":
            out.end = j + 1
            return out
        if s[j] != ",":
            out.invalid = True
            return out
        j = skip_ws(s, j + 1)
    return out


@dataclass
class CallScan:
    """One ``{"name": ..., "arguments"|"parameters": {...}}`` object, as far as the text goes."""

    call: tuple[str, str] | None  # (name, arguments so far) once committed, else None
    end: int | None  # index after the object once complete
    invalid: bool  # not a tool call (and nothing of it was committed)


def scan_call_object(s: str, i: int, final: bool, args_keys=("arguments", "parameters")) -> CallScan:
    """A call is committed once its name is known and its arguments object has begun (or the object
    closed without arguments: ``{}``); before that nothing of it is certain."""
    o = scan_object(s, i)
    name = None
    if "name" in o.members and o.members["name"][1] is not None:
        a, b = o.members["name"]
        v = json.loads(s[a:b])
        if not isinstance(v, str):
            return CallScan(None, None, True)
        name = v
    key = next((k for k in args_keys if k in o.members), None)
    if key is not None and s[o.members[key][0]] != "{":
        return CallScan(None, None, True)  # arguments must be an object
    if name is None:  # undecided until the name arrives; a closed or broken object without one is no call
        return CallScan(None, None, o.invalid or o.end is not None or final)
    if key is None:
        if o.end is not None:
            return CallScan((name, "{}"), o.end, False)
        if o.invalid or final:
            return CallScan(None, None, True)
        return CallScan(None, None, False)
    a, b = o.members[key]
    args = s[a:b] if b is not None else s[a:]
    # A committed call stays a call even if the text after it breaks (a truncated output).
    return CallScan((name, args), o.end, False)
