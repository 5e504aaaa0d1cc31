"""Random-weight models at real shapes for the benchmarks: a transformers config class and its
dimensions in, a model directory out (safetensors, float32, transformers' own init), with the default
model's tokenizer copied in (benchmarks feed token ids, so any tokenizer will do). Performance work may
use random weights at real shapes; correctness tests build their tiny models in tests/tiny_models.py.
"""
from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path


def models_root() -> Path:
    """Where benchmark models are cached between runs (they take minutes to write at 1B)."""
    return Path.home() / ".cache" / "appliance" / "bench-models"


# families whose class names do not follow <family>Config / <family>ForCausalLM
_CLASSES = {"Gemma3Text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}


def write_random_model(path: Path, family: str, config: dict, seed: int = 0) -> Path:
    """Write ``transformers.<family>ForCausalLM(<family>Config(**config))`` with seed ``seed`` to
    ``path`` (which must not exist yet). transformers initialises linear weights with std
    ``initializer_range`` (0.02), like a trained checkpoint's scale; a different std would make the
    quantized formats' numbers meaningless, so it is checked."""
    import torch
    import transformers as tf

    from appliance.models.default_model import resolve_model

    torch.manual_seed(seed)
    cfg_cls, model_cls = _CLASSES.get(family, (f"{family}Config", f"{family}ForCausalLM"))
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**config)).to(torch.float32)
    some = next(p for n, p in model.named_parameters() if n.endswith("down_proj.weight") or "experts" in n)
    std = some.float().std().item()
    if not 0.01 < std < 0.04:
        raise RuntimeError(f"transformers' init gave std {std:.4f}, not ~0.02 (initializer_range)")
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    gc.collect()
    src = Path(resolve_model(None))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy2(f, path / f.name)
    return path


def cached_random_model(name: str, family: str, config: dict, seed: int = 0) -> Path:
    """``write_random_model`` into ``models_root()/name``, written once (through a temp dir and a
    rename, so an interrupted write never leaves a half model behind)."""
    out = models_root() / name
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        write_random_model(tmp / "m", family, config, seed)
        (tmp / "m").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
