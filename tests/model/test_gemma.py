"""Gemma 2 and Gemma 3 (text) against transformers 5 on tiny random-weight models (float32): greedy tokens
identical to ``generate`` and last-token logits within 1e-4, with the reference and the native ops, under
chunked prefill, prefix caching and preemption; a Gemma 3 written as GGUF; configs the engine refuses."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from appliance import LLM, SamplingParams
from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.errors import ModelLoadError
from helpers import check_against_transformers, drive_engine, hf_greedy

WINDOW = 8  # most prompts (and every prompt with its 24 new tokens) run past the local layers' window
SHARED = "Paris is the capital of France. The quick brown fox jumps over the lazy dog. "
PROMPTS = [
    "The quick brown fox",
    SHARED + "Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words",
    "def f(x): return x * 2",
    "Hello",
    SHARED * 2 + "def f(x)",
]
MAX_NEW = 24
GLOBAL_LINEAR_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}
# name -> (tiny_models arch, tie, config overrides)
CASES = {
    # attention-logit soft-cap small enough to bite on these weights' scores (Gemma 2's own is 50)
    "gemma2": ("gemma2", False, dict(sliding_window=WINDOW, attn_logit_softcapping=1.5)),
    "gemma2_tied_softcap": ("gemma2", True, dict(sliding_window=WINDOW, attn_logit_softcapping=1.5,
                                                 final_logit_softcapping=2.0)),
    # transformers' Gemma 2 defaults: soft-caps 50 and 30
    "gemma2_default_caps": ("gemma2", False, dict(sliding_window=WINDOW)),
    "gemma3": ("gemma3", False, dict(sliding_window=WINDOW)),
    # tied, final soft-cap, linear rope scaling on the global layers only, 3 layers: local, global, local
    "gemma3_tied_scaled": ("gemma3", True, dict(sliding_window=WINDOW, final_logit_softcapping=3.0,
                                                rope_parameters=GLOBAL_LINEAR_ROPE, num_hidden_layers=3,
                                                layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"])),
    # Gemma3ForConditionalGeneration: the text model, its vision tower in the checkpoint but not loaded
    "gemma3_mm": ("gemma3_mm", True, dict(sliding_window=WINDOW)),
    # every layer local: blocks before the window are read by no layer, and the engine frees them
    "gemma3_all_local": ("gemma3", False, dict(sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "sliding_attention"])),
}


def _model(tiny_model_dir, name):
    arch, tie, kw = CASES[name]
    return tiny_model_dir(arch, tie, 2, **kw)


def _assert_matches(llm, path, ids):
    check_against_transformers(llm, path, ids, MAX_NEW)


def _backend(name: str) -> str:
    if name == "native":
        from appliance.ops import native

        if not native.is_available():
            pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    return name


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_greedy_and_logits_match_transformers(tiny_model_dir, case, backend):
    path = _model(tiny_model_dir, case)
    llm = LLM(str(path), dtype="float32", attention_backend=_backend(backend), num_kv_blocks=128)
    assert llm.engine.runner.ops.__name__ == f"appliance.ops.{backend}"
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    _assert_matches(llm, path, ids)


def _run(engine, ids, params, stagger):
    return drive_engine(engine, ids, params, stagger)


SCHEDULES = {
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "prefix_caching": dict(enable_prefix_caching=True),
    "preemption": dict(num_kv_blocks=12, block_size=8),
    "preemption_chunked_block1": dict(num_kv_blocks=110, block_size=1, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("case", ["gemma2", "gemma3_tied_scaled", "gemma3_all_local"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_same_tokens_under_any_schedule(tiny_model_dir, case, schedule):
    path = _model(tiny_model_dir, case)
    cfg = dict(dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    cfg.update(SCHEDULES[schedule])
    engine = LLMEngine(EngineConfig(model=str(path), **cfg))
    # windows reach the runner: only a model whose every layer is local lets the engine free blocks
    assert engine.runner.sliding_window == (WINDOW if case == "gemma3_all_local" else None)
    tok = engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS] + [tok.encode(SHARED * 2 + "Hello")]
    ids.append([random.Random(0).randrange(3, 384) for _ in range(70)])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = _run(engine, ids, params, stagger=3 if schedule == "prefix_caching" else 0)
    _, want = hf_greedy(path, ids, 20)
    assert got == want
    if schedule.startswith("preemption") and case != "gemma3_all_local":
        assert engine.scheduler.num_preemptions > 0
    if schedule == "preemption" and case == "gemma3_all_local":
        # the pool that preempts the others is enough here: blocks before the window were freed
        assert engine.scheduler.num_preemptions == 0
    if schedule == "prefix_caching":
        assert engine.kv.pool.num_hits > 0  # the SHARED prompts reuse each other's full blocks


def test_gguf_round_trip(tiny_model_dir, tmp_path):
    """A tiny Gemma 3 written as GGUF the way llama.cpp's converter writes it (norms as 1 + w, the window,
    the local rope base, the final soft-cap) loads from the file and gives the HF model's tokens and
    logits; every norm multiplies by exactly the factor the file stores."""
    from gguf import GGUFReader

    from appliance.bench.gguf_export import write_gguf
    from appliance.layers.norm import OffsetRMSNorm

    # llama.cpp's softmax scale is 1/sqrt(head_dim): the GGUF has no query_pre_attn_scalar
    path = tiny_model_dir("gemma3", False, 2, sliding_window=WINDOW, query_pre_attn_scalar=16,
                          final_logit_softcapping=3.0, num_hidden_layers=3,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    gguf_path = write_gguf(path, tmp_path / "gemma3.gguf")
    reader = GGUFReader(gguf_path)
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors if t.name.endswith("norm.weight")}
    assert "blk.0.post_ffw_norm.weight" in stored and "blk.1.attn_q_norm.weight" in stored
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=128)
    info = llm.engine.info
    assert info.architecture == "Gemma3ForCausalLM"
    assert info.hf_config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert info.hf_config["final_logit_softcapping"] == 3.0
    model = llm.engine.runner.model
    norms = {n: m for n, m in model.named_modules() if isinstance(m, OffsetRMSNorm)}
    assert torch.equal(norms["model.layers.0.post_feedforward_layernorm"].scale, stored["blk.0.post_ffw_norm.weight"])
    assert torch.equal(norms["model.layers.1.self_attn.q_norm"].scale, stored["blk.1.attn_q_norm.weight"])
    assert torch.equal(norms["model.norm"].scale, stored["output_norm.weight"])
    _assert_matches(llm, path, [llm.get_tokenizer().encode(p) for p in PROMPTS])


def test_gemma2_gguf_round_trip(tiny_model_dir, tmp_path):
    """A tiny Gemma 2 written as GGUF as llama.cpp's converter writes it (norms as 1 + w, the window and
    both soft-caps in the metadata; the layer pattern and softmax scale are llama.cpp's fixed ones) loads
    from the file as Gemma2ForCausalLM and gives the HF model's tokens and logits."""
    from gguf import GGUFReader

    from appliance.bench.gguf_export import write_gguf

    path = tiny_model_dir("gemma2", False, 2, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                          attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    gguf_path = write_gguf(path, tmp_path / "gemma2.gguf")
    meta = {f.name: f.contents() for f in GGUFReader(gguf_path).fields.values() if f.name.startswith("gemma2.")}
    assert meta["gemma2.attention.sliding_window"] == WINDOW and meta["gemma2.attn_logit_softcapping"] == 1.5
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=128)
    info = llm.engine.info
    assert info.architecture == "Gemma2ForCausalLM"
    assert info.hf_config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (info.hf_config["attn_logit_softcapping"], info.hf_config["final_logit_softcapping"]) == (1.5, 2.0)
    _assert_matches(llm, path, [llm.get_tokenizer().encode(p) for p in PROMPTS])


def _edited(src, dst, edit, key=None):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg if key is None else cfg[key])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case,field,value,fragment", [
    ("gemma3", "hidden_activation", "relu", "hidden_activation 'relu' is not supported"),
    ("gemma3", "use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
    ("gemma2", "layer_types", ["sliding_attention", "chunked_attention"], "layer_types must name 2 layers"),
    ("gemma2", "attn_logit_softcapping", -1.0, "attn_logit_softcapping must be positive"),
    ("gemma3", "rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                      "rope_theta": 1e6}}, "rope_scaling.rope_type='dynamic' is not supported"),
    ("gemma3_mm", "hidden_activation", "silu", "config.json: text_config: hidden_activation 'silu'"),
    ("gemma3", "attention_sinks", True, "attention_sinks=True: attention sinks are not supported"),
    ("gemma2", "partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 is not supported"),
])
def test_unsupported_config_is_refused_naming_the_field(tiny_model_dir, tmp_path, case, field, value, fragment):
    src = _model(tiny_model_dir, case)
    dst = _edited(src, tmp_path / "m", lambda c: c.__setitem__(field, value),
                  "text_config" if case == "gemma3_mm" else None)
    with pytest.raises(ModelLoadError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        LLM(str(dst), dtype="float32", num_kv_blocks=16)


def test_end_of_turn_token_stops_generation(tiny_model_dir, tmp_path):
    """Gemma's <end_of_turn> is a stop id even when generation_config.json lists only <eos>: a model whose
    first greedy token is <end_of_turn> finishes there with "stop" (and runs on with ignore_eos); a Llama
    with the same tokenizer does not stop on it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    stops = {}
    for arch in ("gemma3", "llama"):
        dst = tmp_path / arch
        shutil.copytree(tiny_model_dir(arch, False, 2), dst)
        tok = AutoTokenizer.from_pretrained(str(dst))
        tok.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
        tok.save_pretrained(str(dst))
        eot = tok.convert_tokens_to_ids("<end_of_turn>")
        assert eot < 384  # a new id within the model's rows (the tiny BPE vocabulary leaves some unused)
        prompt = tok.encode("Paris is the capital of France.")
        first = hf_greedy(dst, [prompt], 1)[1][0][0]
        sd = load_file(str(dst / "model.safetensors"))
        sd["lm_head.weight"][eot] = 2 * sd["lm_head.weight"][first]  # <end_of_turn> now wins the first step
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
        assert hf_greedy(dst, [prompt], 1)[1][0] == [eot]
        llm = LLM(str(dst), dtype="float32", num_kv_blocks=16)
        stops[arch] = llm.engine.eos_token_ids
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6))
        done = out[0].outputs[0]
        if arch == "gemma3":
            assert done.finish_reason == "stop" and done.token_ids[:1] in ([], [eot]) and len(done.token_ids) <= 1
        else:
            assert done.finish_reason == "length" and done.token_ids[0] == eot
        out = llm.generate(prompt_token_ids=[prompt],
                           sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert out[0].outputs[0].finish_reason == "length" and out[0].outputs[0].token_ids[0] == eot
    assert eot in stops["gemma3"] and eot not in stops["llama"] and 2 in stops["gemma3"]
