"""The model's own sampling defaults (vLLM's ``--generation-config auto``).

A Hugging Face model directory's ``generation_config.json`` (or a GGUF's ``general.sampling.*``
keys, llama.cpp's convention) gives default temperature, top_p, top_k, min_p and
repetition_penalty; a request's explicit value wins over each. ``max_new_tokens`` becomes
``max_tokens``, which (as in vLLM) caps a request's own max_tokens rather than filling only an
unset one. Only these keys are read, as vLLM reads only them; ``do_sample`` is ignored as vLLM
ignores it (a greedy request says temperature=0).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from appliance.errors import ModelLoadError

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key (llama.cpp's recommended sampler parameters) -> SamplingParams field
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_path) -> dict:
    """``{field: value}`` of the defaults the model declares; {} when it declares none."""
    path = Path(model_path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(path)
    if path.is_dir():
        f = path / "generation_config.json"
        if f.is_file():
            return _from_hf(f)
        from appliance.models.gguf_loader import gguf_source

        src = gguf_source(path)  # a directory converted from a GGUF keeps a pointer to it
        if src is not None:
            return _from_gguf(src)
    return {}


def _from_hf(f: Path) -> dict:
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{f}: cannot read the generation config ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    out = {}
    for key, name in _HF_KEYS.items():
        v = cfg.get(key)
        if v is not None:
            out[name] = _checked(f, key, name, v)
    return out


def _from_gguf(path: Path) -> dict:
    from appliance.models.gguf_loader import forget_reader, open_gguf, reader_is_cached

    # Read after the weights are loaded (LLM, the server), when the load has dropped the file's reader:
    # a reader cached from here would keep the whole file mapped, its header's pages and parsed
    # metadata resident for the life of the process (issue 14's resident memory). One cached before
    # (a caller still using it) stays.
    cached = reader_is_cached(path)
    fields = open_gguf(path).fields
    out = {}
    try:
        for key, name in _GGUF_KEYS.items():
            field = fields.get(key)
            if field is not None:
                out[name] = _checked(path, key, name, field.contents())
    finally:
        if not cached:
            forget_reader(path)
    return out


def _checked(src, key: str, name: str, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelLoadError(f"{src}: {key} must be a number, got {v!r}")
    if name in ("top_k", "max_tokens"):
        if float(v) != int(v):
            raise ModelLoadError(f"{src}: {key} must be an integer, got {v!r}")
        return int(v)
    return float(v)


def apply_defaults(explicit: dict, defaults: dict) -> dict:
    """SamplingParams keyword arguments: the request's ``explicit`` values (None = unset) over the
    model's ``defaults``; ``max_tokens`` is the smaller of the two when both are set."""
    out = {k: v for k, v in explicit.items() if v is not None}
    for k in SAMPLING_FIELDS:
        if k in defaults and explicit.get(k) is None:
            out[k] = defaults[k]
    cap = defaults.get("max_tokens")
    if cap is not None and "max_tokens" in explicit:
        mt = explicit["max_tokens"]
        out["max_tokens"] = cap if mt is None else min(mt, cap)
    return out
