"""A GGUF's embedding table and tied lm_head kept quantized (``appliance.layers.vocab``) under
``--quantization gguf``: a Q4_K_M-style file whose tied ``token_embd`` is Q6_K (llama.cpp's choice
for it), Q8_0 (its fallback when rows are not a multiple of 256, as in Qwen2.5-0.5B) or Q4_K.

- Embedding rows equal gguf's own ``dequantize`` of those rows: exactly for Q6_K and Q8_0 (an fp16
  scale times small integers is exact in fp32), for Q4_K to the fp32 rounding of its zero point
  (``gguf_quants``: 2^-22 of the group's largest weight), both from the canonical form and, once the
  tied lm_head is packed on a method that gives rows back (``w8a8_native``), from its packed form;
  no float copy of the table is held.
- The lm_head's logits equal its method's fp64 reference on the same canonical weight, within the
  tolerance every quantized method is held to (``helpers.assert_matches_reference``: fp32
  accumulation, 2e-5 of the largest logit at K=576; bf16 routes 2^-8 relative).
- The whole model gives the greedy tokens of the same file with the embedding and lm_head loaded as
  float (gguf's dequantization; every projection identical) and logits within 2% (relative norm) of
  them: the lm_head's activations are quantized per token (A8; measured ~0.6% here) or held in bf16.
"""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf_files import q4_k_m_types, tokenizer_vocab, write_llama_gguf
from helpers import engine_logits

from appliance import LLM, SamplingParams
from appliance.layers.linear import select_backends
from appliance.layers.quant import QuantLinear, dequantize
from appliance.layers.vocab import QuantEmbedding
from appliance.models.gguf_loader import GGUFSource
from appliance.models.gguf_quants import KEPT, canonical
from appliance.models.loader import load, model_info

CPU = torch.device("cpu")
HIDDEN, FFN, N_HEAD, N_KV, LAYERS = 256, 512, 4, 2, 2
KW = {"dtype": "float32", "num_kv_blocks": 32, "max_model_len": 128}
IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def vocab():
    return tokenizer_vocab()


@pytest.fixture(scope="module", params=["Q6_K", "Q8_0", "Q4_K"])
def tied(request, vocab, tmp_path_factory):
    """(path, the embedding's GGUF type, gguf's dequantization of token_embd [V, H])."""
    qtype = request.param
    path = write_llama_gguf(tmp_path_factory.mktemp("tied") / f"tied-{qtype}.gguf", vocab,
                            q4_k_m_types(LAYERS, qtype), layers=LAYERS, hidden=HIDDEN, ffn=FFN,
                            n_head=N_HEAD, n_kv=N_KV)
    t = {x.name: x for x in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    want = torch.from_numpy(gguf_dequantize(t.data, t.tensor_type).reshape(len(vocab["tokens"]), HIDDEN))
    return path, qtype, want


def _assert_rows(got: torch.Tensor, want: torch.Tensor, qtype: str) -> None:
    if not KEPT[qtype].has_zero_point:
        assert torch.equal(got, want)
        return
    groupmax = want.abs().reshape(want.shape[0], -1, 32).amax(-1, keepdim=True)
    err = (got.double() - want.double()).reshape(want.shape[0], -1, 32).abs()
    assert (err <= 2.0 ** -22 * groupmax).all(), f"max error {(err / groupmax).max().item():.3g} of the group max"


def _packed_model(path):
    model = load(model_info(path), torch.float32, CPU, "gguf", 32)
    model.prepare(128, CPU)
    select_backends(model, "auto", torch.float32, CPU)
    return model


def test_embedding_rows_are_ggufs_dequantization_and_no_float_table_is_held(tied):
    path, qtype, want = tied
    bt = KEPT[qtype]
    model = load(model_info(path), torch.float32, CPU, "gguf", 32)
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and (emb.scheme, emb.group_size) == (bt.scheme, bt.group)
    ids = torch.arange(want.shape[0])
    _assert_rows(emb(ids), want, qtype)

    model.prepare(128, CPU)
    select_backends(model, "auto", torch.float32, CPU)
    head = model.lm_head
    assert isinstance(head, QuantLinear) and (head.scheme, head.group_size) == (bt.scheme, bt.group)
    if head.method.gives_rows:  # the table is held once, packed for the head; rows come from there
        assert emb.qweight.numel() == 0 and head.qweight.numel() == 0
    else:  # an opaque packing: the embedding keeps the canonical table
        assert emb.qweight.shape == want.shape
    _assert_rows(emb(ids), want, qtype)
    _assert_rows(emb(ids[[7, 7, 3]].reshape(1, 3)).reshape(3, -1), want[[7, 7, 3]], qtype)  # any shape, repeats
    v, h = want.shape
    assert not any(p.is_floating_point() and p.numel() >= v * h for p in model.parameters())


def test_tied_lm_head_matches_its_methods_reference(tied):
    path, qtype, _ = tied
    model = _packed_model(path)
    head = model.lm_head
    t = {x.name: x for x in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    w = canonical(qtype, t.data, int(t.shape[1]), HIDDEN)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(0))
    got = model.compute_logits(x).double()
    want = head.method.reference(x, w.qweight, w.scale, zero_point=w.zero_point)
    tol = 2e-5 * want.abs().max().item() * (HIDDEN / 576) ** 0.5 + 1e-6
    if head.backend in ("w4a16_int4pack", "w8a16_int8pack"):  # bf16 activations and output
        assert ((got - want).abs() <= want.abs() * 2 ** -8 + tol).all()
    else:
        assert (got - want).abs().max().item() <= tol
    # the method really is quantized (A8: per-token int8 activations; A16: bf16), not float logits
    assert (got - x.double() @ dequantize(w.qweight, w.scale, w.zero_point).t()).abs().max().item() > tol


def test_tokens_and_logits_equal_the_float_embedding_model(tied, tmp_path, monkeypatch):
    path, qtype, _ = tied
    monkeypatch.setenv("APPLIANCE_CACHE_DIR", str(tmp_path / "cache"))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = LLM(str(path), quantization="gguf", **KW)
    assert isinstance(a.engine.runner.model.model.embed_tokens, QuantEmbedding)
    ta = [o.outputs[0].token_ids for o in a.generate([IDS[:9], IDS[5:30]], greedy)]
    la = engine_logits(a, IDS)
    del a
    kept = GGUFSource._kept  # the same file with only the embedding (and so the tied head) float
    monkeypatch.setattr(GGUFSource, "_kept", lambda self, t, hf, shape: kept(self, t, hf, shape)
                        and hf != "model.embed_tokens.weight")
    b = LLM(str(path), quantization="gguf", **KW)
    model = b.engine.runner.model
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding) and not isinstance(model.lm_head, QuantLinear)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) > 0
    tb = [o.outputs[0].token_ids for o in b.generate([IDS[:9], IDS[5:30]], greedy)]
    lb = engine_logits(b, IDS)
    rel = ((la - lb).norm() / lb.norm()).item()
    print(f"{qtype}: quantized vs float embedding/lm_head logits: relative error {rel:.4f}")
    assert rel < 0.02, rel
    assert ta == tb
