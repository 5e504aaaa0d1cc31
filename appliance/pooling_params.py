"""PoolingParams, mirroring vLLM's: what a pooling (embedding) request asks beyond its prompt.

The model-wide pooler (pooling type, normalization) is ``EngineConfig.pooler_config``; a request may
only ask for fewer ``dimensions`` (a matryoshka model) or switch normalization off or on.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.errors import InvalidRequestError


@dataclass
class PoolingParams:
    dimensions: int | None = None  # keep the first k of the pooled vector (before normalizing)
    normalize: bool | None = None  # None: the pooler config's
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (vLLM's extension)

    n = 1  # one output per request (engine plumbing shared with SamplingParams reads it)

    def __post_init__(self):
        for name in ("dimensions", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {v!r}", param=name)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", param="normalize")
