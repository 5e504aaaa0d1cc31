"""Request fields the protocol models do not declare.

The models ignore unknown fields (clients send OpenAI fields this server has no use for, such as
``user`` or ``store``), but a field that would change the result if it were honoured must not be
dropped silently: the client would get an answer to a different question. Those are listed in
``UNHONOURED`` with the values that matter and answered with a 400 that names them; every other
unknown field is logged once per process and ignored.

A rule applies only while its field is undeclared: a model that gains the field (because someone
implemented it) takes it over and the rule falls silent.
"""
from __future__ import annotations

import logging

from appliance.server.protocol import ChatCompletionRequest, OpenAIError

log = logging.getLogger("appliance.server")
_logged: set[str] = set()


def _truthy(v) -> bool:
    return v not in (None, False, 0, "", [], {})


def _chat(cls) -> bool:
    return issubclass(cls, ChatCompletionRequest)


# field -> (does this value, on this endpoint, change the result?, what is not supported)
UNHONOURED = {
    "use_beam_search": (lambda v, d, c: _truthy(v), "beam search is not supported"),
    "audio": (lambda v, d, c: v is not None, "audio output is not supported"),
    "modalities": (lambda v, d, c: isinstance(v, list) and any(m != "text" for m in v),
                   "only the 'text' output modality is supported"),
    "web_search_options": (lambda v, d, c: v is not None, "web search is not supported"),
    "parallel_tool_calls": (lambda v, d, c: v is False and _truthy(d.get("tools")),
                            "parallel_tool_calls=false (at most one tool call) is not supported"),
    "functions": (lambda v, d, c: _truthy(v), "the deprecated 'functions' field is not supported; use 'tools'"),
    "function_call": (lambda v, d, c: v not in (None, "none", "auto"),
                      "the deprecated 'function_call' field is not supported; use 'tool_choice'"),
    "truncate_prompt_tokens": (lambda v, d, c: v is not None, "prompt truncation is not supported"),
    "allowed_token_ids": (lambda v, d, c: v is not None, "allowed_token_ids is not supported"),
    "bad_words": (lambda v, d, c: _truthy(v), "bad_words is not supported"),
    "typical_p": (lambda v, d, c: v is not None and v != 1, "typical sampling is not supported"),
    "spaces_between_special_tokens": (lambda v, d, c: v is False,
                                      "spaces_between_special_tokens=false is not supported"),
    "echo": (lambda v, d, c: _truthy(v), "echo is not supported on chat completions"),
    "add_special_tokens": (lambda v, d, c: (v is True) if _chat(c) else (v is False),
                           "this endpoint's special-token handling is fixed (completions add them, chat "
                           "templates place them)"),
    "documents": (lambda v, d, c: _truthy(v), "documents (retrieval in the chat template) are not supported"),
    "chat_template": (lambda v, d, c: _truthy(v), "a per-request chat_template is not supported"),
    "return_tokens_as_token_ids": (lambda v, d, c: _truthy(v), "return_tokens_as_token_ids is not supported"),
    "structured_outputs": (lambda v, d, c: _truthy(v), "structured outputs are not supported by this build"),
    "guided_json": (lambda v, d, c: v is not None, "guided_json is not supported; use response_format"),
    "guided_regex": (lambda v, d, c: v is not None, "guided_regex is not supported"),
    "guided_choice": (lambda v, d, c: v is not None, "guided_choice is not supported"),
    "guided_grammar": (lambda v, d, c: v is not None, "guided_grammar is not supported"),
}


def check_request_fields(model_cls, data: dict) -> None:
    """400 for an undeclared field whose value would change the result; log the other undeclared
    ones (each name once per process)."""
    declared = set(model_cls.model_fields)
    for f in model_cls.model_fields.values():
        if f.alias:
            declared.add(f.alias)
    unknown = [k for k in data if k not in declared]
    refused = []
    for k in unknown:
        rule = UNHONOURED.get(k)
        if rule is not None and rule[0](data[k], data, model_cls):
            refused.append((k, rule[1]))
    if refused:
        names = ", ".join(repr(k) for k, _ in refused)
        reasons = "; ".join(f"{k}: {why} (got {data[k]!r:.60})" for k, why in refused)
        raise OpenAIError(400, f"unsupported request field(s) {names}: {reasons}", param=refused[0][0],
                          code="unsupported_parameter")
    for k in unknown:
        if k not in _logged:
            _logged.add(k)
            log.warning("ignoring unknown request field %r", k)
