"""vLLM compatibility of a live `appliance serve` (tiny llama, float32), driven with the official
`openai` client and httpx: several served names and API keys, CORS, --root-path, HTTPS, the vllm:
metrics, GET /v1/models/{id}, the probe 400s, prompt_logprobs, unknown request fields and the
model's generation defaults. Expected values come from the offline engine on the same model."""
from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from appliance import LLM, SamplingParams

NAMES = ("tiny", "tiny-alias")
KEYS = ("key-one", "key-two")
ORIGIN = "http://ui.example"
PROMPT = "The quick brown fox"
# the model's generation defaults: top_k=1 makes every sample the greedy one; max_new_tokens caps
GEN_DEFAULTS = {"top_k": 1, "max_new_tokens": 6, "temperature": 0.7}


@pytest.fixture(scope="module")
def model_dir(server_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gen") / "tiny-gen"
    shutil.copytree(server_model_dir, d)
    cfg = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").exists() else {}
    cfg.update(GEN_DEFAULTS)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    srv = start_server(model_dir, "--served-model-name", NAMES[0], "--served-model-name", NAMES[1],
                       "--api-key", KEYS[0], "--api-key", KEYS[1], "--allowed-origins", ORIGIN,
                       "--root-path", "/api", "--dtype", "float32", "--num-gpu-blocks-override", "256",
                       "--uvicorn-log-level", "warning")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[1], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


# -- names, keys, CORS, root path ----------------------------------------------------------------
def test_every_served_name_answers_first_is_reported(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.model == name
    # no model in the request: the first name is reported (the openai client always sends one)
    r = httpx.post(f"{client.base_url}completions", json={"prompt": PROMPT, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]


def test_any_api_key_authorises(server):
    for key in KEYS:
        assert httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": f"Bearer {KEYS[0]}x"}):
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_root_path_keeps_routes_and_auth(server, http):
    # uvicorn puts --root-path in front of every path; routes and the API-key check still match
    assert http.get("/v1/models").status_code == 200
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.post(f"{server.base_url}/tokenize", json={"prompt": "x"}).status_code == 401
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "/api/v1/nope" in r.json()["error"]["message"]


def test_cors_preflight_and_simple_request(server, http):
    r = httpx.options(f"{server.base_url}/v1/chat/completions",
                      headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    # another origin gets no CORS grant
    r = httpx.options(f"{server.base_url}/v1/models",
                      headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


# -- GET /v1/models/{id} ------------------------------------------------------------------------
def test_model_retrieve(client, http):
    for name in NAMES:
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "appliance")
        assert m.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    body = http.get("/v1/models/no-such-model").json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "'no-such-model'" in body["error"]["message"] and body["error"]["code"] == "model_not_found"
    assert e.value.status_code == 404


# -- probes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_probe_400s(http, path, body):
    r = http.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = http.post(path, json={**body, "max_tokens": 2, "stream": False, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    for seed in (2**63, -(2**63) - 1, 10**30):
        r = http.post(path, json={**body, "max_tokens": 2, "seed": seed})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "seed", r.text
        assert str(2**63 - 1) in err["message"] and str(seed) in err["message"]
    for seed in (2**63 - 1, -(2**63)):  # the ends of the range are accepted
        assert http.post(path, json={**body, "max_tokens": 2, "seed": seed}).status_code == 200
    r = http.post(path, json={**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


# -- prompt_logprobs ----------------------------------------------------------------------------
def _check_prompt_logprobs(got, ids, want, k, tok):
    assert len(got) == len(ids) == len(want)
    assert got[0] is None and want[0] is None
    for pos in range(1, len(ids)):
        entry, ref = got[pos], want[pos]
        assert list(entry)[0] == str(ids[pos])  # the prompt token first, as vLLM
        ranked = sorted(ref.items(), key=lambda kv: -kv[1])
        top = [t for t, _ in ranked if t != ids[pos] or len(ref) == k][:k]
        assert {int(t) for t in entry} == set(top) | {ids[pos]}
        for t, v in entry.items():
            assert v["logprob"] == pytest.approx(ref[int(t)], abs=1e-4)
            assert v["decoded_token"] == tok.decode([int(t)])
        for r, t in enumerate(top, start=1):
            assert entry[str(t)]["rank"] == r
        if ids[pos] not in top:
            assert entry[str(ids[pos])]["rank"] is None


def test_prompt_logprobs_completions_match_offline(http, offline, tok):
    k = 3
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ids = tok.encode(PROMPT)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))[0]
    _check_prompt_logprobs(got, ids, ref.prompt_logprobs, k, tok)
    # without the field, no prompt_logprobs key (as before)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert "prompt_logprobs" not in r.json()["choices"][0]


def test_prompt_logprobs_chat_match_offline(http, offline, tok):
    k = 2
    messages = [{"role": "user", "content": "Hello there"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": k})
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))[0]
    _check_prompt_logprobs(got, ref.prompt_token_ids, ref.prompt_logprobs, k, tok)


# -- unknown request fields ----------------------------------------------------------------------
def test_unknown_fields_logged_once_and_result_changing_ones_refused(server, http):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        r = http.post("/v1/completions", json={**body, "some_new_field": 1, "prediction": {"type": "content"}})
        assert r.status_code == 200, r.text
    log = server.output()
    assert log.count("ignoring unknown request field 'some_new_field'") == 1, log
    assert log.count("ignoring unknown request field 'prediction'") == 1
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, extra, param in [
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ]:
        r = http.post(path, json={**(body if path == "/v1/completions" else chat), **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and f"'{param}'" in err["message"], r.text
    # the same fields with values that change nothing are accepted
    r = http.post("/v1/chat/completions", json={**chat, "modalities": ["text"], "use_beam_search": False})
    assert r.status_code == 200, r.text


# -- generation defaults -------------------------------------------------------------------------
def test_generation_defaults_from_the_model(server, client, offline):
    assert "Default sampling parameters from the model: {'temperature': 0.7, 'top_k': 1, 'max_tokens': 6}" \
        in server.output()
    greedy = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    # no sampling fields: top_k=1 from the model makes sampling greedy; max_new_tokens caps the length
    r = client.completions.create(model=NAMES[0], prompt=PROMPT, n=3, max_tokens=50, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [greedy.text] * 3
    assert r.usage.completion_tokens == 3 * 6
    # the request's own top_k wins: sampled continuations at temperature 5 differ from greedy
    r = client.completions.create(model=NAMES[0], prompt=PROMPT, n=4, temperature=5.0, seed=7, max_tokens=6,
                                  extra_body={"top_k": 0, "ignore_eos": True})
    assert any(c.text != greedy.text for c in r.choices)


def test_offline_default_sampling_params(model_dir, offline):
    sp = offline.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.7, 1, 6)
    assert offline.default_sampling == {"temperature": 0.7, "top_k": 1, "max_tokens": 6}
    out = offline.generate([PROMPT] * 2)  # no params: the model's defaults (greedy through top_k=1)
    greedy = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert [o.outputs[0].text for o in out] == [greedy.text] * 2
    plain = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert plain.default_sampling == {} and plain.get_default_sampling_params() == SamplingParams()


# -- metrics ------------------------------------------------------------------------------------
def parse_exposition(text: str) -> tuple[dict, dict]:
    """({metric: type}, {(sample name, labels): value}) of the Prometheus text format."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$', line)
            assert m, f"not a sample line: {line!r}"
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            samples[(m.group(1), labels)] = float(m.group(3))
    return types, samples


VLLM_CORE = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter", "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
}


def test_vllm_metrics(http, tok):
    before_types, before = parse_exposition(http.get("/metrics").text)
    for name, kind in VLLM_CORE.items():
        assert before_types.get(name) == kind, (name, before_types.get(name))
    lab = (("model_name", NAMES[0]),)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    _, after = parse_exposition(http.get("/metrics").text)

    def delta(name, labels=lab):
        return after[(name, labels)] - before.get((name, labels), 0)

    n_prompt = len(tok.encode(PROMPT))
    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", tuple(sorted(lab + (("finished_reason", "length"),)))) == 1
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(f"{h}_count") == 1, h
        assert after[(f"{h}_bucket", tuple(sorted(lab + (("le", "+Inf"),))))] == after[(f"{h}_count", lab)]
    # per output token interval: 5 tokens, 4 gaps
    assert delta("vllm:time_per_output_token_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_prompt_tokens_sum") == n_prompt
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert delta("vllm:request_queue_time_seconds_sum") <= delta("vllm:time_to_first_token_seconds_sum")
    assert 0 <= after[("vllm:kv_cache_usage_perc", lab)] <= 1
    assert delta("vllm:prefix_cache_queries_total") >= n_prompt


# -- HTTPS ----------------------------------------------------------------------------------------
def _self_signed(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    try:
        from cryptography import x509  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return key, cert
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID
    import ipaddress

    k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now)
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .sign(k, hashes.SHA256()))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    return key, cert


def test_https(start_server, server_model_dir, tmp_path):
    key, cert = _self_signed(tmp_path)
    srv = start_server(server_model_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--dtype", "float32",
                       "--num-kv-blocks", "64", "--served-model-name", "tiny", tls_ca=str(cert))
    try:
        assert srv.base_url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as h:
            c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, http_client=h)
            r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
            assert r.usage.completion_tokens == 3
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(srv.base_url.replace("https://", "http://") + "/health", timeout=5)
        assert "https://127.0.0.1" in srv.output()
    finally:
        assert srv.stop() == 0, srv.output()


def test_prompt_logprobs_with_echo_keeps_echo_logprobs_width(http):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    both = http.post("/v1/completions", json={**body, "prompt_logprobs": 4}).json()["choices"][0]
    assert both["logprobs"] == plain["logprobs"]  # echo's top_logprobs still hold logprobs=1 alternatives
    assert all(len(e) >= 4 for e in both["prompt_logprobs"][1:])
