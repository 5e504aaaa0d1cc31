"""An asyncio HTTP load generator for any OpenAI-compatible server (the appliance, vLLM, llama.cpp's
server): streaming ``/v1/completions`` or ``/v1/chat/completions`` requests, either a fixed number in
flight (``concurrency``) or Poisson arrivals (``request_rate`` per second, optionally capped).

Per request it records the time to the first token-bearing chunk (TTFT), the gaps between later
token-bearing chunks (ITL), the end-to-end latency and the token counts the server reports in
``usage``. A request that gets a non-200 status, an error chunk, a broken stream or no tokens at
all is *failed*: it is counted, its error kept, and it is left out of every latency and throughput
figure (an all-failed level reports None, never a fast zero).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from appliance.bench.common import summarize

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERRORS_KEPT = 5


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    output_len: int = 128
    ignore_eos: bool = True
    api_key: str | None = None
    temperature: float = 0.0
    request_timeout: float = 600.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}")
        self.base_url = normalize_base_url(self.base_url)


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    chunks: int = 0  # token-bearing chunks seen
    usage_reported: bool = False


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean the same server."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_model(base_url: str, api_key: str | None = None, timeout: float = 10) -> tuple[str, str | None]:
    """(served model name, its ``root`` path if the server reports one) from ``GET /v1/models``."""
    r = httpx.get(f"{normalize_base_url(base_url)}/v1/models", headers=headers(api_key), timeout=timeout)
    r.raise_for_status()
    first = r.json()["data"][0]
    return first["id"], first.get("root")


def _body(cfg: LoadConfig, prompt) -> dict:
    body = {"model": cfg.model, "max_tokens": cfg.output_len, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM and the appliance honour it; others ignore unknown fields
    if cfg.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    body.update(cfg.extra_body)
    return body


def _token_chunk(cfg: LoadConfig, chunk: dict) -> bool:
    """Whether a stream chunk carries generated text (role-only and usage-only chunks do not)."""
    for ch in chunk.get("choices") or []:
        if cfg.endpoint == "chat":
            d = ch.get("delta") or {}
            if d.get("content") or d.get("reasoning_content"):
                return True
        elif ch.get("text") or (ch.get("text") == "" and ch.get("finish_reason") is None):
            # an empty text with no finish: a token whose bytes the detokenizer holds back
            return True
    return False


async def one_request(client: httpx.AsyncClient, cfg: LoadConfig, prompt) -> RequestResult:
    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=_body(cfg, prompt)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"[:300]
                    return res
                now = time.perf_counter()
                if _token_chunk(cfg, chunk):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
                if chunk.get("usage"):
                    res.usage_reported = True
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    res.output_tokens = chunk["usage"].get("completion_tokens") or 0
    except Exception as e:  # noqa: BLE001  any broken response is a failed request, never a crash
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e = time.perf_counter() - t0
    if not res.usage_reported:
        res.output_tokens = res.chunks
    if res.chunks == 0:
        res.error = "no tokens in the response"
        return res
    res.ok = True
    return res


def _client(cfg: LoadConfig, max_conn: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_conn + 4, max_keepalive_connections=max_conn + 4)
    return httpx.AsyncClient(base_url=cfg.base_url, headers=headers(cfg.api_key), limits=limits,
                             timeout=httpx.Timeout(cfg.request_timeout, connect=30))


async def run_level_async(cfg: LoadConfig, prompts: list, concurrency: int | None = None,
                          request_rate: float | None = None, seed: int = 0,
                          on_done: Callable[[RequestResult], None] | None = None) -> dict:
    """Send every prompt once. ``concurrency``: at most that many in flight (None: no cap);
    ``request_rate``: Poisson arrivals at that mean rate per second (None: all at once)."""
    if concurrency is None and request_rate is None:
        raise ValueError("give a concurrency, a request rate, or both")
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    async with _client(cfg, concurrency or len(prompts)) as client:
        async def go(p):
            if sem is None:
                r = await one_request(client, cfg, p)
            else:
                async with sem:
                    r = await one_request(client, cfg, p)
            if on_done:
                on_done(r)
            return r

        t0 = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if request_rate and i:
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(go(p)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return level_summary(results, duration, concurrency, request_rate)


def run_level(cfg: LoadConfig, prompts: list, concurrency: int | None = None, request_rate: float | None = None,
              seed: int = 0, on_done=None) -> dict:
    return asyncio.run(run_level_async(cfg, prompts, concurrency, request_rate, seed, on_done))


def level_summary(results: list[RequestResult], duration: float, concurrency: int | None,
                  request_rate: float | None) -> dict:
    """One level's figures; keys fixed by ``schema.SERVE_LEVEL``."""
    ok = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < MAX_ERRORS_KEPT:
            errors.append(r.error)
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "request_rate": request_rate, "num_requests": len(results),
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": duration,
        "input_tokens": in_tok, "output_tokens": out_tok,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / duration if ok else None,
        "output_throughput": out_tok / duration if ok else None,
        "total_token_throughput": (in_tok + out_tok) / duration if ok else None,
        "ttft_s": summarize([r.ttft for r in ok]), "tpot_s": summarize(tpot),
        "itl_s": summarize([x for r in ok for x in r.itl]), "e2e_s": summarize([r.e2e for r in ok]),
    }


def sweep(cfg: LoadConfig, prompts: list, concurrencies: list[int] | None = None,
          request_rate: float | None = None, num_prompts: int | None = None, warmup: int = 2, seed: int = 0,
          progress=None) -> list[dict]:
    """One level per concurrency (or one Poisson level at ``request_rate``, capped by the single
    concurrency if given). ``num_prompts`` per level (default ``max(8, 4 x concurrency)``), taken
    from ``prompts`` cyclically. ``progress(description, total)`` returns an ``on_done`` callback."""
    if request_rate is not None:
        specs = [(concurrencies[0] if concurrencies else None, request_rate)]
    else:
        specs = [(c, None) for c in concurrencies or [1]]
    levels = []
    for c, rate in specs:
        n = num_prompts or max(8, 4 * (c or 1))
        batch = [prompts[i % len(prompts)] for i in range(n)]
        if warmup:
            run_level(cfg, batch[:warmup], concurrency=warmup)  # first requests of a shape are slow
        label = f"rate {rate}/s" if rate else f"concurrency {c}"
        on_done = progress(label, n) if progress else None
        levels.append(run_level(cfg, batch, concurrency=c, request_rate=rate, seed=seed, on_done=on_done))
    return levels
