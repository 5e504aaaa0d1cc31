"""Writing GGUF files of any kept block type for the tests: random raw blocks with scales chosen so the
weights are about 0.03 (gguf cannot quantize to K-quants; random bytes are valid blocks of every
type once their fp16 scales are set), in a llama-architecture file with the default model's first
1024 tokens as its vocabulary (a valid BPE: ids are in merge order)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from appliance.models.gguf_quants import KEPT

# GGUF type -> (byte offset of d, of dmin or None, d's magnitude): weights of about 0.03
# (Q4_K: d sc u, sc < 64, u < 16; Q6_K: d sc (u - 32), |sc| < 128; Q8_0: d q, |q| <= 128; Q5_0: d (u - 16);
# Q4_0: d (u - 8); Q4_1: d u + m; Q5_K: as Q4_K with u < 32; Q3_K: d (sc - 32) q, |sc - 32| <= 32, |q| <= 4;
# Q2_K: d sc u - dmin mn, sc < 16, u < 4)
SCALES = {"Q4_K": (0, 2, 3e-5), "Q6_K": (208, None, 1e-5), "Q8_0": (0, None, 2e-4), "Q5_0": (0, None, 2e-3),
          "Q4_0": (0, None, 4e-3), "Q4_1": (0, 2, 2e-3), "Q3_K": (108, None, 3e-4), "Q2_K": (80, 82, 1e-3),
          "Q5_K": (0, 2, 3e-5)}


def random_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """uint8 [n, bytes per row]: ``n`` rows of ``k`` weights of GGUF type ``qtype`` (see SCALES)."""
    bt = KEPT[qtype]
    raw = rng.integers(0, 256, (n, k // bt.block_size * bt.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, bt.type_size)
    at_d, at_dmin, scale = SCALES[qtype]
    for at in (at_d, at_dmin):
        if at is not None:
            blocks[:, at:at + 2] = (np.abs(rng.standard_normal(len(blocks))) * scale + scale / 4).astype(
                np.float16).reshape(-1, 1).view(np.uint8)
    return raw


def worst_blocks(qtype: str, n: int, k: int, rng, d: float) -> np.ndarray:
    """``random_blocks`` at their integer extremes: every weight at an end of its range (odd rows the
    top, even rows the bottom), every sub-scale / sub-min at its largest (Q6_K and Q3_K: the signed
    ends by row), d (and dmin) the fp16 value ``d``: the integer sums are at their largest and nothing
    cancels. Q4_K, Q6_K, Q3_K, Q2_K."""
    bt = KEPT[qtype]
    raw = random_blocks(qtype, n, k, rng).reshape(n, -1, bt.type_size)
    dd = np.array([d], dtype=np.float16).view(np.uint8)
    odd = (np.arange(n) % 2 == 1)[:, None]
    if qtype == "Q4_K":
        raw[..., 0:2] = dd
        raw[..., 2:4] = dd
        raw[..., 4:16] = 0xFF  # every sc and mn 63
        raw[..., 16:144] = np.where(odd, 0xFF, 0x00)[..., None]  # u all 15 or all 0
    elif qtype == "Q6_K":
        raw[..., 208:210] = dd
        raw[..., 192:208] = np.where(odd, 127, -128).astype(np.int8).view(np.uint8)[..., None]
        raw[..., 0:192] = np.where(odd, 0xFF, 0x00)[..., None]  # u all 63 or all 0
    elif qtype == "Q3_K":
        raw[..., 108:110] = dd
        # odd rows: every mask bit and 2-bit value set (q = 3), sc 63 (sc - 32 = 31); even: q = -4, sc - 32 = -32
        raw[..., 0:108] = np.where(odd, 0xFF, 0x00)[..., None]
    elif qtype == "Q2_K":
        raw[..., 80:82] = dd
        raw[..., 82:84] = dd
        raw[..., 0:16] = 0xFF  # every sc and mn 15
        raw[..., 16:80] = np.where(odd, 0xFF, 0x00)[..., None]  # u all 3 or all 0
    else:
        raise ValueError(f"worst_blocks: no worst case written for {qtype}")
    return raw.reshape(n, -1)


def tokenizer_vocab(n: int = 1024) -> dict:
    """The first ``n`` tokens of the default model's BPE, their types and the merges among them."""
    from appliance.models.default_model import default_gguf_path

    reader = gguf.GGUFReader(default_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:n]
    keep = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (p := m.split(" "))[0] in keep and p[1] in keep and p[0] + p[1] in keep]
    return {"tokens": tokens, "merges": merges, "token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:n]}


def write_llama_gguf(path: Path, vocab: dict, types: dict[str, str], *, layers: int, hidden: int, ffn: int,
                     n_head: int, n_kv: int, seed: int = 0, n_vocab: int | None = None) -> Path:
    """A llama GGUF whose weights are random blocks of ``types[tensor name]`` (every projection, the
    embedding and ``output.weight`` if listed: without it the lm_head is tied to the embedding); norms
    F32 near 1. ``n_vocab``: rows of the embedding (default: the vocabulary's size; more rows than
    tokens give a larger table, the tokens beyond the vocabulary never being produced by the
    tokenizer)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_head
    n_vocab = n_vocab or len(vocab["tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("test llama")
    for add, v in [(w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, n_head), (w.add_head_count_kv, n_kv),
                   (w.add_rope_dimension_count, head_dim), (w.add_rope_freq_base, 10000.0),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "smollm"),
                   (w.add_token_merges, vocab["merges"]), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2),
                   (w.add_add_bos_token, False)]:
        add(v)
    tokens = list(vocab["tokens"]) + [f"<extra_{i}>" for i in range(n_vocab - len(vocab["tokens"]))]
    token_types = list(vocab["token_type"]) + [1] * (n_vocab - len(vocab["tokens"]))  # 1: normal (no merges reach them)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    shapes = {"token_embd.weight": (n_vocab, hidden), "output.weight": (n_vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (n_kv * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (n_kv * head_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    w.add_tensor("output_norm.weight", (1 + rng.standard_normal(hidden) * 0.05).astype(np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(hidden) * 0.05).astype(np.float32))
    for name, (n, k) in shapes.items():
        if name in types:
            w.add_tensor(name, random_blocks(types[name], n, k, rng), raw_dtype=gguf.GGMLQuantizationType[types[name]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q4_k_m_types(layers: int, embedding: str = "Q6_K") -> dict[str, str]:
    """llama.cpp's Q4_K_M mix (``llama_tensor_get_type``): Q4_K projections; Q6_K for the tied
    embedding (it is the output), attn_v and ffn_down of the first and last eighth of the layers and
    every third layer between (its ``use_more_bits``)."""
    types = {"token_embd.weight": embedding}
    for i in range(layers):
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        types.update({f"blk.{i}.attn_q.weight": "Q4_K", f"blk.{i}.attn_k.weight": "Q4_K",
                      f"blk.{i}.attn_v.weight": "Q6_K" if more else "Q4_K", f"blk.{i}.attn_output.weight": "Q4_K",
                      f"blk.{i}.ffn_gate.weight": "Q4_K", f"blk.{i}.ffn_up.weight": "Q4_K",
                      f"blk.{i}.ffn_down.weight": "Q6_K" if more else "Q4_K"})
    return types


def q4_k_m_fallback_types(layers: int) -> dict[str, str]:
    """``q4_k_m_types`` as llama.cpp writes it when the hidden size is not a multiple of 256 (Qwen2.5-0.5B:
    896): a K-quant needs rows of whole 256-blocks, so every tensor with ``hidden`` inputs falls back,
    Q4_K to Q5_0 and Q6_K to Q8_0 (``llama_tensor_get_type``'s fallback); ffn_down (``ffn`` inputs, a
    multiple of 256) keeps its K-quant. The tied embedding is then Q8_0."""
    fallback = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}
    return {name: t if name.endswith("ffn_down.weight") else fallback[t]
            for name, t in q4_k_m_types(layers).items()}
