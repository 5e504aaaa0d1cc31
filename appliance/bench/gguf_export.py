"""A Hugging Face model directory -> a GGUF file llama.cpp can serve, holding the same weights.

``appliance bench compare`` runs llama.cpp on a GGUF and vLLM on a safetensors directory; for a
model that exists only as a directory (the random-weight Qwen2.5-0.5B-shape model of
``bench/bench_linear.py``) this writes its GGUF. It is the inverse of
``appliance.models.gguf_loader`` and held against it by ``tests/bench/test_gguf_export.py``:

- tensors renamed to llama.cpp's names (``blk.N.attn_q.weight``...); for the ``llama``
  architecture q_proj/k_proj rows are permuted the way llama.cpp's ``convert_hf_to_gguf.py``
  does (``LlamaModel.permute``: llama.cpp runs llama's rope in interleaved-pair mode), qwen2/qwen3
  are stored as they are (NEOX rope); a tied lm_head is left out (llama.cpp then reuses
  ``token_embd``);
- 2-D weights as F32, F16 or BF16; 1-D tensors (norms, biases) always F32, as llama.cpp wants;
- the metadata llama.cpp reads for llama/qwen2/qwen3 (``{arch}.block_count``, ``.context_length``,
  head counts, rope base, rms eps, ``.attention.key_length`` when head_dim differs);
- the tokenizer from ``tokenizer.json`` as ``tokenizer.ggml.model = gpt2`` (byte-level BPE only):
  tokens in id order padded with ``[PADi]`` (UNUSED) up to the embedding's rows, as
  ``convert_hf_to_gguf.py`` does, token types (added special tokens CONTROL, other added ones
  USER_DEFINED), merges, bos/eos/pad ids, add_bos and the chat template. llama.cpp needs a
  pre-tokenizer name it knows; ``convert_hf_to_gguf.py`` finds it by hashing a test encoding. Here
  it is copied from the embedded default model's GGUF when the vocabulary is that one (SmolLM2's,
  ``smollm``, which the Qwen-shape bench model borrows), else ``default`` (llama.cpp's GPT-2
  regex), or given explicitly.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from appliance.errors import ModelLoadError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
DTYPES = ("float32", "float16", "bfloat16", "q8_0")
# Bump when the written layout changes, so cached files are rewritten.
_EXPORT_VERSION = 1

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 2 and 3 (llama.cpp's converter): four norms per layer, ffn_norm the pre-feed-forward one
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


# Phi-3 (llama.cpp's Phi3MiniModel): the checkpoint's fused tensors as they are
_PHI3_LAYER = {**_LAYER, "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name of an HF tensor; None for buffers llama.cpp does not store (rotary inv_freq)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    layer = {"gemma2": _GEMMA3_LAYER, "gemma3": _GEMMA3_LAYER, "phi3": _PHI3_LAYER}.get(arch, _LAYER)
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in layer:
        return f"blk.{int(parts[2])}.{layer[parts[3]]}"
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise ModelLoadError(f"no GGUF name for tensor {hf_name!r}")


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, the two rotary halves become interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_tensors(model_dir: Path):
    """(name, float32 numpy array) for every tensor of the directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors file")
    for f in files:
        with safe_open(str(f), framework="pt") as st:  # torch reads bf16, numpy cannot
            for name in st.keys():
                yield name, st.get_tensor(name).float().numpy()


def _tokenizer_metadata(model_dir: Path, config: dict, vocab_size: int) -> dict:
    tj_path = model_dir / "tokenizer.json"
    if not tj_path.is_file():
        raise ModelLoadError(f"{model_dir}: no tokenizer.json (a GGUF needs the vocabulary)")
    tj = json.loads(tj_path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelLoadError(f"{tj_path}: only byte-level BPE tokenizers are exported (model type "
                             f"{model.get('type')!r})")
    tokens: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: 1 for i in tokens}  # TokenType.NORMAL
    for added in tj.get("added_tokens", []):
        tokens[int(added["id"])] = added["content"]
        types[int(added["id"])] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    if max(tokens) >= vocab_size:
        raise ModelLoadError(f"{tj_path}: token id {max(tokens)} is past the model's {vocab_size} embedding rows")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}

    def token_id(key: str):
        v = config.get(key, gen.get(key))
        if isinstance(v, list):
            v = v[0] if v else None
        if v is None and isinstance(tcfg.get(key.replace("_id", "")), str):
            v = model["vocab"].get(tcfg[key.replace("_id", "")])
        return None if v is None else int(v)

    template = tcfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    post = tj.get("post_processor") or {}
    single = post.get("single") or [] if post.get("type") == "TemplateProcessing" else []
    add_bos = bool(tcfg.get("add_bos_token", bool(single) and "SpecialToken" in single[0]))
    return {
        "tokens": [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)],
        "types": [types.get(i, 5) for i in range(vocab_size)],  # 5: TokenType.UNUSED
        "merges": merges, "bos": token_id("bos_token_id"), "eos": token_id("eos_token_id"),
        "pad": token_id("pad_token_id"), "add_bos": add_bos, "chat_template": template,
    }


def _default_pre(tokens: list[str]) -> str:
    """The embedded model's pre-tokenizer name when the vocabulary is its own, else ``default``."""
    try:
        from gguf import GGUFReader

        from appliance.models.default_model import default_gguf_path

        reader = GGUFReader(default_gguf_path())
        ref = reader.fields["tokenizer.ggml.tokens"].contents()
        if ref == tokens[: len(ref)] and all(t.startswith("[PAD") for t in tokens[len(ref):]):
            return str(reader.fields["tokenizer.ggml.pre"].contents())
    except (ModelLoadError, OSError, KeyError, ValueError):  # no embedded model, or no pre in it
        pass
    return "default"  # llama.cpp's GPT-2 regex


def write_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "float32",
               pre: str | None = None) -> Path:
    """Write ``model_dir`` (HF config.json + safetensors + tokenizer.json) as a GGUF at ``out_path``.

    ``dtype``: how 2-D weights are stored (float32 | float16 | bfloat16 | q8_0, llama.cpp's 8-bit blocks). ``pre``: llama.cpp's
    pre-tokenizer name (default: see the module docstring). The file is written next to
    ``out_path`` and renamed into place."""
    import gguf

    model_dir, out_path = Path(model_dir), Path(out_path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    arch = ARCHITECTURES.get((config.get("architectures") or [""])[0])
    if arch is None:
        raise ModelLoadError(f"{model_dir}: architecture {config.get('architectures')} is not exported to GGUF; "
                             f"supported: {', '.join(ARCHITECTURES)}")
    rope = config.get("rope_parameters") or {}
    local_rope = None
    if arch == "gemma3" and "full_attention" in rope:  # per layer type (transformers 5)
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    longrope = arch == "phi3" and scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope"
    if (scaling and not longrope) or (local_rope or {}).get("rope_type", "default") != "default":
        raise ModelLoadError(f"{model_dir}: rope scaling is not exported to GGUF (except Phi-3's longrope)")
    hidden, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    tied = bool(config.get("tie_word_embeddings", False))

    qtype = {"float32": gguf.GGMLQuantizationType.F32, "float16": gguf.GGMLQuantizationType.F16,
             "bfloat16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    ftype = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
             "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(model_dir.name)
        w.add_file_type(int(ftype))
        w.add_block_count(int(config["num_hidden_layers"]))
        w.add_context_length(int(config["max_position_embeddings"]))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(int(config["intermediate_size"]))
        w.add_head_count(n_heads)
        w.add_head_count_kv(n_kv)
        rot_dim = int(head_dim * float(config.get("partial_rotary_factor", 1.0)))
        w.add_rope_dimension_count(rot_dim)
        w.add_rope_freq_base(float(rope_theta))
        w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        if head_dim != hidden // n_heads or arch in ("gemma2", "gemma3"):
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch == "gemma3":
            _gemma3_metadata(w, config, local_rope, model_dir)
        elif arch == "gemma2":
            _gemma2_metadata(w, config, model_dir)
        elif arch == "phi3":
            _phi3_metadata(w, config, scaling if longrope else None, rot_dim)

        vocab_rows = None
        for name, t in _load_tensors(model_dir):
            gname = gguf_name(name, arch)
            if gname is None or (tied and gname == "output.weight"):
                continue
            if arch in ("gemma2", "gemma3") and gname.endswith("norm.weight"):
                t = t + np.float32(1.0)  # as llama.cpp's converter: the factor (1 + w) the norm multiplies by
            if gname == "token_embd.weight":
                vocab_rows = t.shape[0]
            if arch == "llama" and gname.endswith((".attn_q.weight", ".attn_k.weight")):
                t = permute_rows(t, n_heads if ".attn_q." in gname else n_kv)
            if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(gname, np.ascontiguousarray(t, dtype=np.float32))
            else:
                w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
        if vocab_rows is None:
            raise ModelLoadError(f"{model_dir}: no model.embed_tokens.weight")
        w.add_vocab_size(vocab_rows)

        tok = _tokenizer_metadata(model_dir, config, vocab_rows)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or _default_pre(tok["tokens"]))
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id)):
            if tok[key] is not None:
                add(tok[key])
        w.add_add_bos_token(tok["add_bos"])
        if tok["chat_template"]:
            w.add_chat_template(tok["chat_template"])

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out_path


def _phi3_metadata(w, config: dict, longrope: dict | None, rot_dim: int) -> None:
    """What llama.cpp's converter writes for Phi-3: the window, and for longrope the original context,
    the attention factor (transformers' default when the config has none) and the two factor tensors."""
    import math

    if config.get("sliding_window"):
        w.add_sliding_window(int(config["sliding_window"]))
    if longrope is None:
        return
    original = int(config.get("original_max_position_embeddings")
                   or longrope.get("original_max_position_embeddings"))
    scale = int(config["max_position_embeddings"]) / original
    attn = longrope.get("attention_factor")
    if attn is None:
        attn = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(float(attn))
    for key in ("long_factor", "short_factor"):
        f = np.asarray(longrope[key], dtype=np.float32)
        if f.shape != (rot_dim // 2,):
            raise ModelLoadError(f"longrope {key} has {f.shape[0]} entries, expected {rot_dim // 2}")
        w.add_tensor(f"rope_factors_{key.split('_')[0]}.weight", f)


def _gemma2_metadata(w, config: dict, model_dir: Path) -> None:
    """What llama.cpp reads for Gemma 2 beyond the common keys: the window and both soft-caps. llama.cpp
    fixes the layer pattern (even layers local) and the softmax scale (1/sqrt(head_dim), or
    1/sqrt(hidden / heads) at 46 layers): a model with others is refused."""
    n_layers, head_dim = int(config["num_hidden_layers"]), int(config["head_dim"])
    scalar = head_dim if n_layers != 46 else int(config["hidden_size"]) // int(config["num_attention_heads"])
    if float(config.get("query_pre_attn_scalar", 256)) != scalar:
        raise ModelLoadError(f"{model_dir}: query_pre_attn_scalar={config.get('query_pre_attn_scalar')} is not the "
                             f"{scalar} llama.cpp assumes for {n_layers} layers; not exported to GGUF")
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(n_layers)]
    if types != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]:
        raise ModelLoadError(f"{model_dir}: layer_types {types} are not Gemma 2's alternation llama.cpp assumes")
    w.add_sliding_window(int(config.get("sliding_window") or 4096))
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if config.get(key) is None:  # llama.cpp would apply its default cap; the model has none
            raise ModelLoadError(f"{model_dir}: {key}=None cannot be written for llama.cpp's Gemma 2")
        add(float(config[key]))


def _gemma3_metadata(w, config: dict, local_rope: dict | None, model_dir: Path) -> None:
    """What llama.cpp reads for Gemma 3 beyond the common keys: the window, the local layers' rope base,
    the final soft-cap. The per-layer local/global array is written when the layer types are not the
    pattern llama.cpp assumes otherwise (every 6th layer global). llama.cpp takes the softmax scale as
    1/sqrt(head_dim) (the file has no query_pre_attn_scalar): a model with another one is refused."""
    n_layers, head_dim = int(config["num_hidden_layers"]), int(config["head_dim"])
    if float(config.get("query_pre_attn_scalar", head_dim)) != head_dim or n_layers == 62:
        raise ModelLoadError(f"{model_dir}: query_pre_attn_scalar={config.get('query_pre_attn_scalar')} is not the "
                             f"head_dim={head_dim} llama.cpp assumes; not exported to GGUF")
    if config.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{model_dir}: attn_logit_softcapping is not part of Gemma 3 in llama.cpp")
    types = config.get("layer_types") or []
    local = [t == "sliding_attention" for t in types]
    if any(local):
        w.add_sliding_window(int(config["sliding_window"]))
        if local != [i % 6 < 5 for i in range(n_layers)]:
            w.add_sliding_window_pattern(local)
    theta = (local_rope or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    w.add_rope_freq_base_swa(float(theta))
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def cached_gguf(model_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """``write_gguf`` into the appliance cache, keyed by the directory's files (name, size, mtime)."""
    from appliance.config import cache_dir

    model_dir = Path(model_dir).expanduser().absolute()
    stamp = [f"{_EXPORT_VERSION}", str(model_dir), dtype]
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            stamp.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]
    out = cache_dir() / "bench-gguf" / f"{model_dir.name}-{dtype}-{key}.gguf"
    return out if out.is_file() else write_gguf(model_dir, out, dtype)
