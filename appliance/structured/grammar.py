"""StructuredOutputsParams -> llguidance grammar text, and its validation (no tokenizer, no torch).

The server process validates here before a request is queued, so a bad schema, regex or grammar
gets its 400 naming the field and never reaches the engine process; the engine compiles the same
text against its tokenizer (``appliance.structured.matchers``).
"""
from __future__ import annotations

import json

from appliance.errors import InvalidRequestError
from appliance.sampling_params import StructuredOutputsParams

# JSON without free whitespace: llguidance's default allows any run of whitespace between tokens,
# which a small model at temperature 1 can wander into for its whole max_tokens budget. Defaults,
# not overrides: a schema's own "x-guidance" options still win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The kind of constraint -> the field of StructuredOutputsParams that holds it.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def kind_of(params: StructuredOutputsParams) -> str:
    return next(k for k in KINDS if getattr(params, k) not in (None, False))


def grammar_text(params: StructuredOutputsParams, field: str | None = None) -> str:
    """The llguidance grammar (its JSON text) for ``params``; raises InvalidRequestError naming
    ``field`` (default ``structured_outputs.<kind>``) when it cannot be built."""
    from llguidance import LLMatcher

    kind = kind_of(params)
    field = field or f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = params.json
            if schema is True:
                schema = {}
            elif schema is False:
                raise InvalidRequestError(f"{field}: the schema false matches nothing", param=field)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # Each choice a literal (JSON string escaping is valid Lark string escaping).
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return LLMatcher.grammar_from_lark(_to_lark(params.grammar, field))
    except ValueError as e:  # llguidance: the schema is not a JSON object
        raise InvalidRequestError(f"{field}: {e}", param=field) from None


def _to_lark(text: str, field: str) -> str:
    """A Lark grammar as is; a GBNF one (llama.cpp's ``root ::= ...``) through llguidance's converter."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions for syntax errors
        raise InvalidRequestError(f"{field}: cannot read this GBNF grammar ({e})", param=field) from None


def validate(params: StructuredOutputsParams, field: str | None = None) -> str:
    """Build and check the grammar (no tokenizer needed); returns its text. Raises
    InvalidRequestError naming ``field`` with llguidance's message."""
    from llguidance import LLMatcher

    field = field or f"structured_outputs.{kind_of(params)}"
    text = grammar_text(params, field)
    err = LLMatcher.validate_grammar(text, None)
    if err:
        raise InvalidRequestError(f"{field}: invalid {_WHAT[kind_of(params)]}: {err.strip()}", param=field)
    return text


_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}
