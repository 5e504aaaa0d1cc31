"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers 5.24 on tiny random-weight
models (8 experts, top-2): greedy tokens, logits, the experts each token is routed to, the grouped
expert pass against a per-token loop, both checkpoint layouts, every schedule, quantized experts."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from helpers import check_against_transformers, engine_logits
from safetensors.torch import load_file, save_file

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import ModelLoadError
from appliance.layers.forward_context import ForwardContext, set_forward_context
from appliance.layers.fused_moe import grouped_experts
from appliance.layers.linear import LinearBase
from appliance.models.moe import MoeConfig, MoeForCausalLM, SparseMoeBlock
from appliance.ops import reference as reference_ops
from appliance.ops import native as native_ops
from appliance.ops.native import is_available as native_available

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words",
    "def f(x): return x * 2",
    "Hello",
]
MAX_NEW = 24
# (arch, config overrides): Qwen2-MoE also with a dense first layer (mlp_only_layers), every other
# layer sparse (decoder_sparse_step) and renormalized top-k weights
CASES = [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=True)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(norm_topk_prob=False)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _hf_holding(src, written: dict):
    """transformers' model of ``src`` with its experts' weights replaced by ``written`` (a GGUF's
    dequantized expert tensors, as write_moe_gguf returns them)."""
    hf = _hf(src)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            g, u, d = (torch.from_numpy(written[f"blk.{i}.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down"))
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([g, u], dim=1))
            layer.mlp.experts.down_proj.copy_(d)
    return hf


def hf_greedy(hf, prompts_ids, max_new):
    outs = []
    for ids in prompts_ids:
        g = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(g[0, len(ids):].tolist())
    return outs


def _sparse_layers(model):
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("arch,overrides", CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={v}" for k, v in v.items()) or "default")
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_greedy_and_logits_match_transformers(tiny_model_dir, arch, overrides, backend):
    path = tiny_model_dir(arch, **overrides)
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=128)
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM)
    hf_cfg = json.loads((path / "config.json").read_text())
    n_layers = hf_cfg["num_hidden_layers"]
    want_sparse = [i not in overrides.get("mlp_only_layers", []) and (i + 1) % overrides.get("decoder_sparse_step", 1)
                   == 0 for i in range(n_layers)]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == want_sparse
    assert all(len(b.experts) == 8 for b in _sparse_layers(model))
    _assert_experts_chosen_at_their_rows(llm)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    check_against_transformers(llm, path, ids, MAX_NEW)
    # the native op set (auto, where the extension builds) runs each MoE layer's experts as one native
    # call (ops.moe_experts); the reference op set the per-expert path
    # (unless APPLIANCE_FUSED_LAYERS=0 turns the one-call paths off)
    ops = llm.engine.runner.ops
    one_call = hasattr(ops, "moe_experts") and ops.FUSED_LAYERS
    assert one_call == (backend == "auto" and native_available() and native_ops.FUSED_LAYERS)
    ran_native = [b.native_calls > 0 for b in _sparse_layers(model)]
    assert ran_native == [one_call] * len(ran_native), ran_native


def _assert_experts_chosen_at_their_rows(llm):
    """Every expert projection (float or quantized) has its method chosen at the rows an expert sees:
    top-2 of 8 experts, a quarter of the step's 1, 4, 16, 32 and 256 rows; the other layers at the step's."""
    model = llm.engine.runner.model
    experts = {id(lin) for b in _sparse_layers(model) for e in b.experts for lin in (e.gate_up_proj, e.down_proj)}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            assert m.probe_rows == ((1, 4, 8, 64) if id(m) in experts else None), name
    keys = llm.engine.runner.linear_backends
    assert any(k.endswith(" rows 1,4,8,64") for k in keys) and any(" rows " not in k for k in keys), keys


@pytest.mark.parametrize("linear", ["native", "onednn", "torch"])
def test_every_float_linear_backend_on_the_experts(tiny_model_dir, linear):
    """Experts are Linear layers: each float backend runs them (native with silu(gate) * up in its
    GEMM's epilogue), with transformers' greedy tokens and logits within 1e-4."""
    from helpers import skip_unless_backend

    skip_unless_backend(linear)
    path = tiny_model_dir("qwen2_moe")
    llm = LLM(str(path), dtype="float32", linear_backend=linear, num_kv_blocks=128)
    blocks = _sparse_layers(llm.engine.runner.model)
    experts = [m for b in blocks for m in list(b.experts) + [b.shared_expert]]
    assert {m.gate_up_proj.backend for m in experts} == {m.down_proj.backend for m in experts} == {linear}
    assert all(m.gate_up_proj.fused_silu_mul == (linear == "native") for m in experts)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    hf = _hf(path)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)] == \
        hf_greedy(hf, ids, MAX_NEW)
    for p in ids:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_experts_chosen_per_token_equal_transformers(tiny_model_dir, arch):
    """The router's top-k expert ids of every token in every sparse layer, hooked on both sides, are
    transformers' (as sets: the order within a token's top-k does not change its output), and the
    routing weights agree to float32 rounding."""
    path = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    hf = _hf(path)
    ours, theirs = [], []
    hooks = [b.gate.register_forward_hook(lambda m, i, o: ours.append(o)) for b in _sparse_layers(llm.engine.runner.model)]
    hooks += [layer.mlp.gate.register_forward_hook(lambda m, i, o: theirs.append(o)) for layer in hf.model.layers]
    tok = llm.get_tokenizer()
    try:
        for p in PROMPTS:
            ids = tok.encode(p)
            ours.clear(), theirs.clear()
            engine_logits(llm, ids)
            with torch.no_grad():
                hf(torch.tensor([ids]))
            assert len(ours) == len(theirs) == 2
            for (_, w, e), (_, hw, he) in zip(ours, theirs):
                assert e.shape == he.shape == (len(ids), 2)
                assert torch.equal(e.sort(-1).values, he.sort(-1).values)
                # pair each weight with its expert before comparing
                torch.testing.assert_close(w.gather(1, e.argsort(-1)), hw.float().gather(1, he.argsort(-1)),
                                           atol=1e-6, rtol=0)
    finally:
        for h in hooks:
            h.remove()


def _random_block(cfg: MoeConfig, dtype=torch.float64) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _per_token_reference(block: SparseMoeBlock, x: torch.Tensor, top_w: torch.Tensor,
                         top_e: torch.Tensor) -> torch.Tensor:
    """Test-only oracle, fp64: for each token, its top-k experts (``top_e``, weights ``top_w``)
    applied one at a time from their weights, weighted and summed (and the shared expert)."""
    x, top_w = x.double(), top_w.double()
    out = torch.zeros_like(x)

    def mlp(m, v):
        gu = m.gate_up_proj.weight.double()
        i = gu.shape[0] // 2
        return (torch.nn.functional.silu(v @ gu[:i].t()) * (v @ gu[i:].t())) @ m.down_proj.weight.double().t()

    for t in range(x.shape[0]):
        for j in range(top_e.shape[1]):
            out[t] += top_w[t, j] * mlp(block.experts[int(top_e[t, j])], x[t])
        if block.shared_expert is not None:
            g = torch.sigmoid(x[t] @ block.shared_expert_gate.weight.double()[0])
            out[t] += g * mlp(block.shared_expert, x[t])
    return out


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_per_token_loop(arch, tokens):
    """The grouped pass (sort once, each expert once on its rows, one index_add) in fp64 equals a
    per-token loop over each token's experts, to fp64 rounding; with 40 tokens over 16 experts every
    expert gets several rows, with 1 token most get none."""
    hf = dict(architectures=[arch], vocab_size=32, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
              num_local_experts=16, num_experts_per_tok=4, shared_expert_intermediate_size=56, norm_topk_prob=True)
    from appliance.models.moe import ARCHS

    cfg = MoeConfig.from_hf(hf, ARCHS[arch], arch)
    block = _random_block(cfg)
    x = torch.randn(tokens, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
    _, w, e = block.gate(x)
    # the routing itself: transformers' softmax -> top-k -> renormalize, here in fp64
    probs = torch.softmax(x @ block.gate.weight.t(), -1)
    want_w, want_e = torch.topk(probs, 4, dim=-1)
    want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(e, want_e)
    torch.testing.assert_close(w.double(), want_w, atol=1e-6, rtol=0)  # softmax in float32, as transformers
    want = _per_token_reference(block, x, w, e)
    calls = []
    for e in block.experts:  # each expert is called at most once per step
        e.register_forward_hook(lambda m, i, o: calls.append((id(m), i[0].shape[0])))
    got = _with_ops(reference_ops, block, x)
    assert len(calls) == len(set(c[0] for c in calls)) == len(set(want_e.flatten().tolist()))
    assert sum(c[1] for c in calls) == tokens * 4
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_grouped_experts_weights_dtype_as_transformers():
    """bfloat16: Qwen casts the routing weights to bf16 before weighting; Mixtral weights in float32
    and casts the product. grouped_experts follows the weights' dtype it is given."""
    experts = torch.nn.ModuleList([_Scale(2.0), _Scale(3.0)])
    x = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1]])
    w = torch.tensor([[0.3, 0.7]])
    got32 = grouped_experts(x, ids, w, experts)
    got16 = grouped_experts(x, ids, w.bfloat16(), experts)
    want32 = ((2 * x).float() * 0.3).bfloat16() + ((3 * x).float() * 0.7).bfloat16()
    want16 = (2 * x) * torch.tensor(0.3).bfloat16() + (3 * x) * torch.tensor(0.7).bfloat16()
    assert torch.equal(got32, want32) and torch.equal(got16, want16)
    assert got32.dtype == got16.dtype == torch.bfloat16


def _with_ops(ops, module, *args):
    """Call ``module`` as a model step does: with ``ops`` as the step's op set (modules read it from
    the forward context)."""
    with set_forward_context(ForwardContext(None, [], ops)):
        return module(*args)


class _Scale(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        return x * self.s


def _to_fused_3d(src, dst):
    """The same model with its experts saved as transformers holds them in memory: one
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] per layer."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".experts." in name:
            prefix, rest = name.split(".experts.")
            e, kind, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(e), {})[kind] = t
        else:
            out[name] = t
    for prefix, per in experts.items():
        n = len(per)
        gate = {"w1", "gate_proj"}
        up = {"w3", "up_proj"}
        down = {"w2", "down_proj"}
        pick = lambda d, names: next(v for k, v in d.items() if k in names)  # noqa: E731
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([pick(per[e], gate), pick(per[e], up)]) for e in range(n)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([pick(per[e], down) for e in range(n)])
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_fused_3d_expert_checkpoint_loads_the_same(tiny_model_dir, tmp_path, arch):
    src = tiny_model_dir(arch)
    fused = _to_fused_3d(src, tmp_path / "fused")
    names = load_file(str(fused / "model.safetensors")).keys()
    assert any(n.endswith("experts.gate_up_proj") for n in names) and not any(".experts.0." in n for n in names)
    a = LLM(str(src), dtype="float32", num_kv_blocks=64)
    b = LLM(str(fused), dtype="float32", num_kv_blocks=64)
    ids = a.get_tokenizer().encode(PROMPTS[1])
    assert torch.equal(engine_logits(a, ids), engine_logits(b, ids))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_bfloat16_within_bf16_error_of_transformers_bf16(tiny_model_dir, arch):
    """bfloat16 (routing weights cast as each family's router does): last-token logits within bf16's
    error of transformers' bf16 model (measured 0.6-1% of the logits' scale; 2^-8 per op over the
    layers), and the same top token."""
    path = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    for p in PROMPTS[:2]:
        ids = llm.get_tokenizer().encode(p)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, -1].float()
        got = engine_logits(llm, ids)
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        assert got.argmax() == want.argmax()


def test_fused_3d_expert_tensor_of_the_wrong_size_is_refused(tiny_model_dir, tmp_path):
    fused = _to_fused_3d(tiny_model_dir("qwen3_moe"), tmp_path / "fused")
    tensors = load_file(str(fused / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name] = tensors[name][:6]
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        LLM(str(fused), dtype="float32", num_kv_blocks=16)
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg and "6 experts" in msg and "expected 8" in msg, msg


# ---------------------------------------------------------------- every schedule

SHARED = "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2
SCHEDULES = {
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "prefix_cache": dict(),  # staggered: later requests hit the shared prefix's blocks
    "preemption": dict(num_kv_blocks=16, block_size=8),
}


@pytest.fixture(scope="module")
def moe_reference(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    ids = [tok.encode(t) for t in (SHARED + "Hello", SHARED + "def f(x)", "Hello", SHARED * 2 + "ünïcode ✓")]
    ids.append([rng.randrange(3, 384) for _ in range(50)])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return path, ids, [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids
                       for p in ids]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_same_tokens_under_any_schedule(moe_reference, name):
    from test_engine_invariance import run_engine

    path, ids, expected = moe_reference
    cfg = dict(dtype="float32", num_kv_blocks=512)
    cfg.update(SCHEDULES[name])
    engine = LLMEngine(EngineConfig(model=str(path), **cfg))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    stagger = 2 if name == "prefix_cache" else 0
    assert run_engine(engine, ids, params, stagger=stagger) == expected
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if name == "prefix_cache":
        assert engine.kv.pool.num_hits > 0


# ---------------------------------------------------------------- bad configs

@pytest.mark.parametrize("arch,field,value", [
    ("qwen2_moe", "hidden_act", "gelu"),
    ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "num_experts_per_tok", 9),
    ("qwen3_moe", "moe_intermediate_size", 0),
])
def test_unsupported_moe_config_is_refused(tiny_model_dir, tmp_path, arch, field, value):
    dst = shutil.copytree(tiny_model_dir(arch), tmp_path / "m")
    cfg = json.loads((dst / "config.json").read_text())
    cfg[field] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(dst), dtype="float32", num_kv_blocks=16)
    assert field in str(e.value) and str(value) in str(e.value)


# ---------------------------------------------------------------- quantized experts

QUANT_BACKENDS = [("w8a8", "w8a8_native"), ("w8a8", "w8a8_onednn"), ("w8a8", "w8a16_int8pack"),
                  ("w4a8", "w4a8_dynquant"), ("w4a8", "w4a16_int4pack")]


@pytest.mark.parametrize("scheme,backend", QUANT_BACKENDS)
def test_quantized_experts_match_their_methods_reference(scheme, backend):
    """Every expert (and the shared expert) quantized like any Linear (the router and the shared
    expert's gate stay float): the grouped pass equals a per-token loop over each token's experts
    in which every projection is the method's own fp64 reference (activation quantization included),
    within the tolerance of a chain of two quantized projections: fp32 accumulation plus, rarely, an
    intermediate activation rounded to the neighbouring int8 step (1e-3 of the output's scale; bf16
    routes 1e-2)."""
    from helpers import skip_unless_backend

    from appliance.layers import quant
    from appliance.models.moe import ARCHS

    skip_unless_backend(backend)
    hf = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=64,
              moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=96, norm_topk_prob=False)
    block = _random_block(MoeConfig.from_hf(hf, ARCHS["Qwen2MoeForCausalLM"], "Qwen2MoeForCausalLM"), torch.float32)
    quant.quantize_model(block, scheme, 32)
    layers = [m for m in block.modules() if isinstance(m, quant.QuantLinear)]
    assert len(layers) == 2 * 9 and isinstance(block.gate.weight, torch.nn.Parameter)
    canon = {id(m): (m.qweight.data.clone(), m.weight_scale.data.clone(),
                     None if m.weight_zero_point is None else m.weight_zero_point.data.clone()) for m in layers}
    for m in layers:
        m.set_backend(backend)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    _, w, e = block.gate(x)
    got = _with_ops(reference_ops, block, x)

    def proj(m, v):
        qw, s, zp = canon[id(m)]
        return quant.reference(backend, v.float(), qw, s, None, zp)

    def mlp(m, v):
        h = proj(m.gate_up_proj, v)
        i = h.shape[-1] // 2
        return proj(m.down_proj, torch.nn.functional.silu(h[:, :i]) * h[:, i:])

    want = torch.zeros(24, 64, dtype=torch.float64)
    for t in range(24):
        for j in range(2):
            want[t] += w[t, j].double() * mlp(block.experts[int(e[t, j])], x[t:t + 1])[0]
        g = torch.sigmoid(x[t].double() @ block.shared_expert_gate.weight.double()[0])
        want[t] += g * mlp(block.shared_expert, x[t:t + 1])[0]
    err = (got.double() - want).abs().max().item()
    # the int8pack/int4pack routes take bf16 activations and give bf16-rounded outputs (2^-9 relative
    # each, as tests/helpers.assert_matches_reference holds them): two in a chain, 1e-2 of the scale
    tol = 1e-2 if backend in ("w8a16_int8pack", "w4a16_int4pack") else 1e-3
    assert err <= tol * want.abs().max().item(), (backend, err)


def _dequantized_twin(hf, scheme):
    """transformers' model with every projection the engine quantizes (attention, each expert's
    slice of the 3-D expert tensors) replaced by its quantized-then-dequantized weight, as
    ``--quantization`` quantizes it (per channel W8; W4 on group-32 min/max grids); the routers, norms,
    embeddings and lm_head stay float."""
    from appliance.layers.quant import dequantize, quantize_int4, quantize_int8

    def qdq(w):
        parts = quantize_int8(w) if scheme == "w8a8" else quantize_int4(w, 32)
        return dequantize(*parts).float()

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for e in range(p.shape[0]):
                    p[e] = qdq(p[e])
            elif name.endswith("_proj.weight"):
                p.copy_(qdq(p))
    return hf


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_quantized_moe_model_in_the_engine(tiny_model_dir, scheme):
    """--quantization quantizes every expert like any projection (routers stay float). The engine's
    last-token logits equal transformers' model on the dequantized weights up to the per-token int8
    activations (the A8 of both schemes); its batched tokens equal its one-request-at-a-time tokens."""
    path = tiny_model_dir("qwen3_moe")
    llm = LLM(str(path), dtype="float32", quantization=scheme, num_kv_blocks=128)
    from appliance.layers.quant import QuantLinear

    model = llm.engine.runner.model
    for b in _sparse_layers(model):
        assert all(isinstance(m.gate_up_proj, QuantLinear) and isinstance(m.down_proj, QuantLinear)
                   and m.gate_up_proj.scheme == scheme for m in b.experts)
        assert b.gate.weight.dtype == torch.float32
    _assert_experts_chosen_at_their_rows(llm)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    hf = _dequantized_twin(_hf(path), scheme)
    for p in ids:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        got = engine_logits(llm, p)
        # measured here: 0.5-2% of the logits' scale (int8 activations); against the float weights
        # instead 1-3% (W8) and 12-31% (W4: the weights' own error on these tiny random models)
        assert (got - want).abs().max() <= 0.04 * want.abs().max(), (got - want).abs().max() / want.abs().max()
    one_by_one = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].outputs[0].token_ids for p in ids]
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)] == one_by_one


@pytest.mark.skipif(not native_available(), reason="needs the native kernels (python -m appliance.ops.native --build)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("scheme,backend", [("w8a8", "w8a8_native"), ("w4a8", "w4a8_native")])
def test_quantized_experts_one_region_gives_the_per_expert_tokens(tiny_model_dir, monkeypatch, arch, scheme, backend):
    """Quantized experts on the native W8A8 / W4A8 kernels run in one parallel region per layer
    (ops.moe_experts' moe_q: each token quantized once). The engine's greedy tokens (one request, and
    the prompts batched) and last-token logits equal the per-expert path's (FUSED_LAYERS off: each
    expert's QuantLinear on its rows): the same kernels' work items over the same rows."""
    path = tiny_model_dir(arch)
    # W4 groups of 16: Mixtral's tiny expert width (48) takes no default group of 32
    llm = LLM(str(path), dtype="float32", quantization=scheme, linear_backend=backend, num_kv_blocks=128,
              quant_group_size=16)
    model = llm.engine.runner.model
    assert all(lin.backend == backend for b in _sparse_layers(model) for e in b.experts
               for lin in (e.gate_up_proj, e.down_proj))
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]

    def run():
        batched = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)]
        single = llm.generate(prompt_token_ids=[ids[1]], sampling_params=GREEDY)[0].outputs[0].token_ids
        return batched, single, engine_logits(llm, ids[1])

    before = native_ops.moe_q_calls()
    one_region = run()
    assert native_ops.moe_q_calls() > before
    monkeypatch.setattr(native_ops, "FUSED_LAYERS", False)
    before = native_ops.moe_q_calls()
    per_expert = run()
    assert native_ops.moe_q_calls() == before
    assert one_region[0] == per_expert[0] and one_region[1] == per_expert[1]
    torch.testing.assert_close(one_region[2], per_expert[2], atol=1e-5 * per_expert[2].abs().max().item(), rtol=0)


# ---------------------------------------------------------------- GGUF

GGUF_VOCAB = 2048


@pytest.fixture(scope="module")
def gguf_vocab():
    """A valid 2048-token BPE cut from the default model's GGUF vocabulary (as tests/model/test_gguf.py)."""
    import gguf

    from appliance.models import default_model

    reader = gguf.GGUFReader(default_model.default_gguf_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:GGUF_VOCAB]
    kept = set(tokens)
    merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
              if (pair := m.split(" "))[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    return {"tokens": tokens, "merges": merges,
            "token_type": reader.fields["tokenizer.ggml.token_type"].contents()[:GGUF_VOCAB]}


def write_moe_gguf(hf_dir, path, vocab, expert_type: str | dict | None = None):
    """The HF Qwen3-MoE / Qwen2-MoE / Mixtral model at ``hf_dir`` as llama.cpp's convert script writes it (names
    from its src/llama-arch.cpp: ffn_gate_inp router, ffn_{gate,up,down}_exps 3-D [experts, n, k],
    *_shexp shared expert), every tensor F32 but the expert tensors, which are ``expert_type``
    (e.g. Q4_0) when given: one type, or per projection {"gate" | "up" | "down" or (layer, one of
    those): type}. K-quants (which gguf cannot quantize) are random blocks (gguf_files.random_blocks,
    weights ~0.03) in place of the model's values. Returns {GGUF name: the float32 values the file holds}."""
    import gguf
    import numpy as np

    from appliance.models import gguf_loader

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[cfg["model_type"]]
    hf = {}
    for k, v in load_file(str(hf_dir / "model.safetensors")).items():  # Mixtral's names as Qwen's
        for a, b in ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                     (".w2.", ".down_proj.")):
            k = k.replace(a, b)
        v = v.numpy()
        if arch == "llama" and k.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rotary pair order
            n = cfg["num_attention_heads" if "q_proj" in k else "num_key_value_heads"]
            v = v.reshape(n, 2, v.shape[0] // n // 2, *v.shape[1:]).swapaxes(1, 2).reshape(v.shape)
        hf[k] = v
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_type"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    to_gguf = {f"model.layers.{{}}.{v}": k for k, v in gguf_loader._LAYER_TENSORS.items()}
    written = {}

    rng = np.random.default_rng(0)

    def add(name, value, qtype=None):
        if qtype is None:
            w.add_tensor(name, value)
            written[name] = value
        else:
            t = gguf.GGMLQuantizationType[qtype]
            if qtype.endswith("_K"):
                from gguf_files import random_blocks

                rows = int(np.prod(value.shape[:-1]))
                blocks = random_blocks(qtype, rows, value.shape[-1], rng).reshape(*value.shape[:-1], -1)
            else:
                blocks = gguf.quants.quantize(value, t)
            w.add_tensor(name, blocks, raw_dtype=t)
            written[name] = gguf.quants.dequantize(blocks, t).reshape(value.shape)

    add("token_embd.weight", hf.pop("model.embed_tokens.weight"))
    add("output_norm.weight", hf.pop("model.norm.weight"))
    add("output.weight", hf.pop("lm_head.weight"))
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        for proj, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            names = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(n_exp)]
            if names[0] in hf:
                short = proj.split("_")[0]
                qtype = (expert_type.get((i, short), expert_type.get(short)) if isinstance(expert_type, dict)
                         else expert_type)
                add(f"blk.{i}.{gname}.weight", np.stack([hf.pop(n) for n in names]), qtype)
    for name, value in hf.items():
        i = name.split(".")[2]
        key = name.replace(f"model.layers.{i}.", "model.layers.{}.")
        add(f"blk.{i}.{to_gguf[key]}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_gguf_gives_the_hf_models_tokens(tiny_model_dir, tmp_path, gguf_vocab, arch):
    """A tiny Qwen3-MoE / Qwen2-MoE / Mixtral (llama with experts, q/k rows permuted) written as GGUF
    (float32 tensors) loads straight from the file and gives the HF model's greedy tokens and
    last-token logits (1e-4)."""
    src = tiny_model_dir(arch, vocab_size=GGUF_VOCAB)
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(src, path, gguf_vocab)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM) and len(_sparse_layers(model)) == 2
    rng = random.Random(1)
    ids = [[rng.randrange(3, GGUF_VOCAB) for _ in range(n)] for n in (5, 23, 1, 40)]
    hf = _hf(src)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, ids, MAX_NEW)
    for p in ids:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(engine_logits(llm, p), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q5_0"])
def test_moe_gguf_quantized_experts_load_as_they_are(tiny_model_dir, tmp_path, gguf_vocab, monkeypatch, qtype):
    """Quantized ffn_*_exps tensors load one expert at a time as their blocks (never quantized from a
    float matrix); the logits equal transformers' model holding the file's dequantized expert weights
    up to the experts' int8 activations (as test_quantized_moe_model_in_the_engine). Q5_0: the experts
    on ``w5a8_native`` (5 bits, the kernels' ``moe_q`` over them in one region)."""
    from helpers import skip_unless_backend

    from appliance.layers import quant

    if qtype == "Q8_0":
        skip_unless_backend("w8a8_native")  # the only method for a GGUF's W8 groups
    if qtype == "Q5_0":
        skip_unless_backend("w5a8_native")
    src = tiny_model_dir("qwen3_moe", vocab_size=GGUF_VOCAB)
    path = tmp_path / "q.gguf"
    written = write_moe_gguf(src, path, gguf_vocab, expert_type=qtype)

    def refuse(*a, **k):
        raise AssertionError("a layer was quantized from float")

    real = {name: getattr(quant, name) for name in ("quantize_int4", "quantize_int8")}
    real_measure = quant.QuantLinear.measure

    def measure(self, *a, **k):
        # timing a method (a shape whose choice is not cached yet) quantizes a random matrix of the
        # layer's shape, not the layer: allowed
        with monkeypatch.context() as m:
            for name, f in real.items():
                m.setattr(quant, name, f)
            return real_measure(self, *a, **k)

    monkeypatch.setattr(quant.QuantLinear, "measure", measure)
    monkeypatch.setattr(quant, "quantize_int4", refuse)
    monkeypatch.setattr(quant, "quantize_int8", refuse)
    # gguf: the file's quantized tensors as they are (W4 group 32, W8 group 32), the others float
    llm = LLM(str(path), dtype="float32", quantization="gguf", num_kv_blocks=128,
              linear_backend="w5a8_native" if qtype == "Q5_0" else "auto")
    scheme = "w4a8" if qtype == "Q4_0" else "w8a8"
    for b in _sparse_layers(llm.engine.runner.model):
        assert all(isinstance(m.gate_up_proj, quant.QuantLinear) and m.gate_up_proj.scheme == scheme
                   and m.gate_up_proj.group_size == 32 and isinstance(m.down_proj, quant.QuantLinear) for m in b.experts)
        if qtype == "Q5_0":
            assert all(m.gate_up_proj.backend == m.down_proj.backend == "w5a8_native" for m in b.experts)
    hf = _hf_holding(src, written)
    rng = random.Random(2)
    for n in (7, 30):
        p = [rng.randrange(3, GGUF_VOCAB) for _ in range(n)]
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        got = engine_logits(llm, p)
        assert (got - want).abs().max() <= 0.04 * want.abs().max(), (got - want).abs().max() / want.abs().max()
    if qtype == "Q5_0":  # the experts ran as one native call (moe_q over 5-bit tiles), not one call each
        assert sum(b.native_calls for b in _sparse_layers(llm.engine.runner.model)) > 0


@pytest.mark.skipif(not native_available(), reason="needs the native kernels (python -m appliance.ops.native --build)")
def test_moe_gguf_kquant_experts_run_in_one_region(tiny_model_dir, tmp_path, gguf_vocab, monkeypatch):
    """A Qwen3-MoE GGUF whose experts are K-quants as a Q4_K_M file holds them (ffn_gate/up_exps Q4_K;
    ffn_down_exps Q6_K in layer 0, Q4_K in layer 1): every expert keeps its K-quant scales, the layers run
    in moe_q's one region (its counter moves), and the engine's greedy tokens equal transformers' model
    holding the file's dequantized weights (its logits within the A8 activations' error, as
    test_moe_gguf_quantized_experts_load_as_they_are); the per-expert path gives the same tokens and
    logits (1e-5 of their scale)."""
    src = tiny_model_dir("qwen3_moe", vocab_size=GGUF_VOCAB, hidden_size=256, moe_intermediate_size=256)
    path = tmp_path / "q4_k_m.gguf"
    written = write_moe_gguf(src, path, gguf_vocab,
                             expert_type={"gate": "Q4_K", "up": "Q4_K", (0, "down"): "Q6_K", (1, "down"): "Q4_K"})
    llm = LLM(str(path), dtype="float32", quantization="gguf", num_kv_blocks=128)
    layers = _sparse_layers(llm.engine.runner.model)
    for b, down in zip(layers, ("w6a8_native", "w4a8_native")):
        for m in b.experts:
            assert m.gate_up_proj.backend == "w4a8_native" and m.down_proj.backend == down
            assert "kf" in m.gate_up_proj.packed and "kf" in m.down_proj.packed
    hf = _hf_holding(src, written)
    rng = random.Random(3)
    ids = [[rng.randrange(3, GGUF_VOCAB) for _ in range(n)] for n in (5, 23, 1, 40)]

    def run():
        toks = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)]
        return toks, [engine_logits(llm, p) for p in ids]

    before = native_ops.moe_q_calls()
    toks, logits = run()
    assert native_ops.moe_q_calls() > before
    assert toks == hf_greedy(hf, ids, MAX_NEW)
    for p, got in zip(ids, logits):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        assert (got - want).abs().max() <= 0.04 * want.abs().max(), (got - want).abs().max() / want.abs().max()
    monkeypatch.setattr(native_ops, "FUSED_LAYERS", False)
    before = native_ops.moe_q_calls()
    per_expert = run()
    assert native_ops.moe_q_calls() == before
    assert per_expert[0] == toks
    for a, b in zip(logits, per_expert[1]):
        torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=0)
