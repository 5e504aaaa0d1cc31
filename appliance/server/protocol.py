"""The OpenAI wire schema (requests) and the error shape ``{"error": {message, type, param, code}}``.

Request models check types and shapes only; value ranges are checked by ``SamplingParams``, so the
offline API and the server refuse exactly the same things with the same messages. Unknown fields
are ignored (clients send fields this server does not use, e.g. ``user``) and logged once, except
those that would change the result (``request_fields.UNHONOURED``), which get a 400.
"""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class OpenAIError(Exception):
    """An error with an HTTP status that the API turns into OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _short(value, limit: int = 80) -> str:
    s = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def validation_error(e: ValidationError) -> OpenAIError:
    """The first pydantic error as a 400 that names the parameter and the value it got."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith(("function-", "list[", "str", "int"))]
    param = ".".join(loc) or None
    if err.get("type") == "missing":
        return OpenAIError(400, f"missing required parameter: {param!r}", param=param,
                           code="missing_required_parameter")
    msg = err.get("msg", "invalid value")
    got = err.get("input")
    return OpenAIError(400, f"invalid value for {param!r}: {msg} (got {_short(got)})", param=param,
                       code="invalid_value")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: logprobs of the prompt tokens
    # Output constraints, read by appliance/structured/requests.py (at most one may be set).
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template wants them: text parts joined, roles checked."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise OpenAIError(400, f"messages[{i}].content[{j}]: only text content parts are supported, "
                                           f"got type {part.type!r}", param=f"messages.{i}.content.{j}.type")
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None:
            if m.role != "assistant":
                raise OpenAIError(400, f"messages[{i}].content is required for role {m.role!r}",
                                  param=f"messages.{i}.content")
            content = ""
        else:
            content = m.content
        role = "system" if m.role == "developer" else m.role
        d = {"role": role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out
