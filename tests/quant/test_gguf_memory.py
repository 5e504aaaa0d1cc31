"""Resident memory after loading a Q4_K_M-style GGUF (``--quantization gguf``), measured with psutil
in a fresh process: the growth of its RSS from a baseline taken after everything a model does not
own is in place (torch, the native kernels, transformers and the tokenizer) to after ``LLM(...)`` has
loaded, packed and allocated its KV cache. The 64 MiB scratch the linear-backend timing evicts caches
with is not in the baseline: it is freed once the backends are chosen, so it is not in the growth either.

The file (written here, ~80 MB): 8 llama layers at hidden 1024 / FFN 2816 in llama.cpp's Q4_K_M mix
(``gguf_files.q4_k_m_types``: Q4_K projections, Q6_K for the tied 32768 x 1024 embedding and for
attn_v / ffn_down of a third of the layers).

Accounting. What the model holds is ``weight_bytes`` (every packed layer, the embedding, norms) plus
the KV cache; the growth may exceed that by 40% (measured 1.26x once, 186 MiB for 132 + 16, on a
2-core host with glibc: ~40 MB of the engine's second tokenizer instance, runtime state and heap
pages the load's freed temporaries leave partly used; 1.03x in session 15, where the load's
``release_free_memory`` also hands back heap pages freed before the baseline). The file itself is
not mapped once ``LLM()`` returns (``file_maps``: a reader cached by a read after the load kept the
whole file mapped, its header's pages resident). Without this work the same load grew by
~4x the weights: the mmap'ed file's pages stayed resident, so did the GGUF reader's parsed
vocabulary, the float32 embedding table (128 MiB here) and the freed canonical forms that glibc
kept (~360 MB on a 12-layer file). No float copy of the embedding table may be held.

Issue 14's target, growth within 15% of the file size plus the KV cache: the weights are held at
about the file's size, the K-quants with their own scales (``lowbit.pack_kquant``, the default
choice for a layer that has them). Bytes per weight held (file: Q4_K 0.5625, Q6_K 0.8203): Q4_K on
w4a8_native 0.594 (4 bits, int8 sub-scale and sub-min per 32, fp32 d and dmin per 256); Q6_K on
w6a8_native 0.828 (6 bits, int8 sub-scale per 16, fp32 d per 256); the fused q/k/v mixing Q4_K
and Q6_K shards as one 6-bit layer of groups of 16 with mins, 0.906; the tied Q6_K embedding is
the lm_head's packed form (rows read back from it), 0.828. Before: 0.8125 (fp32 scale, int16 sum
and fp32 offset per 32), 1.125 / 1.5, and the q/k/v at 1.75, ~1.45x the file.

A hidden size that is not a multiple of 256 (Qwen2.5-0.5B's 896) makes llama.cpp write most of a
Q4_K_M file as Q5_0 (0.6875 B/weight) with a Q8_0 embedding (``gguf_files.q4_k_m_fallback_types``).
Q5_0 is held at 5 bits on ``w5a8_native`` (a nibble plane and a 1-bit plane, fp32 scale and int16 sum
per 32): 0.8125 B/weight, 1.18x the file (6 bits: 0.9375, 1.36x); Q8_0 on ``w8a8_native`` 1.25 (file
1.0625, 1.18x), and the q/k/v holding a Q8_0 v at 8 bits. The file below (4 layers at hidden 896 / FFN
4864, a 32768-row Q8_0 embedding, 73 MB) is loaded with ``linear_backend="w5a8_native"``: which
method a Q5_0 layer gets is otherwise timed (``w8a8_native`` holds it at 1.25, 1.82x the file), and
this test is of the held bytes, not of a timing. Its weights are held at 1.15x the file (at 6 bits: 1.22x).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gguf_files import q4_k_m_fallback_types, q4_k_m_types, tokenizer_vocab, write_llama_gguf

LAYERS, HIDDEN, FFN, N_HEAD, N_KV, N_VOCAB = 8, 1024, 2816, 16, 4, 32768
Q5_LAYERS, Q5_HIDDEN, Q5_FFN, Q5_HEADS, Q5_KV = 4, 896, 4864, 14, 2  # Qwen2.5-0.5B's shape
KV_BLOCKS, BLOCK = 64, 16

_PROBE = textwrap.dedent("""
    import json, sys
    import psutil, torch
    from transformers import AutoTokenizer
    from appliance import LLM
    from appliance.layers import linear
    from appliance.models.default_model import tokenizer_path
    from appliance.ops import native

    path, extra = sys.argv[1], json.loads(sys.argv[2])
    native.is_available()
    torch.randn(64, 64) @ torch.randn(64, 64)
    AutoTokenizer.from_pretrained(str(tokenizer_path(__import__("pathlib").Path(path))))
    proc = psutil.Process()
    before = proc.memory_info().rss
    llm = LLM(path, quantization="gguf", dtype="float32", num_kv_blocks=%d, block_size=%d, max_model_len=256, **extra)
    after = proc.memory_info().rss
    r = llm.engine.runner
    emb = r.model.model.embed_tokens
    floats = max((p.numel() for p in r.model.parameters() if p.is_floating_point()), default=0)
    print(json.dumps({"growth": after - before, "weights": linear.weight_bytes(r.model),
                      "kv": r.kv_cache.numel() * r.kv_cache.element_size(), "embedding": type(emb).__name__,
                      "largest_float_param": floats, "table": emb.num_embeddings * emb.embedding_dim,
                      "native": native.is_available(),
                      "backends": sorted({m.backend for m in r.model.modules() if hasattr(m, "kquant_tables")}),
                      "held": {b: sum(int(m.weight_bytes()) for m in r.model.modules()
                                      if getattr(m, "backend", None) == b and hasattr(m, "kquant_tables"))
                               for b in {m.backend for m in r.model.modules() if hasattr(m, "kquant_tables")}},
                      "kq_packed": sum(1 for m in r.model.modules()
                                       if isinstance(getattr(m, "packed", None), dict) and "kf" in m.packed),
                      # the GGUF's mappings left once LLM() is done (psutil: [path, rss] per mapping)
                      "file_maps": [[m.path, m.rss] for m in proc.memory_maps()
                                    if m.path == __import__("os").path.realpath(path)]}))
""") % (KV_BLOCKS, BLOCK)


def _measure(d: Path, path: Path, extra: dict | None = None) -> dict:
    """The probe's figures for ``path`` in a fresh process (its own cache but the built kernels)."""
    from appliance.config import cache_dir

    (d / "cache").mkdir()
    (d / "cache" / "native").symlink_to(cache_dir() / "native")  # the built kernels; the rest fresh
    env = {**os.environ, "APPLIANCE_CACHE_DIR": str(d / "cache")}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path), json.dumps(extra or {})], capture_output=True,
                         text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["native"], "the native kernels (w8a8_native: the Q6_K layers) did not load in the probe"
    m["file"] = Path(path).stat().st_size
    mib = {k: round(v / 2**20, 1) for k, v in m.items() if k in ("growth", "weights", "kv", "file")}
    print(f"resident memory (MiB): {mib}; growth / (weights + KV) = {m['growth'] / (m['weights'] + m['kv']):.2f}, "
          f"growth / (file + KV) = {m['growth'] / (m['file'] + m['kv']):.2f}, held by backend (MiB): "
          f"{ {k: round(v / 2**20, 1) for k, v in m['held'].items()} }")
    return m


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    path = write_llama_gguf(d / "q4km.gguf", tokenizer_vocab(), q4_k_m_types(LAYERS), layers=LAYERS, hidden=HIDDEN,
                            ffn=FFN, n_head=N_HEAD, n_kv=N_KV, n_vocab=N_VOCAB)
    return _measure(d, path)


@pytest.fixture(scope="module")
def measured_q5(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem_q5")
    path = write_llama_gguf(d / "q4km_896.gguf", tokenizer_vocab(), q4_k_m_fallback_types(Q5_LAYERS),
                            layers=Q5_LAYERS, hidden=Q5_HIDDEN, ffn=Q5_FFN, n_head=Q5_HEADS, n_kv=Q5_KV,
                            n_vocab=N_VOCAB)
    return _measure(d, path, {"linear_backend": "w5a8_native"})


def test_resident_memory_is_the_packed_weights_and_kv_cache(measured):
    m = measured
    assert 50 << 20 <= m["file"] <= 150 << 20  # the weights dominate the process's noise
    assert m["embedding"] == "QuantEmbedding" and m["largest_float_param"] < m["table"]
    assert m["growth"] <= 1.40 * (m["weights"] + m["kv"]), m
    # the file is unmapped once loaded (LLM's generation defaults read it after the load dropped its reader)
    assert m["file_maps"] == [], m["file_maps"]


def test_resident_memory_within_15_percent_of_the_file_and_kv_cache(measured):
    m = measured
    assert m["backends"] == ["w4a8_native", "w6a8_native"] and m["kq_packed"] >= 4 * LAYERS + 1, m
    assert m["weights"] <= 1.10 * m["file"], m  # the weights as held: about the file's size
    assert m["growth"] <= 1.15 * (m["file"] + m["kv"]), m


def test_q5_0_file_is_held_within_17_percent_of_its_size(measured_q5):
    m = measured_q5
    assert 50 << 20 <= m["file"] <= 150 << 20
    # Q5_0 projections at 5 bits, Q8_0 (the embedding, q/k/v with a Q8_0 v) at 8, ffn_down's K-quants kept
    assert m["backends"] == ["w4a8_native", "w5a8_native", "w6a8_native", "w8a8_native"], m
    assert m["embedding"] == "QuantEmbedding" and m["largest_float_param"] < m["table"]
    assert m["weights"] <= 1.17 * m["file"], m  # measured 1.15; Q5_0 at 6 bits: 1.22
    assert m["growth"] <= 1.40 * (m["weights"] + m["kv"]), m
