"""ops.native.moe_experts (one native call per mixture-of-experts layer) on every variant this CPU
supports: against an fp64 per-token loop over each token's experts (the experts' own float weights),
for routings with experts of 0 rows, 1 row and every row; bit for bit against the per-expert path
(fused_moe.grouped_experts with the same native methods: same micro-kernel, same rows per block);
quantized and non-native experts through their LinearKinds; bad input refused by name.

fp32 accumulation through two projections (K = hidden, then K = width) of weights ~N(0, 0.05): the
bound ``2e-5 * max|y| + 1e-6`` is several times fp32's eps * sqrt(K) per projection at these sizes;
a wrong expert, panel, row or routing weight is off by O(max|y|)."""
from __future__ import annotations

import pytest
import torch

from appliance.layers.forward_context import ForwardContext, set_forward_context
from appliance.layers.fused_moe import grouped_experts, native_plan
from appliance.layers.methods import floating
from appliance.models.moe import ARCHS, MoeConfig, SparseMoeBlock
from appliance.ops import native

HIDDEN, WIDTH, EXPERTS, TOP_K = 96, 48, 8, 3  # width: 3 silu panels of 16; hidden: 3 panels, a tail


def _block(width=WIDTH, seed=0, hidden=HIDDEN) -> tuple[SparseMoeBlock, dict]:
    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=hidden, intermediate_size=64,
              moe_intermediate_size=width, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    cfg = MoeConfig.from_hf(hf, ARCHS["Qwen3MoeForCausalLM"], "Qwen3MoeForCausalLM")
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    # the float weights (set_backend releases them once packed)
    weights = {id(e): (e.gate_up_proj.weight.detach().clone(), e.down_proj.weight.detach().clone())
               for e in block.experts}
    return block, weights


def _set(block, backend):
    for e in block.experts:
        e.gate_up_proj.set_backend(backend)
        e.down_proj.set_backend(backend)


def _fp64_reference(block, weights, x, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gu, dn = weights[id(block.experts[int(ids[t, j])])]
            h = x[t].double() @ gu.double().t()
            i = h.shape[0] // 2
            out[t] += w[t, j].double() * ((torch.nn.functional.silu(h[:i]) * h[i:]) @ dn.double().t())
    return out


def _routing(case: str, t: int, g: torch.Generator) -> torch.Tensor:
    """[t, TOP_K] distinct expert ids per token."""
    if case == "random":
        return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)]) if t else \
            torch.empty(0, TOP_K, dtype=torch.int64)
    if case == "all_tokens_same_experts":  # experts 5, 2, 7 get every row, the others none
        return torch.tensor([[5, 2, 7]] * t)
    # one_row_each: expert 0 gets one row (token 0), 1..3 every other token's, 4..7 none
    ids = torch.tensor([[1, 2, 3]] * t)
    ids[0] = torch.tensor([3, 0, 1])
    return ids


def _check(got, want):
    assert got.shape == want.shape and got.dtype == torch.float32
    if not want.numel():
        return
    tol = 2e-5 * want.abs().max().item() + 1e-6
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


def _call(block, x, ids, w):
    flat, kinds = native_plan(block.experts)
    return native.moe_experts(x, ids, w, flat, kinds, block.experts[0].down_proj.in_features)


@pytest.mark.parametrize("case,tokens", [("random", 0), ("random", 1), ("random", 2), ("random", 16),
                                         ("random", 40), ("all_tokens_same_experts", 1),
                                         ("all_tokens_same_experts", 19), ("one_row_each", 11)])
def test_native_f32_experts_match_fp64_per_token_loop(variant, case, tokens):
    block, weights = _block()
    _set(block, "native")
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = _routing(case, tokens, g)
    w = torch.rand(tokens, TOP_K, generator=g)
    got = _call(block, x, ids, w)
    _check(got, _fp64_reference(block, weights, x, ids, w))
    # the per-expert path with the same methods: the same micro-kernel over the same row blocks while
    # no expert has more rows than the native float32 method keeps on its panel kernel; above that,
    # the per-expert layer runs torch's batched GEMM over the panels (floating.NATIVE_F32_MAX_ROWS),
    # so the two agree to the fp64 reference's tolerance instead of bit for bit
    with set_forward_context(ForwardContext(None, [], native)):
        per_expert = grouped_experts(x, ids, w, block.experts)
    rows = torch.bincount(ids.flatten(), minlength=len(block.experts)) if ids.numel() else torch.zeros(1)
    if int(rows.max()) <= floating.NATIVE_F32_MAX_ROWS:
        assert torch.equal(got, per_expert)
    else:
        _check(per_expert, _fp64_reference(block, weights, x, ids, w))


@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_non_native_float_experts_through_their_kinds(variant, backend):
    """Experts on another float method run per touched expert inside the call (its LinearKind)."""
    from helpers import skip_unless_backend

    skip_unless_backend(backend)
    block, weights = _block()
    _set(block, backend)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, HIDDEN, generator=g)
    ids = _routing("random", 13, g)
    w = torch.rand(13, TOP_K, generator=g)
    got = _call(block, x, ids, w)
    _check(got, _fp64_reference(block, weights, x, ids, w))
    with set_forward_context(ForwardContext(None, [], native)):
        torch.testing.assert_close(got, grouped_experts(x, ids, w, block.experts), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scheme,backend", [("w8a8", "w8a8_native"), ("w4a8", "w4a8_native")])
def test_quantized_experts_equal_the_per_expert_path(variant, scheme, backend):
    """Quantized experts stay quantized in the one call: equal to each QuantLinear's own forward."""
    from helpers import skip_unless_backend

    from appliance.layers import quant

    skip_unless_backend(backend)
    block, _ = _block(width=64)
    quant.quantize_model(block, scheme, 32)
    _set(block, backend)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, HIDDEN, generator=g)
    ids = _routing("random", 21, g)
    w = torch.rand(21, TOP_K, generator=g)
    got = _call(block, x, ids, w)
    with set_forward_context(ForwardContext(None, [], native)):
        want = grouped_experts(x, ids, w, block.experts)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_block_uses_the_one_call_with_native_ops(monkeypatch):
    """SparseMoeBlock under the native op set takes ops.moe_experts (and the per-expert path when
    FUSED_LAYERS is off); both give the same result."""
    block, _ = _block()
    _set(block, "native")
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(7))
    calls = []
    real = native.moe_experts
    monkeypatch.setattr(native, "moe_experts", lambda *a: calls.append(1) or real(*a))
    with set_forward_context(ForwardContext(None, [], native)):
        one = block(x)
        assert calls == [1]
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        per_expert = block(x)
        assert calls == [1]
    assert torch.equal(one, per_expert)


def test_block_plan_follows_experts_packed_or_replaced_anew(monkeypatch):
    """The block's one-call plan (the experts' packed tensors, read from its submodules once per step) is
    rebuilt when an expert's projection is packed anew or replaced: the one call then gives what the
    per-expert path gives with the new projections, not the old weights."""
    block, _ = _block()
    _set(block, "native")
    other, _ = _block(seed=1)
    _set(other, "native")
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(7))
    with set_forward_context(ForwardContext(None, [], native)):
        before = block(x)
        block.experts[int(block.gate(x)[2][0, 0])].down_proj = other.experts[0].down_proj  # replaced
        replaced = block(x)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        want = block(x)
        monkeypatch.setattr(native, "FUSED_LAYERS", True)
        e = block.experts[int(block.gate(x)[2][1, 0])]
        e.gate_up_proj.packed = other.experts[1].gate_up_proj.packed  # packed anew
        repacked = block(x)
        monkeypatch.setattr(native, "FUSED_LAYERS", False)
        want_repacked = block(x)
    assert not torch.equal(before, replaced) and torch.equal(replaced, want)
    assert not torch.equal(replaced, repacked) and torch.equal(repacked, want_repacked)


def test_bad_input_is_refused():
    block, _ = _block()
    _set(block, "native")
    x = torch.randn(2, HIDDEN)
    w = torch.rand(2, TOP_K)
    with pytest.raises(RuntimeError, match=r"expert ids must be in \[0, 8\), got 8"):
        _call(block, x, torch.tensor([[0, 1, 8], [0, 1, 2]]), w)
    with pytest.raises(RuntimeError, match=r"weights of ids' shape"):
        _call(block, x, torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.rand(2, 2))
    flat, kinds = native_plan(block.experts)
    with pytest.raises(RuntimeError, match=r"10 tensors per expert"):
        native.moe_experts(x, torch.tensor([[0, 1, 2], [0, 1, 2]]), w, flat[:-1], kinds, WIDTH)


# ---------------------------------------------------------------- quantized experts in one region (moe_q)
#
# Every touched expert's W8A8 / low-bit projections in one parallel region: each token's activation is
# quantized once, (expert, 16-row tile) items over the threads. It runs the expert's rows through the
# same work items, in the same row blocks, as that method's own gemm call, so it is held bit for bit to
# the per-expert loop (per_expert=True: each touched expert's QuantLinear kernels on its rows), and to
# a per-token loop of the QuantLinear layers themselves within 1e-6 relative (the same integer products;
# only the weighted sums' order is the same too, so it is exact in practice).

Q_HIDDEN, Q_WIDTH = 128, 96  # W4A8's smallest groups: 16; W8A8 group 32 divides both


def _quant_block(scheme, backend, group, seed=0, extremes=False, other=None, w8_low=-128):
    """other: {expert index: backend} for the down projections to pack on another method; w8_low: the
    W8 extreme weights' low value (-128: the AVX2 sign kernel's exception, run by the portable loop;
    -127: every W8 weight at +-127, the sign kernel's own worst case)."""
    from appliance.layers import quant

    block, _ = _block(width=Q_WIDTH, seed=seed, hidden=Q_HIDDEN)
    quant.quantize_model(block, scheme, group)
    if extremes:  # every weight at the method's extremes (W8: -128 and 127, W4: -8 and 7), random signs
        g = torch.Generator().manual_seed(seed + 100)
        lo_q, hi_q = (w8_low, 127) if scheme == "w8a8" else (-8, 7)
        for e in block.experts:
            for lin in (e.gate_up_proj, e.down_proj):
                pick = torch.rand(lin.qweight.shape, generator=g) < 0.5
                lin.qweight.data = torch.where(pick, torch.tensor(lo_q, dtype=torch.int8),
                                               torch.tensor(hi_q, dtype=torch.int8))
                lin.weight_scale.data.uniform_(0.5e-3, 2e-3, generator=g)
    for i, e in enumerate(block.experts):
        e.gate_up_proj.set_backend(backend)
        e.down_proj.set_backend((other or {}).get(i, backend))
    return block


def _per_token_quant_reference(block, x, ids, w):
    """The QuantLinear experts applied token by token (the same method's own forward, silu_and_mul as
    the reference ops), weighted and summed in increasing expert order, in float32."""
    out = torch.zeros_like(x)
    with set_forward_context(ForwardContext(None, [], native)):
        for t in range(x.shape[0]):
            order = torch.argsort(ids[t])
            acc = None
            for j in order.tolist():
                y = block.experts[int(ids[t, j])](x[t:t + 1])[0] * w[t, j]
                acc = y if acc is None else acc + y
            out[t] = acc
    return out


@pytest.mark.parametrize("scheme,backend,group", [("w8a8", "w8a8_native", 32), ("w8a8", "w8a8_native", 16),
                                                  ("w4a8", "w4a8_native", 32), ("w4a8", "w4a8_native", 16)])
@pytest.mark.parametrize("case,tokens", [("random", 1), ("random", 16), ("random", 40),
                                         ("all_tokens_same_experts", 19), ("one_row_each", 11)])
def test_quantized_experts_one_region_equal_per_expert(variant, scheme, backend, group, case, tokens):
    from helpers import skip_unless_backend

    skip_unless_backend(backend)
    block = _quant_block(scheme, backend, group)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, Q_HIDDEN, generator=g)
    ids = _routing(case, tokens, g)
    w = torch.rand(tokens, TOP_K, generator=g)
    before = native.moe_q_calls()
    got = _call(block, x, ids, w)
    assert native.moe_q_calls() == before + 1, "the one-region quantized path did not run"
    flat, kinds = native_plan(block.experts)
    per_expert = native.moe_experts(x, ids, w, flat, kinds, Q_WIDTH, per_expert=True)
    assert native.moe_q_calls() == before + 1
    assert torch.equal(got, per_expert), (got - per_expert).abs().max()
    want = _per_token_quant_reference(block, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("scheme,backend,w8_low", [("w8a8", "w8a8_native", -128), ("w8a8", "w8a8_native", -127),
                                                    ("w4a8", "w4a8_native", None)])
def test_quantized_experts_worst_case_inputs(variant, scheme, backend, w8_low):
    """Weights at the integer extremes (W8: -128, the AVX2 sign trick's exception, and 127, or +-127, the
    sign trick's own worst case, whose tiles also prefetch the next item's; W4: -8 and 7) and activations
    with outliers 1e4 times the rest (one element of a token at +-1e4, a token of all zeros, a constant
    token): bit for bit the per-expert loop, and the per-token QuantLinear loop."""
    from helpers import skip_unless_backend

    skip_unless_backend(backend)
    block = _quant_block(scheme, backend, 16, seed=3, extremes=True, w8_low=w8_low or -128)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, Q_HIDDEN, generator=g)
    x[0, 5] = 1e4
    x[1, 77] = -1e4
    x[2] = 0.0
    x[3] = 3.0
    x[4, :] *= 1e3
    ids = _routing("random", 12, g)
    w = torch.rand(12, TOP_K, generator=g)
    before = native.moe_q_calls()
    got = _call(block, x, ids, w)
    assert native.moe_q_calls() == before + 1
    flat, kinds = native_plan(block.experts)
    assert torch.equal(got, native.moe_experts(x, ids, w, flat, kinds, Q_WIDTH, per_expert=True))
    want = _per_token_quant_reference(block, x, ids, w)
    assert torch.isfinite(got).all()
    for t in range(12):  # per token: each has its own scale (the outlier rows are 1e4x the others)
        torch.testing.assert_close(got[t], want[t], atol=1e-6 * want[t].abs().max().item() + 1e-30, rtol=0)


def test_mixed_expert_methods_fall_back_to_the_per_expert_loop(variant):
    """Experts on different quantized kinds (one on another W8 method) are not one region: the
    per-expert loop runs them, with the same result as the per-token reference."""
    from helpers import first_usable_backend, skip_unless_backend

    skip_unless_backend("w8a8_native")
    block = _quant_block("w8a8", "w8a8_native", 32, other={2: first_usable_backend("w8a16_int8pack", "w8a8_onednn")})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, Q_HIDDEN, generator=g)
    ids = _routing("all_tokens_same_experts", 9, g)  # expert 2 is touched
    w = torch.rand(9, TOP_K, generator=g)
    before = native.moe_q_calls()
    got = _call(block, x, ids, w)
    assert native.moe_q_calls() == before
    want = _per_token_quant_reference(block, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


# ---------------------------------------------------------------- GGUF K-quant experts in one region (moe_q)
#
# Experts as a GGUF MoE file holds them (Qwen3-30B-A3B Q4_K_M: ffn_gate_exps / ffn_up_exps Q4_K,
# ffn_down_exps Q6_K or Q4_K by layer) keep their K-quant scales (lowbit.pack_kquant: per super-block
# d / dmin, int8 sub-scales / sub-mins, a row shift) and run in moe_q's one region like the fp32-group
# low-bit experts: each row bit for bit the per-expert loop (gemm_wlow_kq_a8 on the expert's rows).

KQ_HIDDEN, KQ_WIDTH = 256, 256  # the K-quant super-block (256) divides both projections' inputs
# layout -> GGUF types of gate, up, down (a fused gate/up of two types is one 6-bit layer of groups of 16)
KQ_LAYOUTS = {"q4_k_m": ("Q4_K", "Q4_K", "Q6_K"), "q4_k": ("Q4_K", "Q4_K", "Q4_K"),
              "q6_k": ("Q6_K", "Q6_K", "Q6_K"), "q5_k_down": ("Q4_K", "Q4_K", "Q5_K"),
              "gate_q4_k_up_q6_k": ("Q4_K", "Q6_K", "Q4_K")}


def _kq_blocks(qtype: str, n: int, k: int, rng, worst: float | None = None):
    """Random blocks of ``qtype`` (gguf_files.random_blocks: weights ~0.03); ``worst``: every weight at an
    end of its range (rows alternate which), every sub-scale / sub-min at its largest (Q6_K: int8 127 / -128
    by row), d (and dmin) ``worst`` (an fp16 value)."""
    from gguf_files import random_blocks, worst_blocks

    return random_blocks(qtype, n, k, rng) if worst is None else worst_blocks(qtype, n, k, rng, worst)


def _kq_linear(types: dict, k: int, rng, worst: float | None = None):
    """A QuantLinear of shards ``types`` ({shard: (GGUF type, rows)}) loaded from random blocks as the
    GGUF loader loads them, packed on the method that keeps its K-quant scales."""
    from appliance.layers.quant import QuantLinear
    from appliance.layers.weight_loading import QuantizedWeight, load_quant_linear
    from appliance.models.gguf_quants import canonical

    shards, o = {}, 0
    for sid, (_, r) in types.items():
        shards[sid], o = (o, r), o + r
    cws = {sid: canonical(t, _kq_blocks(t, r, k, rng, worst), r, k) for sid, (t, r) in types.items()}
    four = all(cw.scheme == "w4a8" for cw in cws.values())
    one = len(types) == 1
    lin = QuantLinear(k, o, "w4a8" if four else "w8a8", 32 if four else min(cw.group for cw in cws.values()),
                      shards=None if one else shards, w8_groups=not four)
    for sid, cw in cws.items():
        load_quant_linear(lin, lin.qweight, QuantizedWeight(cw.qweight, cw.scale, cw.zero_point, cw.group, cw.scheme,
                                                            cw.kquant), None if one else sid)
    name = lin.preferred_backend()
    assert name == ("w4a8_native" if four else "w6a8_native"), name
    lin.set_backend(name)
    assert "kf" in lin.packed
    return lin


def _kq_block(layout: str, seed=0, down_of=None, worst=None):
    """A Qwen3-MoE block whose experts hold GGUF K-quant weights (``KQ_LAYOUTS[layout]``); down_of: {expert:
    GGUF type} for down projections of another type; worst: (gate/up d, down d) for worst-case blocks."""
    import numpy as np

    block, _ = _block(width=KQ_WIDTH, seed=seed, hidden=KQ_HIDDEN)
    rng = np.random.default_rng(seed)
    g, u, d = KQ_LAYOUTS[layout]
    for i, e in enumerate(block.experts):
        e.gate_up_proj = _kq_linear({"gate": (g, KQ_WIDTH), "up": (u, KQ_WIDTH)}, KQ_HIDDEN, rng,
                                    worst and worst[0])
        e.down_proj = _kq_linear({None: ((down_of or {}).get(i, d), KQ_HIDDEN)}, KQ_WIDTH, rng, worst and worst[1])
    return block


def _kq_check(block, x, ids, w, one_region=True):
    """moe_experts' result, asserted bit for bit the per-expert loop and (one_region) that moe_q ran."""
    flat, kinds = native_plan(block.experts)
    before = native.moe_q_calls()
    got = native.moe_experts(x, ids, w, flat, kinds, KQ_WIDTH)
    assert native.moe_q_calls() == before + one_region, "which path ran"
    per_expert = native.moe_experts(x, ids, w, flat, kinds, KQ_WIDTH, per_expert=True)
    assert native.moe_q_calls() == before + one_region
    assert torch.equal(got, per_expert), (got - per_expert).abs().max()
    return got


@pytest.mark.parametrize("layout", list(KQ_LAYOUTS))
@pytest.mark.parametrize("case,tokens", [("random", 1), ("random", 16), ("random", 40),
                                         ("all_tokens_same_experts", 19), ("one_row_each", 11)])
def test_kquant_experts_one_region_equal_per_expert(variant, layout, case, tokens):
    block = _kq_block(layout)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, KQ_HIDDEN, generator=g)
    ids = _routing(case, tokens, g)
    w = torch.rand(tokens, TOP_K, generator=g)
    got = _kq_check(block, x, ids, w)
    # each expert's own QuantLinear token by token (gemm_wlow_kq_a8 at one row): the same integer products
    want = _per_token_quant_reference(block, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("worst", [(65504.0, 2.0 ** -24), (2.0 ** -24, 65504.0)], ids=["big_gate_up", "big_down"])
def test_kquant_experts_worst_case(variant, worst):
    """Q4_K gate/up and Q6_K down with every weight at an end of its range, the largest sub-scales and
    mins, d / dmin at fp16's largest or smallest subnormal, and activations with outliers 1e4 times the
    rest (a token of all zeros, a constant token, one coded 127 / -128 with nothing cancelling):
    finite, bit for bit the per-expert loop, and per token the experts' own layers."""
    block = _kq_block("q4_k_m", seed=3, worst=worst)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, KQ_HIDDEN, generator=g)
    x[0, 5] = 1e4
    x[1, 77] = -1e4
    x[2] = 0.0
    x[3] = 3.0
    x[4] = torch.where(torch.arange(KQ_HIDDEN) % 2 == 1, -1.0, 0.99)
    ids = _routing("random", 12, g)
    w = torch.rand(12, TOP_K, generator=g)
    got = _kq_check(block, x, ids, w)
    assert torch.isfinite(got).all()
    want = _per_token_quant_reference(block, x, ids, w)
    for t in range(12):
        torch.testing.assert_close(got[t], want[t], atol=1e-6 * want[t].abs().max().item() + 1e-30, rtol=0)


def test_kquant_experts_of_mixed_types_fall_back(variant):
    """Down projections of two K-quant types in one layer (expert 2's Q4_K among Q6_K) are not one
    region: the per-expert loop runs them (the counter does not move), with the per-token result."""
    block = _kq_block("q4_k_m", down_of={2: "Q4_K"})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, KQ_HIDDEN, generator=g)
    ids = _routing("all_tokens_same_experts", 9, g)  # expert 2 is touched
    w = torch.rand(9, TOP_K, generator=g)
    got = _kq_check(block, x, ids, w, one_region=False)
    want = _per_token_quant_reference(block, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=0)


def test_kquant_expert_tables_of_the_wrong_size_are_refused():
    """A K-quant expert's tables not of its shape are refused naming the expert, the projection and the
    table (not read out of bounds)."""
    block = _kq_block("q4_k_m")
    flat, kinds = native_plan(block.experts)
    x, ids, w = torch.randn(2, KQ_HIDDEN), torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.rand(2, TOP_K)
    bad = list(flat)
    bad[3] = flat[3][:-1]  # expert 0 gate/up kf
    with pytest.raises(RuntimeError, match=r"expert 0 gate/up: kf float32: krowsum \[512\].* got \d+ values"):
        native.moe_experts(x, ids, w, bad, kinds, KQ_WIDTH)
    bad = list(flat)
    bad[5 + 4] = flat[5 + 4][:-1]  # expert 0 down k8
    with pytest.raises(RuntimeError, match=r"expert 0 down: k8 int8: .* got \d+ values"):
        native.moe_experts(x, ids, w, bad, kinds, KQ_WIDTH)
    bad_kinds = list(kinds)
    bad_kinds[3] = 128 | 3 << 16  # expert 0's gate/up said to have super-blocks of 128: its tables are of 256
    before = native.moe_q_calls()
    with pytest.raises(RuntimeError, match=r"expert 0 gate/up: kf float32: krowsum \[512\], ksup \[32, 2, 16\]"):
        native.moe_experts(x, ids, w, flat, bad_kinds, KQ_WIDTH)
    assert native.moe_q_calls() == before
