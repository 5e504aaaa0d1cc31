"""SamplingParams, mirroring vLLM's so users can switch in either direction."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from appliance.errors import InvalidRequestError


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    ``json`` is a JSON schema (a dict or its JSON text); ``json_object`` any JSON object; ``regex``
    a regular expression; ``choice`` one of the given strings; ``grammar`` a Lark grammar (or GBNF).
    Compiling and enforcing the constraint is appliance.structured's job; this class checks shapes.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        def bad(name, msg):
            raise InvalidRequestError(f"structured_outputs.{name} {msg}", param=f"structured_outputs.{name}")

        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {set_ or 'none'}", param="structured_outputs")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                bad("json", f"is not valid JSON ({e})")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            bad("json", f"must be a JSON schema object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex", f"must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar", f"must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            bad("choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")


LOGIT_BIAS_LIMIT = 100.0


def _check_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int keys (OpenAI sends them as strings) and biases in [-100, 100]."""
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id -> bias, got {type(bias).__name__}",
                                  param="logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
            if isinstance(k, (bool, float)) or tid < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be non-negative token ids, got {k!r}",
                                      param="logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(
                f"logit_bias[{k}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {v!r}",
                param="logit_bias")
        out[tid] = float(v)
    return out or None


def check_logit_bias_vocab(bias: dict[int, float] | None, vocab_size: int) -> None:
    bad = sorted(t for t in (bias or {}) if t >= vocab_size)
    if bad:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}",
                                  param="logit_bias")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives returned beside the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (enforced by appliance.structured through the sampler's token mask).
    structured_outputs: StructuredOutputsParams | None = None
    # {token_id: bias added to its logit}, OpenAI's logit_bias; each bias in [-100, 100] (token ids
    # are checked against the vocabulary where it is known: the engine and the server).
    logit_bias: dict[int, float] | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def bad(param, msg):
            raise InvalidRequestError(f"{param} {msg}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or not self.temperature >= 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if self.top_p is None or not (0 < self.top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0 <= self.min_p <= 1):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (-2 <= self.presence_penalty <= 2):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not (-2 <= self.frequency_penalty <= 2):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                bad(name, f"must be an integer in [0, 20], got {v!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1:
            bad("seed", f"must be in the int64 range [{-(2**63)}, {2**63 - 1}], got {self.seed}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or s == "" for s in stop):
            bad("stop", f"must be non-empty strings, got {stop!r}")
        self._stop = stop
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            bad("stop_token_ids", f"must be non-negative integers, got {ids!r}")
        self.stop_token_ids = ids
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> "SamplingParams":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        d.update(changes)
        return SamplingParams(**d)
