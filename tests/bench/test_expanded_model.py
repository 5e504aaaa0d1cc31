"""``appliance.bench.expanded_model``: a widened Llama computes the function of the one it was widened
from. Held against transformers' own forward (float32) on both checkpoints, and through the engine
(greedy tokens identical); a control with the RMSNorm compensation left out must fail the same check,
so the comparison can tell a broken expansion from a working one."""
from __future__ import annotations

import json

import pytest
import torch

from appliance.bench.expanded_model import expand_llama, num_parameters

# tiny llama (conftest): hidden 64, 4 heads / 2 KV heads (head_dim 16), intermediate 128, 2 layers
NEW = dict(hidden_size=160, num_attention_heads=10, num_key_value_heads=5, intermediate_size=352,
           num_hidden_layers=3)
# float32 logits of order 1-10 after 2-3 layers; the expanded model sums over 2.5x more terms per dot
# product and its norms use rounded sqrt(64/160)-scaled weights, so rounding differs at ~1e-6 relative
TOL = 2e-4


def _last_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].double()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 7, 40)]


@pytest.mark.parametrize("tie", [False, True])
def test_expanded_logits_equal_the_original(tiny_model_dir, tmp_path, prompts, tie):
    src = tiny_model_dir("llama", tie=tie)
    out = expand_llama(src, tmp_path / "wide", NEW)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == \
        (160, 10, 5, 16)
    src_cfg = json.loads((src / "config.json").read_text())
    assert num_parameters(cfg) > 2.5 * num_parameters(src_cfg)
    for ids in prompts:
        want, got = _last_logits(src, ids), _last_logits(out, ids)
        assert want.abs().max() > 1.0  # logits far from uniform: a real comparison
        err = (got - want).abs().max().item()
        assert err <= TOL * want.abs().max().item(), (len(ids), err)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_without_norm_compensation_the_logits_differ(tiny_model_dir, tmp_path, prompts):
    """The control: the same widening without the RMSNorm scale and eps change is not function-
    preserving (every norm's output grows by sqrt(160/64)), and the check above sees it."""
    src = tiny_model_dir("llama")
    out = expand_llama(src, tmp_path / "wide", NEW, rescale_norms=False)
    want, got = _last_logits(src, prompts[2]), _last_logits(out, prompts[2])
    assert (got - want).abs().max().item() > 100 * TOL * want.abs().max().item()


def test_expansion_refuses_a_changed_gqa_group(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="GQA group"):
        expand_llama(tiny_model_dir("llama"), tmp_path / "w", dict(NEW, num_key_value_heads=2))


def test_engine_greedy_tokens_identical(tiny_model_dir, tmp_path, prompts):
    """Through the appliance engine (float32, its own kernels): the widened model's greedy tokens are
    the original's, with and without n-gram speculation on the widened one."""
    from appliance import LLM, SamplingParams

    src = tiny_model_dir("llama")
    out = expand_llama(src, tmp_path / "wide", NEW)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(src), dtype="float32", num_kv_blocks=256)
            .generate(prompt_token_ids=prompts, sampling_params=sp)]
    wide = LLM(str(out), dtype="float32", num_kv_blocks=256)
    got = [o.outputs[0].token_ids for o in wide.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert got == want
    spec = LLM(str(out), dtype="float32", num_kv_blocks=256,
               speculative_config={"method": "draft_model", "model": str(src), "num_speculative_tokens": 3,
                                   "cost_aware": False})
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert got == want
    # the original as the widened one's draft proposes the widened one's own argmax: all accepted
    assert spec.engine.spec.stats()["spec_decode_acceptance_rate"] == 1.0


def test_bench_spec_refuses_an_unknown_target(llama_dir):
    from typer.testing import CliRunner

    from appliance.cli import app

    for args in (["--target", "expanded-1b"], ["--target", "expanded-0.5b", "--model", str(llama_dir)]):
        res = CliRunner().invoke(app, ["bench", "spec", *args], catch_exceptions=False)
        assert res.exit_code == 2 and "--target must be expanded-0.5b" in res.output, res.output
