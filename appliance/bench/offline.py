"""Offline benchmarks of the engine in this process: ``throughput`` (N prompts through
``LLM.generate``) and ``latency`` (one batch, stepped by hand, repeated)."""
from __future__ import annotations

import time

from appliance.bench.common import random_token_prompts, summarize


def build_llm(model: str | None, engine_kwargs: dict):
    from appliance import LLM

    return LLM(model, **engine_kwargs)


def _reset_stats(engine) -> None:
    for k in list(engine.stats):
        engine.stats[k] = 0.0 if k.endswith("_s") else 0


def workload(engine, num_prompts: int, input_len: int, dataset: str | None, seed: int) -> list[list[int]]:
    """Token-id prompts: random ids of ``input_len``, or the first ``num_prompts`` of a JSONL file."""
    if dataset:
        from appliance.bench.common import load_jsonl_prompts

        texts = load_jsonl_prompts(dataset, num_prompts)
        return [engine.tokenize(t) for t in texts]
    return random_token_prompts(num_prompts, input_len, engine.vocab_size, seed)


def warmup(llm, prompts: list[list[int]], n: int = 2) -> None:
    """A few short requests at the real prompt length: the first calls of each shape are slow."""
    from appliance import SamplingParams

    llm.generate(prompt_token_ids=prompts[:n], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    pool = getattr(llm.engine.kv, "pool", None)
    if pool is not None and hasattr(pool, "reset_prefix_cache"):
        pool.reset_prefix_cache()  # the measured run must not reuse the warm-up's prompt blocks


def run_throughput(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Keys fixed by ``schema.RESULTS['throughput']``."""
    from appliance import SamplingParams

    eng = llm.engine
    warmup(llm, prompts)
    _reset_stats(eng)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    s = eng.stats
    return {"num_requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "elapsed_s": elapsed,
            "requests_per_s": len(prompts) / elapsed, "input_tokens_per_s": n_in / elapsed,
            "output_tokens_per_s": n_out / elapsed, "total_tokens_per_s": (n_in + n_out) / elapsed,
            "engine": {"steps": int(s["steps"]), "forward_s": float(s["forward_s"]), "step_s": float(s["step_s"])}}


def run_latency(llm, batch_size: int, input_len: int, output_len: int, repeats: int, seed: int = 0) -> dict:
    """One batch of ``batch_size`` requests added at once, stepped to completion, ``repeats`` times.
    TTFT: per request, from adding the batch to its first token. TPOT: every step after the whole
    batch has its first token (one output token per request). E2E: the whole batch."""
    from appliance import SamplingParams

    eng = llm.engine
    prompts = random_token_prompts(batch_size * (repeats + 1), input_len, eng.vocab_size, seed)
    warmup(llm, prompts, batch_size)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttft, tpot, e2e = [], [], []
    for rep in range(repeats):
        batch = prompts[(rep + 1) * batch_size:(rep + 2) * batch_size]
        t0 = time.perf_counter()
        ids = [eng.add_request(f"lat-{rep}-{i}", p, sp) for i, p in enumerate(batch)]
        first: dict[str, float] = {}
        while eng.has_unfinished_requests():
            all_started = len(first) == len(ids)
            ts = time.perf_counter()
            outs = eng.step()
            te = time.perf_counter()
            if all_started:
                tpot.append(te - ts)
            for o in outs:
                if o.request_id not in first and o.outputs[0].token_ids:
                    first[o.request_id] = te - t0
        e2e.append(time.perf_counter() - t0)
        ttft.extend(first.values())
        pool = getattr(eng.kv, "pool", None)
        if pool is not None and hasattr(pool, "reset_prefix_cache"):
            pool.reset_prefix_cache()
    return {"batch_size": batch_size, "repeats": repeats, "input_len": input_len, "output_len": output_len,
            "ttft_s": summarize(ttft), "tpot_s": summarize(tpot), "e2e_s": summarize(e2e)}
