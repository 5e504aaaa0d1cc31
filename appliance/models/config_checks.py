"""Refuse at load what the engine does not implement (rule 8): a config feature that would otherwise
be ignored and give a wrong answer. Every family's config builder calls ``check_config`` with the
facts of its architecture; the error names the config field and its value."""
from __future__ import annotations

import re

from appliance.errors import ModelLoadError
from appliance.layers.rotary import check_rope

# Config keys that attach another modality's encoder. A family that serves such a config text-only
# (its checkpoint's language model alone) says so with ``text_only_multimodal``.
MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_vision_tower", "speech_config",
                   "embd_layer")
# Learned attention sinks (gpt-oss style per-head logits in the softmax) or sink tokens: a key named
# "sink"/"sinks" as a word (attention_sinks, use_sink, learnable_sink_init, num_sink_tokens), not
# "sinkhorn" iterations.
_SINK_KEY = re.compile(r"(^|_)sinks?(_|$)")


def check_config(hf: dict, *, rope: dict, rotary_dim: int, activations: tuple[str, ...] = ("silu",),
                 partial_rotary: bool = False, text_only_multimodal: bool = False,
                 where: str = "config.json") -> None:
    """``hf``: the raw config; ``rope``: its RoPE parameters (``rotary.rope_parameters``) and
    ``rotary_dim`` as the family will build them; ``activations``: the MLP activations the family
    implements; ``partial_rotary``: whether it rotates part of each head; ``text_only_multimodal``:
    whether a multimodal config is served as its text model. Raises ModelLoadError."""
    check_rope(rope, rotary_dim, where)
    prf = rope.get("partial_rotary_factor", 1.0)
    if prf != 1.0 and not partial_rotary:
        raise ModelLoadError(f"{where}: partial_rotary_factor={prf} is not supported for this architecture "
                             "(it rotates whole heads; only 1.0)")
    for key in ("hidden_act", "hidden_activation"):
        act = hf.get(key)
        if act is not None and act not in activations:
            raise ModelLoadError(f"{where}: {key}={act!r} is not supported for this architecture; "
                                 f"supported: {', '.join(activations)}")
    for key in MULTIMODAL_KEYS:
        if hf.get(key) is not None and not text_only_multimodal:
            raise ModelLoadError(f"{where}: {key} is set (a multimodal model); this engine serves "
                                 f"{', '.join(hf.get('architectures') or ['this architecture'])} as text only")
    for key, value in hf.items():
        if _SINK_KEY.search(key) and value is not None and value is not False:  # 0.0 is an initial sink logit
            raise ModelLoadError(f"{where}: {key}={value!r}: attention sinks are not supported")
