"""/v1/embeddings against live `appliance serve --runner pooling` subprocesses (tiny Qwen3Model and
LlamaModel, float32), with the official `openai` client and httpx. Expected vectors are transformers'
pooled final hidden states (1e-4)."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from appliance.server.serving_embeddings import encode_base64
from tiny_models import make_tiny_base_model

NAME = "tiny-embed"
TEXTS = ["The quick brown fox", "Paris is the capital of France. Hello world! and a longer tail of words", "Hi"]
ATOL = 1e-4


def hf_pooled(path, ids, pooling: str, normalize: bool) -> np.ndarray:
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].double()
    v = h[-1] if pooling == "LAST" else h.mean(0)
    return (torch.nn.functional.normalize(v, dim=-1) if normalize else v).float().numpy()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = make_tiny_base_model(tmp_path_factory.mktemp("embsrv") / "qwen3-base", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32, 64]  # what vLLM reads to allow `dimensions`
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def llama_base_dir(tmp_path_factory):
    return make_tiny_base_model(tmp_path_factory.mktemp("embsrv") / "llama-base", "llama")


def _stopped_clean(srv):
    code = srv.stop()
    assert code == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def last_server(start_server, qwen3_dir):
    """auto runner: Qwen3Model is a pooling architecture; default pooler LAST + normalize."""
    srv = start_server(qwen3_dir, "--served-model-name", NAME, "--dtype", "float32", "--num-kv-blocks", "64",
                       "--max-model-len", "64")
    yield srv
    _stopped_clean(srv)


@pytest.fixture(scope="module")
def mean_server(start_server, llama_base_dir):
    """MEAN, not normalized, 8 tokens a step: long inputs are pooled across chunks."""
    srv = start_server(llama_base_dir, "--served-model-name", NAME, "--dtype", "float32", "--num-kv-blocks", "64",
                       "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}',
                       "--max-num-batched-tokens", "8")
    yield srv
    _stopped_clean(srv)


def _client(srv):
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _tok(path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_float_and_base64_match_transformers(last_server, qwen3_dir):
    client, tok = _client(last_server), _tok(qwen3_dir)
    flt = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    # no encoding_format: the official client asks for base64 itself and decodes it (numpy float32)
    b64 = client.embeddings.create(model=NAME, input=TEXTS)
    explicit = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")  # returned as sent
    assert flt.object == "list" and flt.model == NAME and [d.index for d in flt.data] == [0, 1, 2]
    ids = [tok.encode(t) for t in TEXTS]
    assert flt.usage.prompt_tokens == flt.usage.total_tokens == sum(map(len, ids))
    for d_f, d_b, d_e, p in zip(flt.data, b64.data, explicit.data, ids):
        ref = hf_pooled(qwen3_dir, p, "LAST", True)
        np.testing.assert_allclose(np.array(d_f.embedding), ref, atol=ATOL, rtol=0)
        # separate requests may batch differently (other GEMM shapes): equal within the tolerance
        np.testing.assert_allclose(np.array(d_b.embedding), ref, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(d_e.embedding), dtype="<f4"), ref, atol=ATOL, rtol=0)
    # the wire form itself: base64 of little-endian float32
    raw = httpx.post(f"{last_server.base_url}/v1/embeddings",
                     json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, np.array(flt.data[0].embedding), atol=ATOL, rtol=0)


def test_base64_is_little_endian_float32_bytes():
    v = [1.0, -2.5, 3.25e-8, float(np.float32(0.1))]
    assert base64.b64decode(encode_base64(v)) == np.array(v, dtype="<f4").tobytes()


def test_token_id_inputs_and_batching_equal_one_at_a_time(last_server, qwen3_dir):
    client, tok = _client(last_server), _tok(qwen3_dir)
    ids = [tok.encode(t) for t in TEXTS]
    one_list = client.embeddings.create(model=NAME, input=ids[1], encoding_format="float")
    assert len(one_list.data) == 1 and one_list.usage.prompt_tokens == len(ids[1])
    many = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    singles = [client.embeddings.create(model=NAME, input=t, encoding_format="float").data[0].embedding
               for t in TEXTS]
    np.testing.assert_allclose(np.array(one_list.data[0].embedding), np.array(singles[1]), atol=ATOL, rtol=0)
    for d, s in zip(many.data, singles):
        np.testing.assert_allclose(np.array(d.embedding), np.array(s), atol=ATOL, rtol=0)


def test_matryoshka_dimensions(last_server, qwen3_dir):
    client, tok = _client(last_server), _tok(qwen3_dir)
    out = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    model = transformers.AutoModel.from_pretrained(str(qwen3_dir), dtype=torch.float32)
    with torch.no_grad():
        h = model(torch.tensor([tok.encode(TEXTS[0])])).last_hidden_state[0, -1, :16]
    np.testing.assert_allclose(np.array(out.data[0].embedding), torch.nn.functional.normalize(h, dim=-1).numpy(),
                               atol=ATOL, rtol=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=20)
    assert e.value.body["param"] == "dimensions" and "[16, 32, 64]" in e.value.body["message"]


@pytest.mark.parametrize("body,param,needle", [
    ({"input": ""}, "input", "input[0] is empty"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [[1, 2], [99999]]}, "input", "input[1]: token ids must be in [0, 384)"),
    ({"input": [[7] * 10, [6] * 64, [5] * 65]}, "input", "input[2] is 65 tokens; this model's maximum context "
                                                         "length (max_model_len) is 64"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "invalid value"),
    ({"input": "hi", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "[1, 64]"),
    ({"input": "hi", "model": "nope"}, "model", "does not exist"),
])
def test_bad_input_400s_and_server_keeps_serving(last_server, body, param, needle):
    r = httpx.post(f"{last_server.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    ok = httpx.post(f"{last_server.base_url}/v1/embeddings", json={"input": "still serving"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64


def test_truncate_prompt_tokens_keeps_the_last_tokens(last_server):
    long = [5 + i % 50 for i in range(100)]
    r = httpx.post(f"{last_server.base_url}/v1/embeddings",
                   json={"input": long, "truncate_prompt_tokens": 10}, timeout=60).json()
    ref = httpx.post(f"{last_server.base_url}/v1/embeddings", json={"input": long[-10:]}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == 10
    np.testing.assert_allclose(r["data"][0]["embedding"], ref["data"][0]["embedding"], atol=ATOL, rtol=0)


def test_generation_routes_refused_on_pooling_runner(last_server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(f"{last_server.base_url}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "The model does not support" in r.json()["error"]["message"]
        assert "--runner pooling" in r.json()["error"]["message"]


def test_mean_pooling_chunked_prefill_and_no_matryoshka(mean_server, llama_base_dir):
    client, tok = _client(mean_server), _tok(llama_base_dir)
    out = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    for d, t in zip(out.data, TEXTS):
        ids = tok.encode(t)
        np.testing.assert_allclose(np.array(d.embedding), hf_pooled(llama_base_dir, ids, "MEAN", False),
                                   atol=ATOL, rtol=0)
    assert len(tok.encode(TEXTS[1])) > 2 * 8  # pooled across three or more steps
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input="hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    assert "does not support matryoshka" in e.value.body["message"]


def test_embeddings_refused_on_generate_runner(start_server, llama_dir):
    srv = start_server(llama_dir, "--dtype", "float32", "--num-kv-blocks", "16")
    try:
        r = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": "hi"}, timeout=60)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "The model does not support Embeddings API" in msg and "--runner generate" in msg
        ok = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
    finally:
        _stopped_clean(srv)
