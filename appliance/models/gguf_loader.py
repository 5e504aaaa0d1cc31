"""GGUF -> Hugging Face model directory conversion.

A GGUF file (llama.cpp's single-file format) is converted once into a plain HF directory:
``config.json``, ``generation_config.json``, tokenizer files and a float32
``model.safetensors``. Everything above this module then loads one format only.

Weights are dequantized with ``gguf.quants.dequantize`` and renamed to HF names. For the
``llama`` architecture llama.cpp's convert script permutes the rows of q_proj/k_proj (it
stores rotary pairs interleaved, HF stores them as two halves); we undo that exactly as
transformers' own GGUF loader does (``LlamaTensorProcessor._reverse_permute_weights``).
qwen2/qwen3 are stored unpermuted (llama.cpp runs them in NEOX rope mode).

The directory records the file it came from (``gguf_source.json``: path, size, mtime), so a
load with ``--quantization w4a8`` or ``w8a8`` can take the decoder projections straight from the
GGUF's blocks where the formats line up, with no float matrix in between (``direct_w4_weights``,
``direct_w8_weights``, used by ``appliance.models.quant_loader``):
Q4_0/Q4_1 become W4 and Q8_0 W8, both at group 32; how each block type maps (exactly, or
within an fp32 rounding of the zero point) is ``appliance.models.gguf_quants``, which also keeps
the K-quants and Q5 types for the weight-loading loop. Only the native W8A8 backend
(``w8a8_native``) takes W8 groups; the others are per channel.

Every other type (F32, F16, and for now the K-quants and Q5 types too) is dequantized here
and quantized at load as a float checkpoint is.

The output directory is written into a temp dir next to it and renamed into place, so a
crashed conversion never leaves a half-written model directory behind.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from appliance.errors import ModelLoadError
from appliance.models import gguf_quants

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
GGUF_MAGIC = b"GGUF"
SOURCE_RECORD = "gguf_source.json"  # in a converted directory: the GGUF it came from
# GGUF types whose blocks are W4 groups of GGUF_BLOCK weights as they are (see the module docstring)
GGUF_BLOCK = 32
DIRECT_W4_TYPES = ("Q4_0", "Q4_1")
DIRECT_W8_TYPES = ("Q8_0",)  # W8 groups of GGUF_BLOCK weights as they are

# GGUF architecture (after the mistral-as-llama patch) -> (HF model_type, HF architecture).
_HF_ARCH = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
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
}


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
    """Open ``path`` with ``gguf.GGUFReader`` after checking it exists, is GGUF and is whole."""
    from gguf import GGUFReader

    if not path.exists():
        raise ModelLoadError(f"{path}: GGUF file does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file (expected a .gguf file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/KeyError/IndexError/struct.error...
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


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
    if meta.get(f"{arch}.expert_count", 0):
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
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0) or meta.get(f"{arch}.rope.dimension_count", 0)
                   or hidden_size // num_heads)
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
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
    if hf_arch == "mistral":
        config["sliding_window"] = None  # GGUF does not record one; llama.cpp runs full attention
    rope_scaling = _rope_scaling(meta, arch)
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise ModelLoadError(f"{path}: both rope.scaling metadata and a rope_freqs tensor")
        from gguf.quants import dequantize
        t = tensors["rope_freqs.weight"]
        rope_scaling = llama3_rope_scaling(dequantize(t.data, t.tensor_type).reshape(-1), rope_theta, head_dim, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

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
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into config["rope_scaling"]
        if t.name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_TENSORS:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
            hf_name = f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (the fastest dim) first
        n_heads = None
        if arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            n_heads = config["num_attention_heads" if ".attn_q." in t.name else "num_key_value_heads"]
        yield t, hf_name, shape, n_heads


def _hf_tensors(reader, meta: dict, config: dict, path: Path):
    """Yields (hf_name, hf_shape, loader) for each weight; loader() returns float32 numpy."""
    from gguf.quants import dequantize

    out = []
    for t, hf_name, shape, n_heads in _tensor_plan(reader, meta, config, path):
        def load(t=t, shape=shape, n_heads=n_heads):
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
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


def direct_w4_weights(gguf_path: Path) -> dict[str, tuple[str, Callable[[], tuple]]]:
    """The decoder projection weights of ``gguf_path`` stored as Q4_0/Q4_1: HF weight name ->
    (GGUF type, loader). ``loader()`` decodes the raw blocks (never a float matrix) into
    QuantLinear's canonical W4 form at group size ``GGUF_BLOCK`` (``appliance.layers.quant``):
    (q int8 ``[out, in]`` in [-8, 7], scale float32 ``[out, in / 32]``, zero point float32 of the
    same shape, or None for Q4_0), in HF row order (llama's q/k rows un-permuted, rows of q, scale
    and zero point alike). The mapping of each type: ``gguf_quants``."""
    return _direct_weights(gguf_path, DIRECT_W4_TYPES)


def direct_w8_weights(gguf_path: Path) -> dict[str, tuple[str, Callable[[], tuple]]]:
    """The decoder projection weights of ``gguf_path`` stored as Q8_0: HF weight name -> (GGUF type,
    loader). ``loader()`` decodes the raw blocks into QuantLinear's canonical W8 form at group size
    ``GGUF_BLOCK``: (q int8 ``[out, in]``, the blocks' own values, scale float32 ``[out, in / 32]``,
    the blocks' fp16 ``d``, None), in HF row order (llama's q/k rows un-permuted). Exact: ``q * d``
    is gguf's ``d * q``."""
    return _direct_weights(gguf_path, DIRECT_W8_TYPES)


def _direct_weights(gguf_path: Path, types: tuple[str, ...]) -> dict[str, tuple[str, Callable[[], tuple]]]:
    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    meta = _read_metadata(reader, gguf_path)
    config, _ = _build_configs(reader, meta, gguf_path)
    out = {}
    for t, hf_name, shape, n_heads in _tensor_plan(reader, meta, config, gguf_path):
        qtype = t.tensor_type.name
        if qtype not in types or not hf_name.endswith("_proj.weight") or len(shape) != 2:
            continue

        def load(t=t, qtype=qtype, shape=shape, n_heads=n_heads):
            w = gguf_quants.canonical(qtype, t.data, *shape, where=f"{gguf_path}: tensor {t.name!r}")
            parts = (w.qweight.numpy(), w.scale.numpy(), None if w.zero_point is None else w.zero_point.numpy())
            return tuple(p if p is None or n_heads is None else _unpermute_rows(p, n_heads) for p in parts)

        out[hf_name] = (qtype, load)
    return out


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


def _write_tokenizer(out: Path, gguf_path: Path, meta: dict, config: dict) -> None:
    # transformers builds a fast tokenizer (tokenizer.json) from the GGUF vocab/merges itself.
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
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
