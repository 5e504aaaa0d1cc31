"""Tool calling, reasoning and chat-template options of /v1/chat/completions: request checks,
``tool_choice`` (enforced through structured outputs where it must call a tool), and the output
side that turns generated text into ``message.tool_calls`` / ``reasoning_content`` (whole or as
streaming deltas).

vLLM's behaviour is the reference: ``tool_choice="auto"`` needs ``--enable-auto-tool-choice`` and
``--tool-call-parser``; ``"none"`` keeps the tools in the prompt but parses nothing; ``"required"``
and a named function are not hoped for but enforced: the output is constrained by a JSON schema
(``SamplingParams.structured_outputs``) and that JSON becomes the tool calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.server.protocol import OpenAIError, _short
from appliance.server.reasoning_parsers import ReasoningParser, get_reasoning_parser
from appliance.server.tool_parsers import ToolParser, get_tool_parser
from appliance.server.tool_parsers.base import Scan, ToolCall, ToolStreamer
from appliance.server.tool_parsers.mistral import scan_call_array

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# apply_chat_template arguments the server sets itself; a request may not override them.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer_kwargs")


# -- server options ----------------------------------------------------------------------------------

@dataclass
class ChatOptions:
    """The server flags that shape chat requests (see ``from_flags``)."""

    tool_parser: ToolParser | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: ReasoningParser | None = None
    chat_template: str | None = None  # overrides the tokenizer's
    default_template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_flags(cls, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                   reasoning_parser: str | None = None, chat_template: str | None = None,
                   default_chat_template_kwargs: dict | str | None = None) -> "ChatOptions":
        """Checks the flags (errors name the flag and the value) and loads the chat template."""
        if enable_auto_tool_choice and not tool_call_parser:
            raise ApplianceError("--enable-auto-tool-choice needs --tool-call-parser NAME (the model's tool-call "
                                 "format: hermes, llama3_json, mistral or pythonic)")
        try:
            tp = get_tool_parser(tool_call_parser) if tool_call_parser else None
            rp = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        except ValueError as e:
            raise ApplianceError(str(e)) from None
        kwargs = default_chat_template_kwargs or {}
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except ValueError as e:
                raise ApplianceError(f"--default-chat-template-kwargs must be a JSON object, got {kwargs!r} ({e})") \
                    from None
        if not isinstance(kwargs, dict):
            raise ApplianceError(f"--default-chat-template-kwargs must be a JSON object, got {_short(kwargs)}")
        bad = [k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS]
        if bad:
            raise ApplianceError(f"--default-chat-template-kwargs may not set {bad} (the server sets them)")
        return cls(tp, enable_auto_tool_choice, rp, load_chat_template(chat_template), kwargs)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path that exists is read, anything else is the template itself; either
    must compile as the Jinja that transformers renders."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long template string is not a valid path
        is_file = False
    if is_file:
        try:
            template = path.read_text()
        except OSError as e:
            raise ApplianceError(f"--chat-template {value}: cannot read ({e.strerror})") from None
    else:
        template = value
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateSyntaxError and others
        where = f"the file {path}" if is_file else "the string (not an existing file)"
        raise ApplianceError(f"--chat-template: {where} is not a valid Jinja template: {e}") from None
    return template


def template_kwargs(opts: ChatOptions, request_kwargs: dict | None) -> dict:
    """--default-chat-template-kwargs, then the request's chat_template_kwargs (the request wins)."""
    for k in request_kwargs or {}:
        if k in _RESERVED_TEMPLATE_KWARGS:
            raise OpenAIError(400, f"chat_template_kwargs.{k}: may not be set (the server sets it from the request)",
                              param=f"chat_template_kwargs.{k}")
    return {**opts.default_template_kwargs, **(request_kwargs or {})}


# -- request checks ----------------------------------------------------------------------------------

def check_tools(tools: list | None) -> list[dict] | None:
    """The request's tools in OpenAI's shape; a bad one is a 400 naming its field."""
    if tools is None:
        return None
    import jsonschema

    seen = set()
    out = []
    for i, t in enumerate(tools):
        def bad(field_, msg):
            raise OpenAIError(400, f"tools[{i}]{field_}: {msg}", param=f"tools.{i}{field_}", code="invalid_value")

        if not isinstance(t, dict):
            bad("", f"must be an object, got {_short(t)}")
        if t.get("type", "function") != "function":
            bad(".type", f"must be 'function', got {_short(t.get('type'))}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            bad(".function", f"must be an object with name, description, parameters; got {_short(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            bad(".function.name", f"must be 1 to 64 characters of a-z, A-Z, 0-9, '_', '.', '-'; got {_short(name)}")
        if name in seen:
            bad(".function.name", f"{name!r} is given twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            bad(".function.description", f"must be a string, got {_short(desc)}")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                bad(".function.parameters", f"must be a JSON schema object, got {_short(params)}")
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as e:
                bad(".function.parameters", f"is not a valid JSON schema: {e.message}")
        f = {"name": name}
        if desc is not None:
            f["description"] = desc
        f["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": f})
    return out


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None


def check_tool_choice(tool_choice, tools: list[dict] | None, opts: ChatOptions) -> ToolChoice:
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise OpenAIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got {tool_choice!r}",
                              param="tool_choice", code="invalid_value")
        if tool_choice == "none" or (tool_choice == "auto" and not tools):
            return ToolChoice("none")
        if not tools:
            raise OpenAIError(400, f"tool_choice={tool_choice!r} needs tools, and the request has none",
                              param="tool_choice", code="invalid_value")
        if tool_choice == "auto" and (not opts.enable_auto_tool_choice or opts.tool_parser is None):
            raise OpenAIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                   '--tool-call-parser NAME; use tool_choice "required", a named function or "none"',
                              param="tool_choice", code="invalid_value")
        return ToolChoice(tool_choice)
    if not isinstance(tool_choice, dict):
        raise OpenAIError(400, f"tool_choice must be a string or an object, got {_short(tool_choice)}",
                          param="tool_choice", code="invalid_value")
    if tool_choice.get("type", "function") != "function":
        raise OpenAIError(400, f"tool_choice.type must be 'function', got {_short(tool_choice.get('type'))}",
                          param="tool_choice.type", code="invalid_value")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise OpenAIError(400, f"tool_choice.function.name: missing or not a string (got tool_choice="
                               f"{_short(tool_choice)})", param="tool_choice.function.name", code="invalid_value")
    if name not in names:
        raise OpenAIError(400, f"tool_choice.function.name: {name!r} is not one of the request's tools {names}",
                          param="tool_choice.function.name", code="invalid_value")
    return ToolChoice("named", name)


def check_tool_messages(messages) -> None:
    """Every role "tool" message answers a tool call of an earlier assistant message."""
    ids: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            ids.extend(tc.id for tc in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise OpenAIError(400, f"messages[{i}].tool_call_id is required for role 'tool'",
                                  param=f"messages.{i}.tool_call_id", code="missing_required_parameter")
            if m.tool_call_id not in ids:
                raise OpenAIError(400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} matches no tool call of an "
                                       f"earlier assistant message (those are {ids})",
                                  param=f"messages.{i}.tool_call_id", code="invalid_value")


# -- enforced tool choice -----------------------------------------------------------------------------

def tool_choice_schema(choice: ToolChoice, tools: list[dict], parallel: bool | None = None) -> dict:
    """The JSON schema the output must follow: a named function's parameters, or for "required" an
    array (at least one) of {"name": one of the tools, "parameters": that tool's schema}."""
    fns = {t["function"]["name"]: t["function"] for t in tools}
    if choice.mode == "named":
        return fns[choice.name]["parameters"]
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [n]}, "parameters": f["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}
             for n, f in fns.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


class _RequiredScan:
    """The output of tool_choice="required": ``[{"name": ..., "parameters": {...}}, ...]``."""

    def __call__(self, text: str, final: bool) -> Scan:
        out = Scan()
        j = len(text) - len(text.lstrip())
        if j < len(text) and text[j] == "[":
            _, invalid = scan_call_array(text, j, final, out.calls, args_keys=("parameters",))
            if final and not out.calls and invalid:
                out.content = text
        elif final:
            out.content = text  # not the enforced shape (e.g. structured outputs unavailable)
        return out


class _NamedScan:
    """The output of a named tool_choice is the arguments object itself."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, text: str, final: bool) -> Scan:
        s = text.strip()  # trailing whitespace is held back until more text follows it
        return Scan(calls=[(self.name, s)] if s else [])


def _first_call(scan):
    def first(text: str, final: bool) -> Scan:
        s = scan(text, final)
        return Scan(s.content, s.calls[:1])

    return first


# -- output ------------------------------------------------------------------------------------------

class ChatOutput:
    """One choice's output: reasoning split off first, then tool calls parsed from the content."""

    def __init__(self, opts: ChatOptions, choice: ToolChoice, parallel_tool_calls: bool | None = None):
        # An enforced tool call is the whole output (the constraint leaves no room for reasoning).
        self.reasoning = opts.reasoning_parser if choice.mode not in ("required", "named") else None
        self._has_reasoning_field = opts.reasoning_parser is not None
        if choice.mode == "auto":
            self._scan = opts.tool_parser.scan
        elif choice.mode == "required":
            self._scan = _RequiredScan()
        elif choice.mode == "named":
            self._scan = _NamedScan(choice.name)
        else:
            self._scan = None
        if self._scan is not None and parallel_tool_calls is False:
            # at most one call: "required" is held to it by its schema; a parsed output keeps its first
            self._scan = _first_call(self._scan)
        self._rs = self.reasoning.streamer() if self.reasoning else None
        self._ts = ToolStreamer(self._scan) if self._scan else None

    @property
    def active(self) -> bool:
        return self._rs is not None or self._ts is not None

    def message(self, text: str) -> dict:
        """The non-streamed ``message`` (role, content, reasoning_content, tool_calls)."""
        if self.reasoning:
            reasoning, content = self.reasoning.extract(text)  # None for an empty part, as vLLM
        else:
            reasoning, content = None, text
        msg: dict = {"role": "assistant"}
        calls: list[ToolCall] = []
        if self._scan is not None and content is not None:
            s = self._scan(content, True)
            calls = [ToolCall(n, a) for n, a in s.calls]
            content = None if calls and not s.content else s.content
        msg["content"] = content
        if self._has_reasoning_field:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        """Streaming: the deltas this new text (and, with final, the end of the output) gives."""
        out = []
        if self._rs is not None:
            r, piece = self._rs.feed(piece)
            if final:
                r2, c2 = self._rs.finish()
                r, piece = r + r2, piece + c2
            if r:
                out.append({"reasoning_content": r})
        if self._ts is not None:
            out.extend(self._ts.feed(piece))
            if final:
                out.extend(self._ts.finish())
        elif piece:
            out.append({"content": piece})
        return out

    @property
    def called(self) -> bool:
        return bool(self._ts and self._ts.calls)
