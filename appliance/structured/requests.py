"""The request fields that constrain output, over HTTP, to a validated ``StructuredOutputsParams``.

- OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}`` (chat and completions);
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

At most one of them may be set. The grammar is built and checked here, in the server process, so a
bad schema, regex or grammar is a 400 naming the exact field (``response_format.json_schema.schema``,
``structured_outputs.regex``, ``guided_grammar``...) with llguidance's message, and never reaches the
engine.
"""
from __future__ import annotations

from appliance.errors import InvalidRequestError
from appliance.sampling_params import StructuredOutputsParams
from appliance.server.protocol import OpenAIError
from appliance.structured.grammar import kind_of, validate

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(field: str, msg: str) -> OpenAIError:
    return OpenAIError(400, f"{field} {msg}", param=field, code="invalid_value")


def _from_response_format(rf: dict) -> tuple[StructuredOutputsParams | None, str]:
    kind = rf.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema", f"must be an object with a schema for type "
                                                      f"'json_schema', got {js!r}")
        if "schema" not in js:
            raise _bad("response_format.json_schema.schema", "is required")
        return StructuredOutputsParams(json=js["schema"]), "response_format.json_schema.schema"
    raise _bad("response_format.type", f"must be one of 'text', 'json_object', 'json_schema'; got {kind!r}")


def _from_structured_outputs(so: dict) -> tuple[StructuredOutputsParams, str]:
    unknown = sorted(k for k, v in so.items() if k not in SO_KEYS and v not in (None, False))
    if unknown:
        raise _bad("structured_outputs", f"supports only {', '.join(SO_KEYS)}; got {unknown}")
    params = StructuredOutputsParams(**{k: so.get(k) for k in SO_KEYS})
    return params, f"structured_outputs.{kind_of(params)}"


def from_request(req) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled and checked, or None; OpenAIError (400) naming
    the field otherwise."""
    sources = []
    if getattr(req, "response_format", None) is not None:
        sources.append("response_format")
    if getattr(req, "structured_outputs", None) is not None:
        sources.append("structured_outputs")
    sources += [g for g in GUIDED if getattr(req, g, None) is not None]
    if not sources:
        return None
    if len(sources) > 1:
        raise OpenAIError(400, f"only one of response_format, structured_outputs and guided_* may constrain the "
                               f"output; got {', '.join(sources)}", param=sources[1])
    src = sources[0]
    field = src
    try:
        if src == "response_format":
            params, field = _from_response_format(req.response_format)
        elif src == "structured_outputs":
            params, field = _from_structured_outputs(req.structured_outputs)
        else:
            params = StructuredOutputsParams(**{GUIDED[src]: getattr(req, src)})
        if params is not None:
            validate(params, field)
        return params
    except InvalidRequestError as e:
        # StructuredOutputsParams names its own fields (structured_outputs.<kind>); the client sent another.
        msg, param = str(e), e.param
        if param and param.startswith("structured_outputs") and param != field and src != "structured_outputs":
            msg, param = msg.replace(param, field, 1), field
        raise OpenAIError(400, msg, param=param or field, code="invalid_value") from None
