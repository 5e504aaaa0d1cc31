"""The OpenAI-compatible server against a live `appliance serve` subprocess (tiny llama, float32),
driven with the official `openai` client and plain httpx. Expected values come from the offline
engine (`appliance.LLM`) on the same model and from the tokenizer."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

import appliance
from appliance import LLM, SamplingParams

NAME = "tiny"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(start_server, server_model_dir):
    srv = start_server(server_model_dir, "--served-model-name", NAME, "--dtype", "float32",
                       "--num-kv-blocks", "256", "--max-num-seqs", "64")
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
    log = srv.output()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server_model_dir):
    return AutoTokenizer.from_pretrained(str(server_model_dir))


@pytest.fixture(scope="module")
def offline(server_model_dir):
    return LLM(str(server_model_dir), dtype="float32", num_kv_blocks=256)


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def metrics(http) -> dict[str, float]:
    """First sample of every metric name (labels dropped, except finished_reason)."""
    out = {}
    text = http.get("/metrics").text
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$', line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        r = re.search(r'finished_reason="(\w+)"', labels)
        if r:
            name = f"{name}[{r.group(1)}]"
        if name.endswith("_bucket"):
            continue
        out.setdefault(name, value)
    return out


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- basics ---------------------------------------------------------------------------------------
def test_models_health_version(http, client):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": appliance.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_matches_offline_engine(client, tok, offline):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline.generate(PROMPT, greedy(max_tokens=12))[0].outputs[0]
    c = r.choices[0]
    assert c.text == ref.text
    assert c.finish_reason == ("length" if len(ref.token_ids) == 12 else "stop")
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT)) == len(offline.engine.tokenize(PROMPT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")


def test_max_tokens_gives_length(client):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_completion_stream_concatenates_to_non_stream(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0.9, seed=1234)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_stream_wire_format(http):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.strip().split("\n\n"))
    events = sse_events(raw.split("\n"))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])


def test_chat_and_chat_stream(client, tok, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    flat = [messages[0], {"role": "user", "content": "Hello\nworld"}]
    ids = offline.apply_chat_template(flat)
    assert r.usage.prompt_tokens == len(ids)
    ref = offline.chat(flat, greedy(max_tokens=10))[0].outputs[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason in ("length", "stop")

    seeded = dict(model=NAME, messages=flat, max_completion_tokens=16, temperature=1.0, seed=99)
    full = client.chat.completions.create(**seeded)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **seeded))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens <= 16
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_n_greater_than_one(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 30
    assert len({c.text for c in r.choices}) > 1  # independent samples (seeds 7, 8, 9)
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    # streamed: every choice index appears and concatenates to the same text
    texts = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=6, seed=3, temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_multiple_prompts(client, offline):
    prompts = ["Paris is", "Hello world"]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    refs = offline.generate(prompts, greedy(max_tokens=6))
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    texts = {}
    for ch in client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[0], texts[1]] == [c.text for c in r.choices]
    ids = offline.engine.tokenize("Paris is")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == refs[0].outputs[0].text


def test_completion_logprobs_match_offline(client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ref = offline.generate(PROMPT, greedy(max_tokens=6, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for i, (tid, ref_lp) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(ref_lp[tid], abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        # greedy: the sampled token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == \
            pytest.approx(sorted(ref_lp.values(), reverse=True)[:3], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_match_offline(client, offline):
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    ref = offline.chat(messages, greedy(max_tokens=5, logprobs=2, ignore_eos=True))[0].outputs[0]
    assert len(content) == r.usage.completion_tokens == 5
    for item, tid, ref_lp in zip(content, ref.token_ids, ref.logprobs):
        assert item.logprob == pytest.approx(ref_lp[tid], abs=1e-4)
        assert len(item.top_logprobs) == 2
        assert [t.logprob for t in item.top_logprobs] == \
            pytest.approx(sorted(ref_lp.values(), reverse=True)[:2], abs=1e-4)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode("utf-8"))
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_stop_strings(client, offline, tok):
    base = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 8, base
    stop = base[4:7]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "\x00never"],
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == base[: base.index(stop)]
    assert c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    # The frontend matched the stop string (the core never sees text): the usage counts exactly the
    # tokens up to the one that completed it, as the offline engine (which stops in-process) does.
    ref_ids = offline.generate([PROMPT], greedy(max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    need = next(k for k in range(1, len(ref_ids) + 1) if stop in tok.decode(ref_ids[:k]))
    assert r.usage.completion_tokens == need
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == c.text


def test_seed_determinism(client):
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    b = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    assert a == b
    assert len(set(a)) > 1


def test_echo(client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    ref = offline.generate(PROMPT, greedy(max_tokens=4))[0]
    assert r.choices[0].text == PROMPT + ref.outputs[0].text
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == PROMPT + ref.outputs[0].text


def test_tokenize_detokenize(http, tok, offline):
    r = http.post("/tokenize", json={"prompt": "Hello world!"}).json()
    assert r["tokens"] == tok.encode("Hello world!") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world!"}
    messages = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == offline.apply_chat_template(messages)


# -- load ---------------------------------------------------------------------------------------
def test_32_concurrent_streams_match_sequential(server):
    prompts = [f"{w} number {i}" for i, w in enumerate(["Paris", "Hello", "The", "def"] * 8)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(p, stream):
        kw = dict(model=NAME, prompt=p, max_tokens=16, temperature=0)
        if not stream:
            return (await aclient.completions.create(**kw)).choices[0].text
        text = ""
        async for ch in await aclient.completions.create(stream=True, **kw):
            if ch.choices:
                text += ch.choices[0].text
        return text

    async def run():
        alone = [await one(p, stream=True) for p in prompts]
        together = await asyncio.gather(*(one(p, stream=True) for p in prompts))
        await aclient.close()
        return alone, together

    alone, together = asyncio.run(run())
    assert len(together) == 32
    assert together == alone


def test_metrics_exposition(http, client):
    before = metrics(http)
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    after = metrics(http)
    assert after["appliance:request_success_total[length]"] == before["appliance:request_success_total[length]"] + 1
    assert after["appliance:generation_tokens_total"] == before["appliance:generation_tokens_total"] + 3
    assert after["appliance:prompt_tokens_total"] > before["appliance:prompt_tokens_total"]
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"appliance:{h}_count"] == before[f"appliance:{h}_count"] + 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "inter_token_latency_seconds_count"):
        assert f"appliance:{name}" in after
    # the same prompt again hits the prefix cache only if it spans a full block; queries always grow
    assert after["appliance:prefix_cache_queries_total"] > before["appliance:prefix_cache_queries_total"]
    text = http.get("/metrics").text
    assert '# TYPE appliance:time_to_first_token_seconds histogram' in text
    assert 'appliance:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"}' in text


# -- bad input ----------------------------------------------------------------------------------
LONG = [5] * 600
BAD = [
    # (method, path, body or raw bytes, status, param, text expected in the message)
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("POST", "/v1/completions", b'[1, 2]', 400, None, "JSON object"),
    ("POST", "/v1/completions", {"model": NAME}, 400, "prompt", "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "n": 0}, 400, "n", "0"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature", "-1"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature", "hot"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}, 400, "top_p", "0"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs", "21"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "stop": [""]}, 400, "stop", "''"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "3"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": LONG}, 400, "prompt", "600"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "1000"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": [5, 99999]}, 400, "prompt", "99999"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt", "empty"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "101"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias",
     "99999"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "x", "guided_regex": "(("}, 400, "guided_regex",
     "unclosed group"),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "gpt-4"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", "messages"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "wizard"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content.0.type", "image_url"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x " * 600}]}, 400,
     "messages", "512"),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", "-1"),
    ("POST", "/v1/nothing", {}, 404, None, "/v1/nothing"),
    ("GET", "/v1/completions", None, 405, None, "GET"),
]


@pytest.mark.parametrize("method,path,body,status,param,needle", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(http, method, path, body, status, param, needle):
    kw = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = http.request(method, path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert needle in err["message"], err["message"]
    assert "Traceback" not in r.text


def test_prompt_too_long_names_both_numbers(http):
    err = http.post("/v1/completions", json={"model": NAME, "prompt": LONG}).json()["error"]
    assert "600" in err["message"] and "512" in err["message"]
    err = http.post("/v1/completions", json={"model": NAME, "prompt": [5] * 500, "max_tokens": 20}).json()["error"]
    assert "500" in err["message"] and "512" in err["message"] and "20" in err["message"]


def test_openai_client_sees_errors_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-2)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", stream=True, n=0)
    r = client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_sends_a_chunk_per_token_even_without_text(client, tok, endpoint):
    """Like vLLM, a token whose text is held back (half a UTF-8 character) or empty (an id the
    tokenizer decodes to nothing) still gets its chunk, so a client's time to first token is the
    time to the first token, not to the first printable text."""
    kw = dict(model=NAME, max_tokens=24, temperature=1.0, seed=7, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if endpoint == "completions":
        chunks = list(client.completions.create(prompt=PROMPT, **kw))
    else:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw))
        chunks = chunks[1:]  # the role delta
    usage = chunks[-1].usage
    token_chunks = [c for c in chunks if c.choices]
    assert usage.completion_tokens == 24 and len(token_chunks) == 24
