"""A real model's function at a larger model's cost: a function-preserving (net2net-style) widening
of a Llama checkpoint, for benchmarks that need a model of a given size whose *behaviour* is real.

Speculative decoding's speed depends on what the model writes (n-gram acceptance on input-grounded
prompts, a draft's agreement with the target), so random weights at a 0.5B shape make acceptance
meaningless; and no trained same-tokenizer 0.5B checkpoint is available offline. This widens the
default model (SmolLM2-135M) to a ~0.5B shape: every weight is a real-size dense float32 tensor that
a decode step streams, so a token costs what a 0.5B model's does, while the logits are SmolLM2-135M's.
Name what it is honestly: "SmolLM2-135M expanded to a 0.5B shape", not a 0.5B model.

Construction (hidden H -> H', heads n -> n' with the same GQA group n/kv = n'/kv', head_dim kept,
intermediate I -> I', layers L -> L'), with the residual stream kept as ``[h, 0]``:

- ``embed_tokens``: the old columns, zeros in the H' - H new ones (so the stream starts as [h, 0]);
  a tied lm_head is the same tensor, and its zero columns meet the stream's zero dims: same logits.
- Every weight that *writes* the stream (``o_proj``, ``down_proj``) has zero rows for the new dims,
  so the stream's new dims stay exactly 0. ``o_proj``'s columns of the new heads and ``down_proj``'s
  columns of the new intermediate units are zero, so the new heads and units add nothing.
- Every weight that *reads* the stream after a norm (q/k/v, gate/up) sees 0 in the new dims, so its
  columns there are free: they hold random values (std 0.02), as are the new heads' q/k/v rows and the
  new units' gate/up rows. Only the blocks above are zeros; the dense float32 GEMMs the engine and
  llama.cpp run stream every byte whatever the values (no sparse or zero-skipping path exists for
  float32 in either), so the zeros cost what any weights cost.
- RMSNorm over [h, 0] divides by sqrt(sum(h^2)/H' + eps') instead of sqrt(sum(h^2)/H + eps). With
  eps' = eps * H/H' and weights scaled by sqrt(H/H'), the norm's output on the old dims is the old
  norm's exactly (in real arithmetic; float32 rounding differs: the sums run over more terms, and
  the scaled weights and eps' are rounded). The new dims of norm weights are free (the stream is 0
  there) and hold ones.
- New heads use new KV heads: with the group size unchanged, old query head j < n still reads KV
  head j // group < kv, which holds the old K/V; rope and head_dim are unchanged.
- New layers (L' > L) are identity residual blocks: random weights except zero o_proj and
  down_proj.

``expand_llama(src_dir, out_dir, ...)`` writes an HF directory (config.json, model.safetensors,
tokenizer files) that the engine and ``gguf_export`` load; ``cached_expanded_default_model()`` writes
the 0.5B-shape expansion of the default model once into ``~/.cache/appliance/bench-models/``.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from appliance.bench.random_models import models_root

# SmolLM2-135M (H 576, 9/3 heads, I 1536, 30 layers, vocab 49152, tied) widened 2x in every width:
# 56.6M embedding + 30 x 14.16M = 481M parameters (0.48B), 1.92 GB in float32.
SHAPE_0_5B = dict(hidden_size=1152, num_attention_heads=18, num_key_value_heads=6, intermediate_size=3072,
                  num_hidden_layers=30)
EXPANDED_0_5B_NAME = "smollm2-135m-expanded-0.5b-shape"


def _check_shape(cfg: dict, new: dict) -> int:
    """The old config's head_dim; raises on shapes the construction cannot preserve."""
    if cfg.get("model_type") != "llama":
        raise ValueError(f"only llama checkpoints are expanded; got model_type {cfg.get('model_type')!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not handled")
    n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // n
    n2, kv2 = new["num_attention_heads"], new["num_key_value_heads"]
    if n2 * kv != n * kv2 or n2 < n or kv2 < kv:
        raise ValueError(f"heads {n}/{kv} -> {n2}/{kv2}: the GQA group size must stay {n // kv}")
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers"):
        if new[k] < cfg[k]:
            raise ValueError(f"{k} {cfg[k]} -> {new[k]}: only widening is function-preserving")
    return hd


def expand_state_dict(sd: dict, cfg: dict, new: dict, seed: int = 0, rescale_norms: bool = True):
    """The widened tensors (float32) and config of a Llama state dict ``sd`` with config ``cfg``;
    ``new`` holds hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
    num_hidden_layers. ``rescale_norms=False`` leaves the RMSNorm weights and eps as they were (not
    function-preserving: the tests' control that the comparison can fail)."""
    import torch

    hd = _check_shape(cfg, new)
    H, H2 = cfg["hidden_size"], new["hidden_size"]
    I, I2 = cfg["intermediate_size"], new["intermediate_size"]
    n, n2 = cfg["num_attention_heads"], new["num_attention_heads"]
    kv, kv2 = cfg["num_key_value_heads"], new["num_key_value_heads"]
    L, L2 = cfg["num_hidden_layers"], new["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02

    def reader(w, rows2):  # (rows, H) -> (rows2, H2): old block kept, the rest random
        out = rand(rows2, H2)
        out[: w.shape[0], :H] = w
        return out

    def writer(w, cols2):  # (H, cols) -> (H2, cols2): old block kept, the rest zero
        out = torch.zeros(H2, cols2, dtype=torch.float32)
        out[:H, : w.shape[1]] = w
        return out

    scale = math.sqrt(H / H2) if rescale_norms else 1.0

    def norm(w):
        out = torch.ones(H2, dtype=torch.float32)
        out[:H] = w * scale
        return out

    g = sd
    out = {}
    emb = g["model.embed_tokens.weight"].float()
    e2 = torch.zeros(emb.shape[0], H2, dtype=torch.float32)
    e2[:, :H] = emb
    out["model.embed_tokens.weight"] = e2
    tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in g
    if not tied:
        head = g["lm_head.weight"].float()
        h2 = rand(head.shape[0], H2)  # reads the final norm's output: free in the new columns
        h2[:, :H] = head
        out["lm_head.weight"] = h2
    out["model.norm.weight"] = norm(g["model.norm.weight"].float())
    for i in range(L2):
        p = q = f"model.layers.{i}."
        if i < L:
            w = {k: g[p + k].float() for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                              "input_layernorm.weight", "post_attention_layernorm.weight")}
            out[q + "self_attn.q_proj.weight"] = reader(w["self_attn.q_proj.weight"], n2 * hd)
            out[q + "self_attn.k_proj.weight"] = reader(w["self_attn.k_proj.weight"], kv2 * hd)
            out[q + "self_attn.v_proj.weight"] = reader(w["self_attn.v_proj.weight"], kv2 * hd)
            out[q + "self_attn.o_proj.weight"] = writer(w["self_attn.o_proj.weight"], n2 * hd)
            out[q + "mlp.gate_proj.weight"] = reader(w["mlp.gate_proj.weight"], I2)
            out[q + "mlp.up_proj.weight"] = reader(w["mlp.up_proj.weight"], I2)
            out[q + "mlp.down_proj.weight"] = writer(w["mlp.down_proj.weight"], I2)
            out[q + "input_layernorm.weight"] = norm(w["input_layernorm.weight"])
            out[q + "post_attention_layernorm.weight"] = norm(w["post_attention_layernorm.weight"])
        else:  # an identity residual block: it reads the stream but writes nothing to it
            out[q + "self_attn.q_proj.weight"] = rand(n2 * hd, H2)
            out[q + "self_attn.k_proj.weight"] = rand(kv2 * hd, H2)
            out[q + "self_attn.v_proj.weight"] = rand(kv2 * hd, H2)
            out[q + "self_attn.o_proj.weight"] = torch.zeros(H2, n2 * hd)
            out[q + "mlp.gate_proj.weight"] = rand(I2, H2)
            out[q + "mlp.up_proj.weight"] = rand(I2, H2)
            out[q + "mlp.down_proj.weight"] = torch.zeros(H2, I2)
            out[q + "input_layernorm.weight"] = torch.ones(H2)
            out[q + "post_attention_layernorm.weight"] = torch.ones(H2)
    cfg2 = dict(cfg)
    cfg2.update(new)
    cfg2["head_dim"] = hd
    if rescale_norms:
        cfg2["rms_norm_eps"] = cfg["rms_norm_eps"] * H / H2
    if cfg2.get("layer_types"):
        cfg2["layer_types"] = (list(cfg2["layer_types"]) + [cfg2["layer_types"][-1]] * L2)[:L2]
    cfg2["torch_dtype"] = "float32"
    cfg2.pop("dtype", None)
    return out, cfg2


def expand_llama(src_dir: str | Path, out_dir: str | Path, new: dict, seed: int = 0,
                 rescale_norms: bool = True) -> Path:
    """Write the widened checkpoint of the HF Llama directory ``src_dir`` to ``out_dir``: config.json,
    model.safetensors (float32) and the source's tokenizer and generation files."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    tensors, cfg2 = expand_state_dict(sd, cfg, new, seed, rescale_norms)
    del sd
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg2["expanded_from"] = {"source": str(src), "hidden_size": cfg["hidden_size"],
                             "num_attention_heads": cfg["num_attention_heads"],
                             "num_key_value_heads": cfg["num_key_value_heads"],
                             "intermediate_size": cfg["intermediate_size"],
                             "num_hidden_layers": cfg["num_hidden_layers"], "seed": seed,
                             "function_preserving": bool(rescale_norms)}
    (out / "config.json").write_text(json.dumps(cfg2, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "generation_config"))
                            or f.suffix == ".jinja"):
            shutil.copy2(f, out / f.name)
    return out


def num_parameters(cfg: dict) -> int:
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    attn = H * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    per_layer = attn + 3 * H * I + 2 * H
    return V * H * (1 if cfg.get("tie_word_embeddings") else 2) + L * per_layer + H


def cached_expanded_default_model(shape: dict | None = None, name: str = EXPANDED_0_5B_NAME) -> Path:
    """The default model (its GGUF's HF-layout conversion, float32: the weights the appliance runs)
    expanded to ``shape`` (default ``SHAPE_0_5B``), written once into ``models_root()/name`` through
    a temp dir and a rename."""
    from appliance.models.default_model import converted_model_dir, default_gguf_path, tokenizer_path

    out = models_root() / name
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = default_gguf_path()
    src = converted_model_dir(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        m = expand_llama(src, tmp / "m", shape or SHAPE_0_5B)
        for f in Path(tokenizer_path(gguf)).iterdir():  # as make_truncated_draft: the target's tokenizer
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja"):
                shutil.copy2(f, m / f.name)
        m.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    p = cached_expanded_default_model()
    c = json.loads((p / "config.json").read_text())
    print(p, f"{num_parameters(c) / 1e6:.1f}M parameters")
