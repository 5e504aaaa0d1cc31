"""Sharded layers against unsharded ones, two ranks over gloo on loopback: column-parallel (a
fused q/k/v by heads), row-parallel with its all-reduce, the vocabulary-parallel embedding and
lm_head (untied and tied), float and W8A8. Weights go through the layers' own weight loaders, which
cut each rank's part, as a checkpoint's do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tp_harness import Ranks

from appliance.layers import parallel
from appliance.layers.linear import Linear
from appliance.layers.methods import get as get_method
from appliance.layers.quant import QuantLinear, quantize_int8
from appliance.layers.vocab import VocabEmbedding, tied_lm_head
from appliance.layers.weight_loading import QuantizedWeight, WeightLoadError
from helpers import first_usable_backend

H, Q, KV = 64, 64, 32  # hidden; q rows (4 heads of 16), k/v rows (2 heads of 16)
SHARDS = {"q_proj": (0, Q), "k_proj": (Q, KV), "v_proj": (Q + KV, KV)}


@pytest.fixture(scope="module")
def ranks():
    return Ranks(2)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qkv_weights():
    g = _gen(0)
    w = {s: torch.randn(rows, H, generator=g) * 0.1 for s, (_, rows) in SHARDS.items()}
    b = {s: torch.randn(rows, generator=g) * 0.1 for s, (_, rows) in SHARDS.items()}
    return w, b


def _load_qkv(layer, w, b, whole: bool):
    if whole:  # a checkpoint that stores the fused tensor (Phi-3's qkv_proj)
        layer.weight_loader(layer.weight, torch.cat(list(w.values())), None)
        layer.weight_loader(layer.bias, torch.cat(list(b.values())), None)
        return
    for s in SHARDS:
        layer.weight_loader(layer.weight, w[s], s)
        layer.weight_loader(layer.bias, b[s], s)


@pytest.mark.parametrize("whole", [False, True], ids=["by_shard", "fused_tensor"])
def test_column_parallel_qkv_splits_by_heads(ranks, whole):
    w, b = _qkv_weights()
    full = Linear(H, Q + 2 * KV, bias=True, shards=SHARDS)
    _load_qkv(full, w, b, whole)
    layers = ranks.build(lambda r: Linear(H, Q + 2 * KV, bias=True, shards=SHARDS, tp="column"))
    for lay in layers:
        _load_qkv(lay, w, b, whole)
        assert lay.weight.shape == ((Q + 2 * KV) // 2, H)
        assert lay.shards == {"q_proj": (0, Q // 2), "k_proj": (Q // 2, KV // 2), "v_proj": (Q // 2 + KV // 2, KV // 2)}
    x = torch.randn(7, H, generator=_gen(1))
    want = full(x)
    q, k, v = want.split([Q, KV, KV], dim=-1)
    for r, got in enumerate(ranks.run(lambda r: layers[r](x))):
        # rank r: query heads 2r, 2r+1 and KV head r
        exp = torch.cat([q[:, r * Q // 2:(r + 1) * Q // 2], k[:, r * KV // 2:(r + 1) * KV // 2],
                         v[:, r * KV // 2:(r + 1) * KV // 2]], dim=-1)
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=0)


def test_row_parallel_sums_over_ranks_and_adds_the_bias_once(ranks):
    g = _gen(2)
    n, k = 48, 128
    w, b = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    full = Linear(k, n, bias=True)
    full.weight_loader(full.weight, w, None)
    full.weight_loader(full.bias, b, None)
    layers = ranks.build(lambda r: Linear(k, n, bias=True, tp="row"))
    for lay in layers:
        lay.weight_loader(lay.weight, w, None)
        lay.weight_loader(lay.bias, b, None)
        assert lay.weight.shape == (n, k // 2)
    assert torch.equal(layers[0].bias, b) and not layers[1].bias.any()
    x = torch.randn(5, k, generator=g)
    want = full(x)
    outs = ranks.run(lambda r: layers[r](x[:, r * k // 2:(r + 1) * k // 2]))
    for got in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the sum is the all-reduce's, not one rank's part
    assert (layers[0].weight @ x[0, :k // 2] - want[0]).abs().max() > 1e-2


def test_vocab_parallel_embedding_and_heads(ranks):
    g = _gen(3)
    v, h = 384, 16
    table = torch.randn(v, h, generator=g)
    head_w = torch.randn(v, h, generator=g)
    embs = ranks.build(lambda r: VocabEmbedding(v, h, tp=True))
    heads = ranks.build(lambda r: Linear(h, v, tp="vocab"))
    for e, hd in zip(embs, heads):
        e.weight_loader(e.weight, table, None)
        hd.weight_loader(hd.weight, head_w, None)
        assert e.weight.shape == (v // 2, h) and hd.weight.shape == (v // 2, h)
    assert [e.vocab_start for e in embs] == [0, v // 2]
    ids = torch.tensor([0, 5, v // 2 - 1, v // 2, 300, v - 1, 5])  # both halves, a repeat
    for got in ranks.run(lambda r: embs[r](ids)):
        assert torch.equal(got, F.embedding(ids, table))  # one rank's row plus zeros: exact
    hidden = torch.randn(3, h, generator=g)
    for got in ranks.run(lambda r: heads[r](hidden)):
        torch.testing.assert_close(got, hidden @ head_w.t(), atol=1e-5, rtol=0)
    tied = [tied_lm_head(e) for e in embs]
    for got in ranks.run(lambda r: tied[r](hidden)):
        torch.testing.assert_close(got, hidden @ table.t(), atol=1e-5, rtol=0)


def _quant_like(lin: Linear, scheme="w8a8", group=None, w8_groups=False) -> QuantLinear:
    """The swap the loader makes for a quantized checkpoint layer (``loader.build_model_for``)."""
    q = QuantLinear(lin.in_features, lin.out_features, scheme, group, lin.bias is not None, dict(lin.shards),
                    w8_groups=w8_groups)
    parallel.inherit(q, lin)
    if q.weight_zero_point is not None:
        q.weight_zero_point.data.zero_()
    return q


def _w8_record(n, k, seed, group=None):
    w = torch.randn(n, k, generator=_gen(seed)) * 0.05
    if group is None:
        qw, s = quantize_int8(w)
        return QuantizedWeight(qw, s, None, k, "w8a8")
    wg = w.reshape(n, k // group, group)
    s = (wg.abs().amax(-1) / 127).clamp(min=1e-8)
    qw = torch.round(wg / s[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight(qw, s, None, group, "w8a8")


W8 = first_usable_backend("w8a8_native", "w8a8_onednn", "w8a16_int8pack")


def test_w8a8_column_parallel_equals_unsharded(ranks):
    rec = _w8_record(96, 64, 4)
    full = _quant_like(Linear(64, 96))
    full.weight_loader(full.qweight, rec, None)
    full.set_backend(W8)
    layers = ranks.build(lambda r: _quant_like(Linear(64, 96, tp="column")))
    for lay in layers:
        lay.weight_loader(lay.qweight, rec, None)
        lay.set_backend(W8)
    x = torch.randn(6, 64, generator=_gen(5))
    want = full(x)
    for r, got in enumerate(ranks.run(lambda r: layers[r](x))):
        torch.testing.assert_close(got, want[:, r * 48:(r + 1) * 48], atol=1e-5, rtol=0)


@pytest.mark.parametrize("group", [None, 32], ids=["per_channel", "groups_of_32"])
def test_w8a8_row_parallel_is_the_sum_of_rank_products(ranks, group):
    """Each rank applies the method to its slice of the input (A8: activations quantized per token
    over that slice), and the all-reduce sums: equal, within 1e-5, to the sum of the method's fp64
    reference per rank. Against the unsharded layer (activations quantized over the whole row) it
    differs by the activation rounding only."""
    backend = W8 if group is None else "w8a8_native"
    if group is not None and get_method(backend).host_problem() is not None:
        pytest.skip(f"W8 groups run on w8a8_native only: {get_method(backend).host_problem()}")
    n, k = 32, 128
    rec = _w8_record(n, k, 6, group)
    full = _quant_like(Linear(k, n), group=group, w8_groups=group is not None)
    full.weight_loader(full.qweight, rec, None)
    layers = ranks.build(lambda r: _quant_like(Linear(k, n, tp="row"), group=group, w8_groups=group is not None))
    for lay in layers:
        lay.weight_loader(lay.qweight, rec, None)
    halves = [(lay.qweight.data.clone(), lay.weight_scale.data.clone()) for lay in layers]
    assert torch.equal(halves[0][0], rec.qweight[:, :k // 2]) and torch.equal(halves[1][0], rec.qweight[:, k // 2:])
    if group is None:  # per channel: every rank holds the whole scale
        assert all(torch.equal(s, rec.scale) for _, s in halves)
    else:  # groups: each rank its own groups' scales
        assert torch.equal(halves[1][1], rec.scale[:, (k // 2) // group:])
    full.set_backend(backend)
    for lay in layers:
        lay.set_backend(backend)
    x = torch.randn(5, k, generator=_gen(7))
    parts = [x[:, r * k // 2:(r + 1) * k // 2] for r in range(2)]
    want = sum(get_method(backend).reference(parts[r], qw, s).float() for r, (qw, s) in enumerate(halves))
    unsharded = full(x)
    for got in ranks.run(lambda r: layers[r](parts[r])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got, unsharded, atol=0.02 * unsharded.abs().max().item(), rtol=0)


def test_groups_that_straddle_ranks_are_refused(ranks):
    layers = ranks.build(lambda r: Linear(96, 16, tp="row"))  # 48 inputs a rank: not whole groups of 32
    rec = _w8_record(16, 96, 8, group=32)
    with pytest.raises(WeightLoadError, match=r"groups of 32 inputs, which do not split at tensor_parallel_size=2"):
        parallel.rank_part(layers[0], layers[0].weight, rec, None)


def test_sizes_that_do_not_split_are_refused(ranks):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the rows of k_proj \(15\)"):
        ranks.build(lambda r: Linear(H, 47, shards={"q_proj": (0, 32), "k_proj": (32, 15)}, tp="column"))
