"""Speculative decoding benchmark (``appliance bench spec``, ``bench/bench_spec.py``): decode tok/s
of the offline engine with and without n-gram and draft-model speculation, on input-grounded
prompts (edit a given text, complete code that repeats its own names) and open-ended chat, at
concurrency 1 and 16, plus each setting's acceptance rate and mean accepted length.

Decode tok/s per request is (output tokens - 1) / (time of the last token - time of the first), so
the prompt's prefill is not in it; at concurrency C the figure is the mean over requests and the
aggregate is all output tokens over the wall time. Greedy, so every setting emits the same tokens.
"""
from __future__ import annotations

import statistics
import time

EDIT_TEXT = (
    "The appliance is an inference server for large language models that runs on the CPU first. It "
    "reads each weight once per generated token, so a single user waits on memory bandwidth. Speculative "
    "decoding lets the server check several guessed tokens in one pass over the weights, and when the "
    "guesses are right the user gets more than one token for the price of one.")
CODE_TEXT = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages


def moving_sum(values, window):
    """Sum of each run of `window` consecutive values."""
'''
WORKLOADS = {
    "edit": [{"role": "user", "content": "Rewrite this text with British spelling, changing nothing else:\n\n"
              + EDIT_TEXT}],
    "code": CODE_TEXT,  # raw completion: the model continues the file
    "chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a storm."}],
}


def prompt_ids(llm, workload: str) -> list[int]:
    w = WORKLOADS[workload]
    tok = llm.get_tokenizer()
    if isinstance(w, str):
        return tok.encode(w)
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(w, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tok.encode(w[0]["content"])


def run_requests(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once through the engine, stepped by hand; per-request decode rates."""
    from appliance import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first, last, counts = {}, {}, {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", p, sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            last[out.request_id], counts[out.request_id] = now, n
    wall = time.perf_counter() - t0
    rates = [(counts[r] - 1) / (last[r] - first[r]) for r in counts if counts[r] > 1 and last[r] > first[r]]
    return {"decode_tok_s": statistics.mean(rates) if rates else 0.0,
            "output_tok_s": sum(counts.values()) / wall, "wall_s": wall, "num_requests": len(prompts)}


def spec_counters(llm) -> dict:
    spec = getattr(llm.engine, "spec", None)
    return dict(spec.stats()) if spec is not None else {}


def run_bench(model: str | None, draft: str | None, settings: list[str], workloads: list[str],
              concurrency: list[int], max_tokens: int, k: int, engine_kwargs: dict, log=print) -> list[dict]:
    """One row per (setting, workload, concurrency). ``settings``: none | ngram | draft."""
    from appliance import LLM

    rows = []
    for setting in settings:
        kw = dict(engine_kwargs)
        if setting == "ngram":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        elif setting == "draft":
            if draft is None:
                log("draft: skipped (no --draft model given)")
                continue
            kw["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        elif setting != "none":
            raise ValueError(f"setting must be none, ngram or draft; got {setting!r}")
        llm = LLM(model, **kw)
        ref_tokens = {}
        run_requests(llm, [prompt_ids(llm, workloads[0])], 4)  # warm-up: first calls of each shape are slow
        for w in workloads:
            ids = prompt_ids(llm, w)
            for c in concurrency:
                before = spec_counters(llm)
                res = run_requests(llm, [ids] * c, max_tokens)
                after = spec_counters(llm)
                row = {"setting": setting, "workload": w, "concurrency": c, "prompt_tokens": len(ids), **res}
                if after:
                    drafts = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
                    dt = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
                    acc = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
                    row.update(acceptance_rate=acc / dt if dt else 0.0,
                               mean_accepted_length=1 + acc / drafts if drafts else 1.0, num_drafts=drafts)
                rows.append(row)
                ref_tokens[(w, c)] = res
                log(format_row(row))
        del llm
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["setting"] == "none"}
    for r in rows:
        b = base.get((r["workload"], r["concurrency"]))
        if b and b["decode_tok_s"]:
            r["speedup"] = r["decode_tok_s"] / b["decode_tok_s"]
    return rows


def format_row(r: dict) -> str:
    acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
    mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
    sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
    return (f"{r['setting']:6} {r['workload']:5} c={r['concurrency']:<3} decode {r['decode_tok_s']:8.1f} tok/s/req  "
            f"aggregate {r['output_tok_s']:8.1f} tok/s  acceptance {acc:>5}  mean accepted length {mal:>5} {sp}")


def make_truncated_draft(target_gguf_or_dir: str, out_dir: str, num_layers: int = 2) -> str:
    """A draft from the target's own first ``num_layers`` layers (embeddings, final norm and head
    kept), saved as safetensors with the target's tokenizer: same vocabulary by construction."""
    import shutil
    from pathlib import Path

    import torch
    import transformers

    from appliance.models.default_model import converted_model_dir, resolve_model_source, tokenizer_path

    src = resolve_model_source(target_gguf_or_dir)
    # a GGUF: its cached HF-layout conversion (what the engine itself can load)
    hf_dir = converted_model_dir(src) if src.is_file() else src
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    m.model.layers = m.model.layers[:num_layers]
    m.config.num_hidden_layers = num_layers
    if getattr(m.config, "layer_types", None):
        m.config.layer_types = m.config.layer_types[:num_layers]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(str(out), safe_serialization=True)
    for f in Path(tokenizer_path(src)).iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return str(out)
