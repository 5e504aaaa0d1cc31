"""The pooler of an embedding model: the final hidden states of a prompt's positions -> one vector.

Pooling types (vLLM's names): ``LAST`` (the last position; decoder embedding models such as
Qwen3-Embedding), ``MEAN`` (the mean over every position), ``CLS`` (the first position). Then the
head: the first ``dimensions`` entries (matryoshka models) and an L2 normalization.

A prompt may arrive in several chunks (chunked prefill), so the pooler keeps a per-request partial
state between steps: MEAN a running float32 sum, CLS the first position once seen; LAST needs only
the final chunk. A chunk that starts at position 0 resets the state (a preempted request is
recomputed from its start).

``resolve_pooler_config`` gives the model-wide settings: the user's ``--pooler-config``, over what a
sentence-transformers checkpoint says (modules.json, its Pooling module's config.json, a Normalize
module), over the default for decoder models (LAST, normalized).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from appliance.errors import InvalidRequestError, ModelLoadError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_FIELDS = ("pooling_type", "normalize")
# sentence-transformers Pooling config flag -> pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip; LAST reads only the last one,
        which the cache never covers."""
        return self.pooling_type != "LAST"


def parse_pooler_config(value) -> dict:
    """``--pooler-config`` (a JSON object, or its text) -> the fields it sets, checked."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"pooler_config is not valid JSON ({e}): {value!r}", "pooler_config") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"pooler_config must be a JSON object, got {value!r}", "pooler_config")
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise InvalidRequestError(f"pooler_config: unsupported field(s) {', '.join(unknown)}; "
                                  f"supported: {', '.join(_FIELDS)}", "pooler_config")
    out = {}
    if value.get("pooling_type") is not None:
        pt = str(value["pooling_type"]).upper()
        if pt not in POOLING_TYPES:
            raise InvalidRequestError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                                      f"got {value['pooling_type']!r}", "pooler_config")
        out["pooling_type"] = pt
    if value.get("normalize") is not None:
        if not isinstance(value["normalize"], bool):
            raise InvalidRequestError(f"pooler_config.normalize must be true or false, got {value['normalize']!r}",
                                      "pooler_config")
        out["normalize"] = value["normalize"]
    return out


def sentence_transformers_config(path: Path | None) -> dict:
    """What a sentence-transformers checkpoint's modules.json says: its Pooling module's mode and
    whether a Normalize module follows. {} when there is no modules.json (or no directory)."""
    if path is None:
        return {}
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{modules_file}: not valid JSON ({e})") from e
    out: dict = {"normalize": False}
    for m in modules if isinstance(modules, list) else []:
        kind = str(m.get("type", ""))
        if kind.endswith(".Normalize"):
            out["normalize"] = True
        elif kind.endswith(".Pooling"):
            cfg_file = Path(path) / m.get("path", "") / "config.json"
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{cfg_file}: cannot read the Pooling module's config ({e})") from e
            modes = [t for flag, t in _ST_MODES.items() if cfg.get(flag)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            if others or len(modes) > 1:
                raise ModelLoadError(f"{cfg_file}: pooling mode {others or modes} is not supported; "
                                     f"supported: one of {', '.join(_ST_MODES)}")
            if modes:
                out["pooling_type"] = modes[0]
    return out


def resolve_pooler_config(path: Path | None, user) -> PoolerConfig:
    return PoolerConfig(**{**sentence_transformers_config(path), **parse_pooler_config(user)})


def matryoshka_dimensions(hf_config: dict) -> tuple[bool, list[int] | None]:
    """(whether the model allows ``dimensions``, the only values it allows or None for any <= hidden
    size), from the config fields vLLM reads: ``matryoshka_dimensions`` and ``is_matryoshka``."""
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return True, [int(d) for d in dims]
    return bool(hf_config.get("is_matryoshka")), None


class Pooler:
    """Per-request pooling state across chunks, and the head. Tensors in, float32 vectors out."""

    def __init__(self, config: PoolerConfig):
        self.config = config
        self._state: dict[str, torch.Tensor] = {}  # request id -> MEAN's running sum / CLS's vector

    def add_chunk(self, request_id: str, start: int, hidden: torch.Tensor, last: bool) -> torch.Tensor | None:
        """``hidden``: [n, hidden] final hidden states of positions start..start+n-1 of the prompt;
        ``last``: this chunk ends the prompt. Returns the pooled float32 [hidden] when ``last``."""
        kind = self.config.pooling_type
        if start == 0:
            self._state.pop(request_id, None)
        if kind == "MEAN":
            s = hidden.float().sum(dim=0)
            prev = self._state.get(request_id)
            s = s if prev is None else prev + s
            if not last:
                self._state[request_id] = s
                return None
            self._state.pop(request_id, None)
            return s / (start + hidden.shape[0])
        if kind == "CLS":
            if start == 0:
                self._state[request_id] = hidden[0].float()
            return self._state.pop(request_id) if last else None
        return hidden[-1].float() if last else None  # LAST

    def head(self, pooled: torch.Tensor, dimensions: int | None, normalize: bool | None) -> torch.Tensor:
        if dimensions is not None:
            pooled = pooled[:dimensions]
        if self.config.normalize if normalize is None else normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
