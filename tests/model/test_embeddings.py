"""Pooling runner (embeddings) against transformers' pooled final hidden states, float32, 1e-4."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from appliance import LLM, SamplingParams
from appliance.errors import InvalidRequestError, ModelLoadError
from appliance.pooling_params import PoolingParams
from tiny_models import make_tiny_base_model

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France. Hello world! Héllo wörld, ünïcode ✓ 東京 and a longer tail of words",
    "def f(x): return x * 2",
    "Hello",
]
ATOL = 1e-4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_tiny_base_model(tmp_path_factory.mktemp("emb") / f"{arch}-base", arch)
        return cache[arch]

    return get


def hf_pooled(path, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of one prompt, pooled."""
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].double()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
    return (torch.nn.functional.normalize(v, dim=-1) if normalize else v).float()


def check(outs, path, pooling, normalize):
    for o in outs:
        ref = hf_pooled(path, o.prompt_token_ids, pooling, normalize)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling,normalize", [("LAST", True), ("LAST", False), ("MEAN", True), ("MEAN", False),
                                               ("CLS", True)])
@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the native one-call decoder stack where built
def test_embeddings_match_transformers(base_dir, arch, pooling, normalize, backend):
    path = base_dir(arch)
    llm = LLM(str(path), dtype="float32", attention_backend=backend, num_kv_blocks=64,
              pooler_config={"pooling_type": pooling, "normalize": normalize})
    assert llm.engine.runner_type == "pooling"  # auto: a bare *Model is a pooling architecture
    outs = llm.embed(PROMPTS)
    assert [o.prompt for o in outs] == PROMPTS
    assert all(o.finished and o.outputs.hidden_size == 64 for o in outs)
    check(outs, path, pooling, normalize)
    model = llm.engine.runner.model
    if getattr(llm.engine.runner.ops, "FUSED_LAYERS", False):  # the one-call stack gave these hidden states
        assert model.__dict__["_fused_plan"][1] is not None
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_default_pooler_is_last_normalized_and_token_ids_work(base_dir):
    path = base_dir("qwen3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    one = llm.embed(ids)  # a single list of token ids is one prompt
    assert len(one) == 1 and one[0].prompt is None
    check(one, path, "LAST", True)
    assert abs(sum(x * x for x in one[0].outputs.embedding) - 1.0) < 1e-5


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_batched_and_chunked_prefill_give_the_same_vectors(base_dir, pooling):
    path = base_dir("llama")
    cfg = {"pooling_type": pooling, "normalize": False}
    big = LLM(str(path), dtype="float32", num_kv_blocks=64, pooler_config=cfg)
    singles = [big.embed(p)[0].outputs.embedding for p in PROMPTS]
    batched = [o.outputs.embedding for o in big.embed(PROMPTS)]
    # 7 tokens a step: the long prompt is pooled across several chunks, batched with the others
    small = LLM(str(path), dtype="float32", num_kv_blocks=64, pooler_config=cfg, max_num_batched_tokens=7)
    chunked = [o.outputs.embedding for o in small.embed(PROMPTS)]
    assert len(small.get_tokenizer().encode(PROMPTS[1])) > 3 * 7
    for s, b, c in zip(singles, batched, chunked):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(s), atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(c), torch.tensor(s), atol=ATOL, rtol=0)
    check(small.embed(PROMPTS), path, pooling, False)
    assert small.engine.stats["steps"] > len(PROMPTS)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_prefix_cache_keeps_every_position_pooling_needs(base_dir, pooling):
    """The same long prompt twice: LAST may reuse cached blocks, MEAN must not skip them; both equal
    transformers."""
    path = base_dir("llama")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4,
              pooler_config={"pooling_type": pooling, "normalize": False})
    first = llm.embed(PROMPTS[1])[0]
    second = llm.embed(PROMPTS[1])[0]
    assert (second.num_cached_tokens > 0) == (pooling == "LAST")
    check([first, second], path, pooling, False)


def test_causal_checkpoint_as_pooling_model_and_sentence_transformers_config(tmp_path, tiny_model_dir):
    """A Qwen3ForCausalLM run with runner=pooling: its lm_head is not loaded; the pooling mode and
    normalization come from sentence-transformers' modules.json unless --pooler-config says otherwise."""
    src = tiny_model_dir("qwen3")
    path = tmp_path / "st"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    assert LLM(str(path), dtype="float32", num_kv_blocks=16).engine.runner_type == "generate"  # auto
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, runner="pooling")
    assert not hasattr(llm.engine.runner.model, "lm_head")
    assert llm.engine.pooler_config.pooling_type == "MEAN" and llm.engine.pooler_config.normalize
    check(llm.embed(PROMPTS), path, "MEAN", True)
    over = LLM(str(path), dtype="float32", num_kv_blocks=64, runner="pooling",
               pooler_config='{"pooling_type": "LAST", "normalize": false}')
    check(over.embed(PROMPTS), path, "LAST", False)


def test_dimensions_truncate_then_normalize(base_dir):
    path = base_dir("llama")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.embed(ids, pooling_params=PoolingParams(dimensions=16))[0].outputs.embedding
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(out), torch.nn.functional.normalize(h[:16], dim=-1), atol=ATOL, rtol=0)
    with pytest.raises(InvalidRequestError, match="dimensions=65 exceeds the model's hidden size 64"):
        llm.embed(ids, pooling_params=PoolingParams(dimensions=65))
    trunc = llm.embed(ids, truncate_prompt_tokens=2)[0]
    assert trunc.prompt_token_ids == ids[-2:]


def test_runner_mismatches_are_refused(base_dir, llama_dir):
    path = base_dir("llama")
    with pytest.raises(ModelLoadError, match="LlamaModel is a pooling model"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, runner="generate")
    pool = LLM(str(path), dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="runner is pooling"):
        pool.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="max_model_len is 512"):
        pool.embed([[5] * 513])
    gen = LLM(str(llama_dir), dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="runner is generate"):
        gen.embed("Hello")
    with pytest.raises(InvalidRequestError, match="pooling_type must be one of LAST, MEAN, CLS"):
        LLM(str(path), pooler_config={"pooling_type": "max"})
    with pytest.raises(InvalidRequestError, match="runner must be one of auto, generate, pooling"):
        LLM(str(path), runner="embed")


def test_preempted_pooling_requests_recompute_to_the_same_vectors(base_dir):
    """A KV cache too small for every prompt at once: pooling requests are preempted mid-prompt and
    recomputed from position 0; the pooler restarts with them."""
    path = base_dir("llama")
    cfg = {"pooling_type": "MEAN", "normalize": False}
    prompts = [PROMPTS[1], PROMPTS[1] + " again", PROMPTS[0] * 3, PROMPTS[2] * 2]
    # 8-token chunks of all four admitted at once, then growing past 12 blocks of 4 tokens
    llm = LLM(str(path), dtype="float32", num_kv_blocks=12, block_size=4, long_prefill_token_threshold=8,
              pooler_config=cfg)
    outs = llm.embed(prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outs, path, "MEAN", False)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_qwen3_embedding_layout_causal_config_bare_tensors(base_dir, tmp_path):
    """Qwen3-Embedding's layout: config.json names Qwen3ForCausalLM, the tensors are a bare Qwen3Model's
    (no ``model.`` prefix, no lm_head). runner=pooling loads it."""
    src = base_dir("qwen3")
    path = tmp_path / "qwen3-embedding-layout"
    path.mkdir()
    for f in src.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, runner="pooling")
    check(llm.embed(PROMPTS), src, "LAST", True)
