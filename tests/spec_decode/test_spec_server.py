"""`appliance serve --speculative-config`: multi-token steps through the server's frontend (stop
strings matched there, streamed and not) give the offline engine's text, and /metrics counts drafts."""
from __future__ import annotations

import json

import httpx

from appliance import LLM, SamplingParams
from appliance.bench.servers import ServerProcess, appliance_command

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. The quick"


def test_server_speculation_stop_strings_and_metrics(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=128)  # no speculation: the reference
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    stop = tok.decode(free.token_ids[9:11])  # ends inside the second or third accepted run of 5
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop=[stop]))[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 24
    spec = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 4, "cost_aware": False}
    cmd = appliance_command(str(llama_dir), {"dtype": "float32", "num_kv_blocks": 128,
                                             "speculative_config": json.dumps(spec)})
    with ServerProcess(cmd, startup_timeout=300) as srv:
        name = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == free.text
        r = httpx.post(f"{srv.base_url}/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (want.text, "stop")
        text, reason = "", None
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stop": [stop], "stream": True},
                          timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])["choices"]
                    if ch:
                        text += ch[0]["text"]
                        reason = ch[0]["finish_reason"] or reason
        assert (text, reason) == (want.text, "stop")
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    values = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
              if ln.startswith("vllm:spec_decode_num_")}
    assert values["vllm:spec_decode_num_drafts_total"] >= 3
    # the target is its own draft: every proposed token is accepted
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == values["vllm:spec_decode_num_draft_tokens_total"] > 0
