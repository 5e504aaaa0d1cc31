"""GGUF files: read straight from the file by the weight-loading loop (``GGUFSource``), or
converted into a Hugging Face directory (``convert_gguf_to_hf``: for tools and tests that want one;
the engine never writes it).

The HF config is built in memory from the metadata (``gguf_configs``), and the tokenizer from the
vocabulary, special tokens and chat template it holds (``tokenizer_dir``, cached on disk because
building it takes seconds). Tensors are renamed to HF names. For the ``llama`` architecture
llama.cpp's convert script permutes the rows of q_proj/k_proj (it stores rotary pairs interleaved,
HF stores them as two halves); we undo that exactly as transformers' own GGUF loader does
(``LlamaTensorProcessor._reverse_permute_weights``). qwen2/qwen3/gemma3 are stored unpermuted (llama.cpp
runs them in NEOX rope mode). llama.cpp's converter stores Gemma 3's RMSNorm weights as ``1 + w`` (the
factor the norm multiplies by): they reach the model as that stored factor (``ShiftedWeight``), exactly.

Mixture of experts (qwen2moe, qwen3moe, and llama with an expert_count: Mixtral): each 3-D
``ffn_{gate,up,down}_exps`` tensor is read one expert at a time (``_ExpertSlice``, a slice of the
memmap) under the per-expert HF name, so an expert's quantized blocks are kept like any projection's.

Which tensors stay quantized (``kept_types``): with ``--quantization w4a8`` at group size 32 the W4
group-32 block types (Q4_0, Q4_1, Q4_K), with ``w8a8`` the W8 ones (Q5_0/1, Q5_K, Q8_0, Q6_K, ...)
when ``w8a8_native`` (the only method for W8 groups) runs here; each decoded from its raw blocks into
the canonical form by ``appliance.models.gguf_quants`` (the mapping of each type, exact or within an
fp32 rounding of the zero point), never through a float matrix. Every other tensor (F32, F16, BF16,
other types, embeddings and norms) is dequantized with ``gguf.quants.dequantize``. A directory
converted earlier records its source (``gguf_source.json``: path, size, mtime) and loads the same
way, its float tensors read from the directory.

The converted directory is written into a temp dir next to it and renamed into place, so a crashed
conversion never leaves a half-written model directory behind.
"""
from __future__ import annotations

import dataclasses

import functools
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import warnings
from pathlib import Path

import numpy as np

from appliance.errors import ModelLoadError
from appliance.models import gguf_quants

log = logging.getLogger("appliance")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3")
# mixture-of-experts architectures (their ffn_*_exps tensors load one expert at a time, see _tensor_plan);
# llama with an expert_count is Mixtral
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "llama")
GGUF_MAGIC = b"GGUF"
SOURCE_RECORD = "gguf_source.json"  # in a converted directory: the GGUF it came from
# GGUF types whose blocks are W4 groups of GGUF_BLOCK weights as they are (see the module docstring)
GGUF_BLOCK = 32

# GGUF architecture (after the mistral-as-llama patch) -> (HF model_type, HF architecture).
_HF_ARCH = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Suffix of "blk.N.<suffix>" -> suffix of "model.layers.N.<suffix>".
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router, Qwen2-MoE's shared expert and its sigmoid gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# 3-D expert tensors (GGUF ne [k, n, experts]): expert e's slice is "model.layers.N.mlp.experts.e.<proj>"
_EXPERT_TENSORS = {
    "ffn_gate_exps.weight": "gate_proj.weight",
    "ffn_up_exps.weight": "up_proj.weight",
    "ffn_down_exps.weight": "down_proj.weight",
}
# Gemma 2's and 3's four norms per layer: llama.cpp's ffn_norm is the pre-feed-forward norm there.
_GEMMA_LAYER_TENSORS = {**_LAYER_TENSORS, "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3 stores the checkpoint's fused tensors: attn_qkv, and ffn_up holding [gate; up] (2 x ffn rows)
_LAYER_TENSORS_OF = {"gemma2": _GEMMA_LAYER_TENSORS, "gemma3": _GEMMA_LAYER_TENSORS,
                     "phi3": {**_LAYER_TENSORS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                              "ffn_up.weight": "mlp.gate_up_proj.weight"}}
# Global tensors folded into the config instead of loaded (the rope factors)
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# GGUF architecture -> what llama.cpp's converter added to every "*norm.weight" (Gemma: 1 + w)
_NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert ``gguf_path`` into a Hugging Face model directory at ``out_dir``; returns it.

    An existing ``out_dir`` is replaced only once the new directory is complete.
    Raises ``ModelLoadError`` (naming the file) for a missing, non-GGUF, truncated or
    corrupt file, or an unsupported architecture.
    """
    gguf_path = Path(gguf_path).expanduser().absolute()
    out_dir = Path(out_dir).expanduser().absolute()
    reader = open_gguf(gguf_path)
    meta = _read_metadata(reader, gguf_path)
    config, generation_config = _build_configs(reader, meta, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config)
        st = gguf_path.stat()
        _write_json(tmp / SOURCE_RECORD, {"path": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        _write_safetensors(tmp / "model.safetensors", _hf_tensors(reader, meta, config, gguf_path))
        _write_tokenizer(tmp, gguf_path, meta, config)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def open_gguf(path: Path):
    """Open ``path`` with ``gguf.GGUFReader`` after checking it exists, is GGUF and is whole. The
    reader (its header parsed, its tensors memmaps) is reused while the file keeps its size and mtime:
    parsing a large vocabulary's metadata takes seconds, and a load opens the file more than once."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or not path.is_file():
        return _open_gguf(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if _READERS.get("key") != key:
        _READERS.clear()
        _READERS.update(key=key, reader=_open_gguf(path))
    return _READERS["reader"]


_READERS: dict = {}  # the last file opened: {"key": (path, size, mtime_ns), "reader": GGUFReader}


def reader_is_cached(path: Path) -> bool:
    """Whether ``open_gguf`` holds a reader of ``path`` now."""
    return _READERS.get("key", ("",))[0] == str(Path(path))


def forget_reader(path: Path) -> None:
    """Drop the cached reader of ``path`` (its memmap is unmapped once nothing else holds it)."""
    if reader_is_cached(path):
        _READERS.clear()


def _open_gguf(path: Path):
    if not path.exists():
        raise ModelLoadError(f"{path}: GGUF file does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file (expected a .gguf file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _lean_reader()(path)
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError/struct.error...
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


# Arrays longer than this (the vocabulary: tokens, scores, token types, merges) are skipped by the
# lean reader; no other metadata array comes near it (llama.cpp's longest are per-layer, ~100).
_LEAN_ARRAY_LIMIT = 4096


@functools.cache
def _lean_reader():
    """``gguf.GGUFReader`` that steps over the long metadata arrays instead of parsing them. The
    vocabulary arrays (151936 tokens and ~150k merges for Qwen2.5) are what takes GGUFReader its
    seconds: one numpy view, list entry and index per element. The engine never reads them through
    this reader (``_read_metadata`` leaves them out; the tokenizer is built by transformers from the
    file, once, and cached); such a field's ``contents()`` raises rather than return nothing."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class SkippedArray(ReaderField):
        def contents(self, index_or_slice=slice(None)):
            raise ValueError(f"GGUF metadata array {self.name!r} is not parsed by the appliance's reader "
                             f"(over {_LEAN_ARRAY_LIMIT} elements); read it with gguf.GGUFReader")

    class LeanReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            n, itype = int(alen[0]), GGUFValueType(raw_itype[0])
            if n <= _LEAN_ARRAY_LIMIT:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs + 12
            if itype == GGUFValueType.STRING:  # step over n (u64 length, bytes) records
                buf, fmt = memoryview(self.data), ">Q" if self.byte_order == "S" else "<Q"
                for _ in range(n):
                    offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
            elif itype in self.gguf_scalar_to_np:
                offs += n * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
            else:
                raise ValueError(f"GGUF metadata array of {itype.name} with {n} elements")
            self._skipped = True
            return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

        def _push_field(self, field, skip_sum=False):
            if getattr(self, "_skipped", False):
                self._skipped = False
                field = SkippedArray(*field)
            return super()._push_field(field, skip_sum)

    return LeanReader


def _read_metadata(reader, path: Path) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays; only the tokenizer step needs them, through transformers
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise ModelLoadError(f"{path}: corrupt GGUF metadata field {key!r} ({e})") from e
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF file has no general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if _is_moe(meta) and arch not in MOE_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: mixture-of-experts GGUF ({arch}.expert_count={meta[f'{arch}.expert_count']}) is not supported")
    return meta


def _f32(value: float) -> float:
    """GGUF stores float32; recover the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _build_configs(reader, meta: dict, path: Path) -> tuple[dict, dict]:
    arch = meta["general.architecture"]

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden_size = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
    # Phi-3 rotates part of each head (rope.dimension_count < head_dim); llama.cpp's head size
    # defaults to hidden / heads when key_length is absent
    rope_key = f"{arch}.rope.dimension_count" if arch != "phi3" else "-"
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0) or meta.get(rope_key, 0) or hidden_size // num_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":  # Phi-4-mini rotates 3/4 of each head, as its HF config says
        raise ModelLoadError(f"{path}: partial rotary (rope.dimension_count={rope_dim} != head_dim={head_dim}) "
                             "is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are [ne0=hidden, ne1=vocab]
    rope_theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))

    name = str(meta.get("general.name", ""))
    # llama.cpp stores Mistral as "llama"; transformers' GGUF loader does the same name check.
    hf_arch = "mistral" if arch == "llama" and "mistral" in name.lower() else arch
    # llama.cpp runs a window when the file records one; transformers' Llama would ignore it, so such
    # a "llama" file is served as Mistral (same tensors, every layer windowed)
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None:
        window = int(window)
        if window < 1:
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window must be >= 1, got {window}")
        if hf_arch == "llama":
            hf_arch = "mistral"
    if arch == "llama" and _is_moe(meta):
        hf_arch = "mixtral"
    model_type, architecture = _HF_ARCH[hf_arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    if _is_moe(meta):
        config.update(_moe_config(meta, arch, tensors, config, path))
    if window is not None:
        config["sliding_window"] = window  # on every layer
        if hf_arch in ("qwen2", "qwen3"):  # their configs switch it on, from layer max_window_layers
            config.update(use_sliding_window=True, max_window_layers=0)
    elif hf_arch in ("mistral", "mixtral"):
        config["sliding_window"] = None  # the file records none; llama.cpp runs full attention
    rope_scaling = _rope_scaling(meta, arch)
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise ModelLoadError(f"{path}: both rope.scaling metadata and a rope_freqs tensor")
        from gguf.quants import dequantize
        t = tensors["rope_freqs.weight"]
        rope_scaling = llama3_rope_scaling(dequantize(t.data, t.tensor_type).reshape(-1), rope_theta, head_dim, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "phi3":
        _phi3_config(meta, tensors, config, rope_dim, path)
    if arch == "gemma3":
        _gemma3_config(meta, config, path)
    elif arch == "gemma2":
        _gemma2_config(meta, config)

    generation_config = {}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in config:
            generation_config[key] = config[key]
    # Chat models end turns with eot/eom (llama-3's <|eot_id|>): llama.cpp stops on all of them.
    stop_ids = [config.get("eos_token_id")] + [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    stop_ids = list(dict.fromkeys(int(i) for i in stop_ids if i is not None))
    if len(stop_ids) > 1:
        generation_config["eos_token_id"] = stop_ids
    return config, generation_config


def _is_moe(meta: dict) -> bool:
    return bool(meta.get(f"{meta['general.architecture']}.expert_count", 0))


def _moe_config(meta: dict, arch: str, tensors: dict, config: dict, path: Path) -> dict:
    """The HF config fields of a qwen2moe / qwen3moe / llama-MoE (Mixtral) file. As llama.cpp runs
    them: softmax gating, top-k weights renormalized for qwen3moe and llama (Mixtral) and not for
    qwen2moe (its build_moe_ffn's norm_w), no weight scale; a Qwen layer without a router
    (ffn_gate_inp) is a dense MLP (``mlp_only_layers``), a Mixtral one is refused."""
    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return int(meta[f"{arch}.{key}"])

    scale = meta.get(f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 0.0, 1, 1.0):
        raise ModelLoadError(f"{path}: {arch}.expert_weights_scale={scale} is not supported (supported: 1)")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{path}: {arch}.expert_gating_func={gating} is not supported (supported: 1, softmax)")
    n_layers = config["num_hidden_layers"]
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if arch == "llama":  # Mixtral: every layer sparse, experts as wide as feed_forward_length
        if dense:
            raise ModelLoadError(f"{path}: llama mixture-of-experts layer {dense[0]} has no ffn_gate_inp (router); "
                                 "every Mixtral layer is sparse")
        return {"num_local_experts": need("expert_count"), "num_experts_per_tok": need("expert_used_count"),
                "sliding_window": None}
    out = {
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "norm_topk_prob": arch == "qwen3moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = need("expert_shared_feed_forward_length")
        out["qkv_bias"] = config["attention_bias"]
        out["attention_bias"] = False
    return out


class _ExpertSlice:
    """One expert's [n, k] slice of a 3-D GGUF expert tensor, read like a GGUF tensor (``name``,
    ``tensor_type``, ``data``: the slice of the memmap, its quantized blocks as they are)."""

    def __init__(self, t, e: int):
        self.name, self.tensor_type, self.data = f"{t.name}[{e}]", t.tensor_type, t.data[e]


def _gemma3_config(meta: dict, config: dict, path: Path) -> None:
    """The Gemma 3 fields of ``config``, as llama.cpp reads the file (src/models/gemma3.cpp): local layers
    only with ``attention.sliding_window``, chosen by ``attention.sliding_window_pattern`` (a per-layer
    array, or a period n whose last layer is global; 6 when absent); ``rope.freq_base`` and the rope
    scaling for global layers, ``rope.freq_base_swa`` (10000 when absent) unscaled for local ones; the
    softmax scale 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer (27B) model, since the
    file does not record query_pre_attn_scalar."""
    a, n_layers = "gemma3", config["num_hidden_layers"]
    window = int(meta.get(f"{a}.attention.sliding_window", 0) or 0)
    pattern = meta.get(f"{a}.attention.sliding_window_pattern", 6)
    if window <= 0:
        local = [False] * n_layers
    elif isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelLoadError(f"{path}: {a}.attention.sliding_window_pattern has {len(pattern)} entries for "
                                 f"{n_layers} layers")
        local = [bool(x) for x in pattern]
    else:
        n = int(pattern)
        local = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    config.pop("hidden_act")
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
    config["sliding_window"] = window if any(local) else None
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    full.update(config.pop("rope_scaling", None) or {})
    local_theta = _f32(meta.get(f"{a}.rope.freq_base_swa", 10000.0))
    config["rope_parameters"] = {"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if n_layers == 62
                                       else config["head_dim"])
    cap = meta.get(f"{a}.final_logit_softcapping")
    config["final_logit_softcapping"] = _f32(cap) if cap else None
    config["attn_logit_softcapping"] = None


def _phi3_config(meta: dict, tensors: dict, config: dict, rope_dim: int, path: Path) -> None:
    """The Phi-3 fields of ``config``: the rotated share of each head (Phi-4-mini: 0.75), and longrope
    from llama.cpp's ``rope_factors_long`` / ``rope_factors_short`` tensors with the file's original
    context and attention factor. llama.cpp switches to the long factors when its context passes the
    original one, as the engine does from max_model_len. A window in the file is applied on every
    layer as the HF checkpoint's config does (llama.cpp currently disables Phi's window)."""
    from gguf.quants import dequantize

    a = "phi3"
    if rope_dim != config["head_dim"]:
        config["partial_rotary_factor"] = rope_dim / config["head_dim"]
    have = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if not have:
        return
    if len(have) != 2:
        raise ModelLoadError(f"{path}: {have[0]} without its pair; longrope needs both factor tensors")
    factors = {}
    for n in have:
        t = tensors[n]
        v = dequantize(t.data, t.tensor_type).reshape(-1)
        if v.shape[0] != rope_dim // 2:
            raise ModelLoadError(f"{path}: {n} has {v.shape[0]} factors, expected rope.dimension_count / 2 = "
                                 f"{rope_dim // 2}")
        factors[n] = [_f32(x) for x in v]
    original = meta.get(f"{a}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"{path}: longrope factors without {a}.rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
               "short_factor": factors["rope_factors_short.weight"],
               "original_max_position_embeddings": int(original)}
    attn = meta.get(f"{a}.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = _f32(attn)
    config["rope_scaling"] = scaling
    config["original_max_position_embeddings"] = int(original)


def _gemma2_config(meta: dict, config: dict) -> None:
    """The Gemma 2 fields of ``config``, as llama.cpp reads the file (src/models/gemma2.cpp and its
    hparams): every other layer local, starting with layer 0 (pattern 2), with ``attention.sliding_window``
    (4096 when absent); both soft-caps from the file, 50 and 30 when absent; one rope base for all
    layers; the softmax scale 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 46-layer (27B)
    model, since the file does not record query_pre_attn_scalar."""
    a, n_layers = "gemma2", config["num_hidden_layers"]
    config.pop("hidden_act")
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["sliding_window"] = int(meta.get(f"{a}.attention.sliding_window", 0) or 4096)
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    config["attn_logit_softcapping"] = _f32(meta.get(f"{a}.attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = _f32(meta.get(f"{a}.final_logit_softcapping", 30.0))
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if n_layers == 46
                                       else config["head_dim"])


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # old files: only rope.scale_linear
    if kind in (None, "none") or factor is None or _f32(factor) == 1.0:
        return None
    scaling = {"rope_type": str(kind), "factor": _f32(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_rope_scaling(freq_factors: np.ndarray, rope_theta: float, head_dim: int, path: Path | str) -> dict | None:
    """Recover HF's ``rope_type: llama3`` parameters from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp's convert script stores, per rotary pair, the factor the base frequency is
    divided by: 1 for short wavelengths, ``factor`` for long ones, and in between
    ``1 / ((1 - s) / factor + s)`` with ``s = L / wavelen / (h - l) - l / (h - l)``.
    ``s`` is linear in 1/wavelen, so two points give its slope and intercept; any
    ``low_freq_factor`` then reproduces the same frequencies, and we pick 1.0. The fit is
    checked against every factor so an unexpected tensor is an error, never silent drift.
    """
    rf = np.asarray(freq_factors, dtype=np.float64)
    if np.allclose(rf, 1.0):
        return None
    factor = float(rf.max())
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (rf > 1 + 1e-4) & (rf < factor * (1 - 1e-4))
    if rf.shape != wavelen.shape or mid.sum() < 2:
        raise ModelLoadError(f"{path}: rope_freqs tensor does not match llama3 rope scaling")
    smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
    a, neg_b = np.polyfit(1 / wavelen[mid], smooth, 1)
    b = -neg_b
    scaling = {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": 1.0,
               "high_freq_factor": round(1 + 1 / b, 4), "original_max_position_embeddings": int(round(a / b))}
    if not np.allclose(llama3_freq_factors(scaling, rope_theta, head_dim), rf, rtol=1e-3):
        raise ModelLoadError(f"{path}: rope_freqs tensor does not match llama3 rope scaling")
    return scaling


def llama3_freq_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 ``rope_scaling`` (convert_hf_to_gguf.py, LlamaModel)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _tensor_plan(reader, meta: dict, config: dict, path: Path):
    """(GGUF tensor, HF name, HF shape, heads whose q/k rows to un-permute or None) per weight."""
    arch = meta["general.architecture"]
    layer_tensors = _LAYER_TENSORS_OF.get(arch, _LAYER_TENSORS)
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue  # folded into config["rope_scaling"]
        parts = t.name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _EXPERT_TENSORS and _is_moe(meta):
            shape = tuple(int(d) for d in reversed(t.shape))  # [experts, n, k]
            if len(shape) != 3:
                raise ModelLoadError(f"{path}: tensor {t.name!r} has shape {shape}, expected 3-D [experts, n, k]")
            for e in range(shape[0]):
                yield (_ExpertSlice(t, e), f"model.layers.{int(parts[1])}.mlp.experts.{e}.{_EXPERT_TENSORS[parts[2]]}",
                       shape[1:], None)
            continue
        if t.name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in layer_tensors:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
            hf_name = f"model.layers.{int(parts[1])}.{layer_tensors[parts[2]]}"
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (the fastest dim) first
        if hf_name.endswith(".shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp stores the [1, hidden] gate as a vector
        n_heads = None
        if arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n_heads = config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
        yield t, hf_name, shape, n_heads


def _hf_tensors(reader, meta: dict, config: dict, path: Path):
    """Yields (hf_name, hf_shape, loader) for each weight; loader() returns float32 numpy."""
    from gguf.quants import dequantize

    out = []
    shift = _NORM_SHIFT.get(meta["general.architecture"], 0.0)
    for t, hf_name, shape, n_heads in _tensor_plan(reader, meta, config, path):
        def load(t=t, shape=shape, n_heads=n_heads, hf_name=hf_name):
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if shift and hf_name.endswith("norm.weight"):  # HF's form, w; the stored 1 + w rounds back within an ulp
                w = w - np.float32(shift)
            return w if n_heads is None else _unpermute_rows(w, n_heads)

        out.append((hf_name, shape, load))
    return out


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file ``model_dir`` was converted from, if it recorded one and that file is still the
    one it was converted from (same size and mtime); else None."""
    record = Path(model_dir) / SOURCE_RECORD
    if not record.is_file():
        return None
    try:
        src = json.loads(record.read_text())
        path = Path(src["path"])
        st = path.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if (st.st_size, st.st_mtime_ns) == (src["size"], src["mtime_ns"]) else None


def gguf_configs(path: Path) -> tuple[dict, dict]:
    """(HF config.json, generation_config.json) of the GGUF ``path``, built in memory from its metadata."""
    path = Path(path).expanduser().absolute()
    reader = open_gguf(path)
    return _build_configs(reader, _read_metadata(reader, path), path)


def kept_types(quantization: str, group_size: int, linear_backend: str = "auto", path: Path | str = "") -> tuple:
    """The GGUF types whose projections load as they are, quantized, under these arguments; every other
    tensor is dequantized to float (and quantized after loading if ``quantization`` asks).

    - ``none``: none (the model runs float, as the dequantized file);
    - ``gguf``: every kept type, each in its own scheme (W4 group 32; W8 groups when ``w8a8_native``
      runs here): a Q4_K_M file keeps its Q4_K layers as W4 and its Q6_K ones as W8 group 16;
    - ``w4a8`` at ``group_size`` 32 (the default, the GGUF block size): the W4 group-32 types;
    - ``w8a8``: the W8 types, when a method that takes W8 groups of 32 (only ``w8a8_native``) can run
      here and ``linear_backend`` does not force a per-channel one (``w8a8_onednn``, ``w8a16_int8pack``).
    """
    from appliance.layers import quant

    kept = gguf_quants.KEPT.values()
    if quantization == "gguf":
        return kept_types("w4a8", GGUF_BLOCK, linear_backend, path) + kept_types("w8a8", group_size, linear_backend, path)
    if quantization == "w8a8":
        # a forced W8 method that takes no groups (w8a8_onednn, w8a16_int8pack)
        if linear_backend in quant.BACKENDS["w8a8"] and not quant.backend_valid(linear_backend, "w8a8", 256, 256, 32):
            log.info("%s: linear_backend=%s takes per-channel W8 only, not a GGUF's groups; quantizing the "
                     "dequantized weights", path, linear_backend)
            return ()
        # only the native W8A8 method takes W8 groups (of 32 or 16, with or without zero point)
        types = tuple(bt.name for bt in kept if bt.scheme == "w8a8"
                      and quant.backend_valid("w8a8_native", "w8a8", 256, 256, bt.group))
        if not types:
            log.info("%s: the native kernels, the only W8 method for a GGUF's groups, are unavailable; "
                     "quantizing the dequantized weights", path)
        return types
    if quantization == "w4a8":
        types = tuple(bt.name for bt in kept if bt.scheme == "w4a8" and bt.group == group_size)
        if not types:
            log.info("%s: GGUF W4 blocks are groups of %d, quant_group_size is %d; quantizing the dequantized "
                     "weights", path, GGUF_BLOCK, group_size)
        return types
    return ()


class GGUFSource:
    """The tensors of a GGUF file, read from the file by mmap (``GGUFReader``'s tensor data are numpy
    memmaps), in HF names and row order (llama's q/k rows un-permuted). A projection of a type in
    ``keep`` that the model holds quantized is a ``QuantizedWeight`` decoded from its raw blocks (never a
    float matrix); every other tensor is dequantized to float32 (``gguf.quants.dequantize``).

    ``float_from``: a source for the float tensors instead (a directory converted from this GGUF by
    ``convert_gguf_to_hf``, whose ``gguf_source.json`` names the file)."""

    prequantized = False  # its float tensors are quantized when --quantization asks

    def __init__(self, path: Path, keep: tuple = (), hf_config: dict | None = None, float_from=None):
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.meta = _read_metadata(self.reader, self.path)
        config, _ = _build_configs(self.reader, self.meta, self.path)
        self.hf_config = hf_config or config
        self.plan = list(_tensor_plan(self.reader, self.meta, config, self.path))
        self.keep, self.float_from = tuple(keep), float_from
        self.norm_shift = _NORM_SHIFT.get(self.meta["general.architecture"], 0.0)
        self._types = {hf: t.tensor_type.name for t, hf, _, _ in self.plan}  # kept past close()

    def stored_format(self, hf_name: str) -> str | None:
        """The GGUF type tensor ``hf_name`` is stored as (Q4_K, Q6_K, F16, ...)."""
        return self._types.get(hf_name)

    def close(self) -> None:
        """Drop the reader once the weights are loaded: its memmap's pages (the file read once over)
        would otherwise stay resident for the life of the process, and its parsed metadata with them."""
        self.reader, self.plan = None, []
        forget_reader(self.path)

    def _kept(self, t, hf_name: str, shape) -> bool:
        # projections, the embedding table (QuantEmbedding; a tied lm_head shares it) and an untied lm_head
        return (t.tensor_type.name in self.keep and len(shape) == 2
                and (hf_name.endswith("_proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")))

    def quantized_layers(self) -> dict[str, tuple[str, int]]:
        out = {}
        for t, hf, shape, _ in self.plan:
            if self._kept(t, hf, shape):
                bt = gguf_quants.kept(t.tensor_type.name)
                out[hf] = (bt.scheme, bt.group)
        return out

    def weights(self, wants_quantized=lambda name: False):
        import torch

        from appliance.layers.weight_loading import QuantizedWeight, ShiftedWeight

        quantized = {hf for t, hf, shape, _ in self.plan if self._kept(t, hf, shape) and wants_quantized(hf)}
        if self.float_from is not None:  # the float copies of quantized layers are never read
            yield from self.float_from.weights(skip=lambda name: name in quantized)
        for t, hf, shape, n_heads in self.plan:
            qtype = t.tensor_type.name
            if hf in quantized:
                w = gguf_quants.canonical(qtype, t.data, *shape, where=f"{self.path}: tensor {t.name!r}")
                q, scale, zp = (None if p is None else p if n_heads is None else
                                torch.from_numpy(np.ascontiguousarray(_unpermute_rows(p.numpy(), n_heads)))
                                for p in (w.qweight, w.scale, w.zero_point))
                kq = w.kquant
                if kq is not None and n_heads is not None:  # its row tables follow the rows
                    kq = dataclasses.replace(kq, **{f: None if getattr(kq, f) is None else torch.from_numpy(
                        np.ascontiguousarray(_unpermute_rows(getattr(kq, f).numpy(), n_heads)))
                        for f in ("sub", "submin", "sup", "supmin")})
                yield self.path, hf, QuantizedWeight(q, scale, zp, w.group, w.scheme, kq)
            elif self.float_from is None:
                w = self._float(t, shape, n_heads)
                with warnings.catch_warnings():  # an F32 tensor is the read-only memmap itself: only read
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.from_numpy(w)
                if self.norm_shift and hf.endswith("norm.weight"):
                    tensor = ShiftedWeight(tensor, self.norm_shift)
                yield self.path, hf, tensor

    def _float(self, t, shape, n_heads) -> np.ndarray:
        from gguf import quants

        try:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: tensor {t.name!r} of GGUF type {t.tensor_type.name} cannot be "
                                 f"read ({type(e).__name__}: {e})") from e
        return np.ascontiguousarray(w if n_heads is None else _unpermute_rows(w, n_heads))


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    # Inverse of llama.cpp's permute(): per head, rows were interleaved (pair i -> rows 2i, 2i+1);
    # HF wants the two halves of each head contiguous.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_safetensors(path: Path, tensors) -> None:
    """Streams float32 tensors into a safetensors file, one tensor in memory at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, load in tensors:
            np.ascontiguousarray(load(), dtype="<f4").tofile(f)


def tokenizer_dir(gguf_path: Path, cache_root: Path) -> Path:
    """A directory holding the tokenizer of ``gguf_path`` (vocabulary, merges, special tokens and chat
    template from its metadata), built once and cached under ``cache_root`` keyed by the file's name,
    size and mtime: transformers takes seconds to tens of seconds to build a fast tokenizer from a
    GGUF vocabulary, so it is kept on disk; the weights never are."""
    import fcntl
    import hashlib

    gguf_path = Path(gguf_path).expanduser().absolute()
    st = gguf_path.stat()
    key = hashlib.sha256(f"tok1:{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(cache_root) / f"{gguf_path.stem}-{key}"
    if (out / "tokenizer_config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "tokenizer_config.json").is_file():  # another process may have built it meanwhile
            reader = open_gguf(gguf_path)
            meta = _read_metadata(reader, gguf_path)
            config, _ = _build_configs(reader, meta, gguf_path)
            _build_dir(out, lambda tmp: _write_tokenizer(tmp, gguf_path, meta, config))
    return out


def _build_dir(out: Path, fill) -> None:
    """``fill(tmp)`` writes a directory in a temp dir beside ``out``, renamed into place once whole (a
    crash never leaves half of one)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# HF model types whose byte-level BPE ("gpt2") GGUF tokenizer AutoTokenizer builds as the plain fast
# tokenizer or Qwen2Tokenizer, which save the same tokenizer.json and, after _write_tokenizer's
# tokenizer_class, the same tokenizer_config.json (checked on llama and qwen2 files)
_PLAIN_BPE_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _write_tokenizer(out: Path, gguf_path: Path, meta: dict, config: dict, through_auto: bool | None = None) -> None:
    # transformers builds a fast tokenizer (tokenizer.json) from the GGUF vocab/merges itself.
    # AutoTokenizer first derives the model config from the file with gguf's full GGUFReader, one numpy
    # view per vocabulary entry and merge (~30 s of ~40 for Qwen2.5's 151k tokens); where the class it
    # would pick saves the same files, the fast tokenizer is built directly (~2 s). ``through_auto``
    # forces one way (tests compare them).
    if through_auto is None:
        through_auto = not (meta.get("tokenizer.ggml.model") == "gpt2" and config.get("model_type") in _PLAIN_BPE_TYPES)
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        cls = AutoTokenizer if through_auto else PreTrainedTokenizerFast
        tok = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
        tok.save_pretrained(str(out))
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: cannot build a tokenizer from the GGUF vocabulary "
                             f"({type(e).__name__}: {e})") from e
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        cfg.pop(key, None)  # loading-time arguments that transformers 5 saves, not tokenizer state
    # transformers 5 saves "TokenizersBackend", which older readers do not know; this is its alias.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = config["max_position_embeddings"]
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(cfg_path, cfg)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / out_dir.name)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
