"""Speculative decoding benchmark (``appliance bench spec``, ``bench/bench_spec.py``): decode tok/s
of the offline engine with and without n-gram and draft-model speculation, on input-grounded
prompts (edit a given text, complete a function in a given file) and open-ended chat, at
concurrency 1 and 16, plus each setting's acceptance rate and mean accepted length.

Decode tok/s per request is (output tokens - 1) / (time of the last token - time of the first), so
the prompt's prefill is not in it; at concurrency C the figure is the mean over requests and the
aggregate is all output tokens over the wall time. A request ends at its end of turn (EOS), at most
``max_tokens``, as a user's would: SmolLM2-135M's rewrite in the edit workload ends after ~70 tokens,
and with ``ignore_eos`` (every run before 2026-12-05 16:00 UTC) the rest of its 128 tokens was a
conversation turn the model made up after its own (``<|im_end|><|im_start|>user\nI am a
30-year-old...``): open-ended text counted as "edit". ``--ignore-eos`` keeps that measure. Greedy,
so every setting emits the same tokens. At concurrency 1 each row also gives the target's step time
by tokens in the step (``step_ms``: 1 is a decode step, 2..k+1 a verify chunk), so what a rejected
draft costs is on the same line.

Why the first results (bench/results/spec.txt, 28-32 tok/s without speculation) were far below the
served figure (TPOT 9.9 ms, ~100 tok/s, compare_default_model.txt): bench/bench_spec.py called the CLI
in-process without "bench" in argv, so it skipped the re-execution under the worker environment and ran
on glibc malloc with unpinned OpenMP threads and the default loop schedule (spec.json records
"allocator": "glibc malloc"); `appliance serve` and every `appliance bench` run mimalloc, OMP_PLACES,
OMP_PROC_BIND=close and OMP_SCHEDULE=static. On a shared 2-core host, unpinned spinning OpenMP
threads are the likely main cost; bench_spec.py now re-executes like `appliance bench spec`.

``--llamacpp`` adds llama.cpp's llama-server at batch 1 on the same prompt token ids, on the weights
the appliance runs: the target as a float32 GGUF, or with ``-e quantization=gguf`` (both systems at the
file's own quant) the GGUF file itself; without speculation, with its own n-gram lookup and with its
draft (``-md``).
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
    # Code completion as an instruct model is asked for it: complete a function and return the whole
    # file. The earlier raw-text completion of CODE_TEXT made SmolLM2-135M-Instruct close the code
    # block and write prose about it ("```\n\nThis implementation uses ..."), so there was little of
    # the input to copy (n-gram acceptance 0.21); that measured the prompt, not the proposer.
    "code": [{"role": "user", "content": "Complete `moving_sum` in this Python file and reply with the whole "
              "file in one code block:\n\n" + CODE_TEXT}],
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


def run_requests(llm, prompts: list[list[int]], max_tokens: int, speculate: bool = True,
                 ignore_eos: bool = False) -> dict:
    """All prompts at once through the engine, stepped by hand; per-request decode rates.
    ``speculate`` False: the requests decode without drafts in this speculating engine (as
    structured-output requests do), the baseline on the same loaded weights. ``ignore_eos``: exactly
    ``max_tokens`` each, past the end of the model's turn."""
    from appliance import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    first, last, counts, tokens = {}, {}, {}, {}
    # the target's step time by tokens scheduled (c=1: 1 is a plain decode step, 1 + k a verify
    # chunk): what a rejected draft costs is the verify step's time over the decode step's
    runner, step_times = eng.runner, {}
    execute = runner.execute

    def timed_execute(sched, *a, **kw):
        t = time.perf_counter()
        out = execute(sched, *a, **kw)
        step_times.setdefault(sum(n for _, n in sched.scheduled), []).append(time.perf_counter() - t)
        return out

    draft = getattr(getattr(eng, "spec", None), "draft", None)
    draft_runner = draft.runner if draft is not None else None
    draft_times: list[float] = []
    if draft_runner is not None:
        draft_execute = draft_runner.execute

        def timed_draft_execute(*a, **kw):
            t = time.perf_counter()
            out = draft_execute(*a, **kw)
            draft_times.append(time.perf_counter() - t)
            return out

        draft_runner.execute = timed_draft_execute
    runner.execute = timed_execute
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(prompts):
            eng.add_request(f"b{i}", p, sp)
            if not speculate:
                eng.scheduler.requests[f"b{i}"].spec_allowed = False
        while eng.has_unfinished_requests():
            for out in eng.step():
                now = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                if n and out.request_id not in first:
                    first[out.request_id] = now
                last[out.request_id], counts[out.request_id] = now, n
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        del runner.execute  # the bound method again
        if draft_runner is not None:
            del draft_runner.execute
    wall = time.perf_counter() - t0
    rates = [(counts[r] - 1) / (last[r] - first[r]) for r in counts if counts[r] > 1 and last[r] > first[r]]
    res = {"decode_tok_s": statistics.mean(rates) if rates else 0.0,
           "output_tok_s": sum(counts.values()) / wall, "wall_s": wall, "num_requests": len(prompts),
           "output_tokens": statistics.mean(counts.values()) if counts else 0,
           "token_ids": [tokens.get(f"b{i}", []) for i in range(len(prompts))]}
    if len(prompts) == 1:  # prompt chunks are larger than any verify chunk: 2..16 tokens are verify steps
        res["step_ms"] = {n: 1e3 * statistics.median(ts) for n, ts in sorted(step_times.items()) if n <= 16}
        # The decode at this run's own median step time per size (and the draft model's forwards):
        # tokens decoded x the 1-token step, over the steps taken. A speedup that the host's drift
        # during a run (several % within a minute here) does not move: what the drafts cost and gave.
        med = {n: statistics.median(ts) for n, ts in step_times.items() if n <= 16}
        if 1 in med and counts:
            spent = sum(len(step_times[n]) * t for n, t in med.items())
            spent += len(draft_times) * statistics.median(draft_times) if draft_times else 0.0
            decoded = sum(counts.values()) - 1
            res["step_model_speedup"] = decoded * med[1] / spent if spent else 0.0
    return res


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (the shorter one's length if one is a prefix
    of the other), or -1 when they are the same."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def spec_counters(llm) -> dict:
    spec = getattr(llm.engine, "spec", None)
    return dict(spec.stats()) if spec is not None else {}


def run_bench(model: str | None, draft: str | None, settings: list[str], workloads: list[str],
              concurrency: list[int], max_tokens: int, k: int, engine_kwargs: dict, log=print,
              draft_quantization: str | None = None, prompts_out: dict | None = None,
              spec_extra: dict | None = None, ignore_eos: bool = False) -> list[dict]:
    """One row per (setting, workload, concurrency); each request ends at its end of turn (at most
    ``max_tokens``), or with ``ignore_eos`` after exactly ``max_tokens``. ``settings``: none | ngram |
    draft, and ngram-all | draft-all: every proposed draft verified (``cost_aware`` false), against
    the default that verifies only the drafts that pay for their share of the step. ``spec_extra``:
    further speculative_config keys for every speculating setting."""
    from appliance import LLM

    rows = []
    for setting in settings:
        kw = dict(engine_kwargs)
        method = setting.removesuffix("-all")
        if method == "ngram":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k,
                                        "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        elif method == "draft":
            if draft is None:
                log("draft: skipped (no --draft model given)")
                continue
            kw["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
            if draft_quantization is not None:
                kw["speculative_config"]["quantization"] = draft_quantization
        elif setting != "none":
            raise ValueError(f"setting must be none, ngram, draft, ngram-all or draft-all; got {setting!r}")
        if setting != "none":
            kw["speculative_config"].update(spec_extra or {})  # e.g. min_acceptance_rate (--spec-arg)
        if setting.endswith("-all"):
            kw["speculative_config"]["cost_aware"] = False
        llm = LLM(model, **kw)
        ref_tokens = {}
        # warm-up: first calls of each shape are slow
        run_requests(llm, [prompt_ids(llm, workloads[0])], 4, ignore_eos=True)
        for w in workloads:
            ids = prompt_ids(llm, w)
            if prompts_out is not None:
                prompts_out[w] = ids
            for c in concurrency:
                before = spec_counters(llm)
                res = run_requests(llm, [ids] * c, max_tokens, ignore_eos=ignore_eos)
                out_ids = res.pop("token_ids")
                after = spec_counters(llm)
                row = {"setting": setting, "workload": w, "concurrency": c, "prompt_tokens": len(ids), **res}
                if after and c == 1:
                    # The same prompt without drafts in this engine, right after: the speedup over it is
                    # free of what separates two engine loads: the plain decode step of one load differs
                    # from another's by more than speculation gains on open-ended text
                    # (bench/results/spec_0.5b.txt).
                    plain = run_requests(llm, [ids] * c, max_tokens, speculate=False, ignore_eos=ignore_eos)
                    row["same_engine_plain_tok_s"] = plain["decode_tok_s"]
                    row["same_engine_speedup"] = res["decode_tok_s"] / plain["decode_tok_s"]
                    # greedy: speculation must not change the text (issue 19); the first output token
                    # where it does, or -1
                    row["parts_from_plain_at"] = first_difference(out_ids[0], plain["token_ids"][0])
                if after:
                    drafts = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
                    dt = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
                    acc = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
                    trimmed = after["spec_decode_num_trimmed_tokens"] - before.get("spec_decode_num_trimmed_tokens", 0)
                    row.update(acceptance_rate=acc / dt if dt else 0.0,
                               mean_accepted_length=1 + acc / drafts if drafts else 1.0, num_drafts=drafts,
                               num_draft_tokens=dt, num_trimmed_tokens=trimmed)
                rows.append(row)
                ref_tokens[(w, c)] = res
                log(format_row(row))
        del llm
    add_ratios(rows)
    return rows


# llama.cpp's own prompt lookup (``--spec-type ngram-simple``): the last LLAMACPP_NGRAM_N tokens (the
# one just sampled among them) looked up in the request's tokens, the K after the latest earlier
# match drafted. Its default N of 12 (with 48 drafted) suits long verbatim repeats; 3 is the middle
# of the appliance's prompt_lookup_min 2 .. max 4 (run_bench), so both look up alike.
LLAMACPP_NGRAM_N = 3


def run_llamacpp(target_gguf: str, draft_gguf: str | None, prompts: dict[str, list[int]], max_tokens: int,
                 k: int, threads: int, log=print, ngram: bool = True, ignore_eos: bool = False) -> list[dict]:
    """llama.cpp's llama-server at batch 1 (``-np 1``) on the same prompts (token ids), greedy,
    without speculation, with its own n-gram lookup (``ngram``: ``--spec-type ngram-simple``, N =
    LLAMACPP_NGRAM_N, K drafted) and (``draft_gguf``) with its draft model (``--spec-type
    draft-simple -md DRAFT --spec-draft-n-max K --spec-draft-n-min 0``: this llama.cpp build removed
    ``--draft-max``); decode tok/s is the server's own ``predicted_per_second`` (prompt processing
    not in it), and acceptance its ``draft_n_accepted / draft_n``. Rows as ``run_bench``'s, settings
    ``llama.cpp``, ``llama.cpp+ngram`` and ``llama.cpp+draft``."""
    from appliance.bench import llamacpp

    if not llamacpp.is_built():
        log("llama.cpp: skipped (not built: bench/bench_gguf.py --build-llamacpp-only)")
        return []
    rows = []
    setups = [("llama.cpp", [])]
    if ngram:
        setups.append(("llama.cpp+ngram", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                           str(LLAMACPP_NGRAM_N), "--spec-ngram-simple-size-m", str(k)]))
    if draft_gguf:
        setups.append(("llama.cpp+draft", ["--spec-type", "draft-simple", "-md", str(draft_gguf),
                                           "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                                           "-td", str(threads)]))
    names = list(prompts)
    for setting, extra in setups:
        res = llamacpp.llama_server_run(target_gguf, threads, [prompts[w] for w in names], max_tokens, parallel=1,
                                        extra_args=extra, ignore_eos=ignore_eos)
        for w, run in zip(names, res["runs"]):
            row = {"setting": setting, "workload": w, "concurrency": 1, "prompt_tokens": len(prompts[w]),
                   "decode_tok_s": run["predicted_per_second"] or 0.0, "output_tok_s": (run["predicted_n"] or 0)
                   / run["wall_s"], "wall_s": run["wall_s"], "num_requests": 1, "command": res["command"],
                   "output_tokens": run["predicted_n"] or 0}
            if run.get("draft_n"):
                row.update(acceptance_rate=run["draft_n_accepted"] / run["draft_n"])
            rows.append(row)
            log(format_row(row))
    return rows


def llamacpp_target_gguf(model: str | None, quantization: str | None = None) -> str:
    """The target as llama.cpp reads it, with the weights the appliance runs: a GGUF target run as
    the file stores it (``quantization`` gguf: each system at its native quant) is that file itself;
    otherwise the float32 GGUF of the model's HF-layout form (a GGUF target is dequantized to it, as
    the appliance loads it)."""
    from appliance.bench.gguf_export import cached_gguf
    from appliance.models.default_model import converted_model_dir, default_gguf_path, resolve_model_source

    src = resolve_model_source(model)
    if quantization == "gguf":
        src = default_gguf_path() if model is None else src  # the embedded model's own file
        if not src.is_file():
            raise ValueError(f"quantization gguf: the target must be a .gguf file; got {str(src)!r}")
        return str(src)
    return str(cached_gguf(converted_model_dir(src) if src.is_file() else src, "float32"))


def add_ratios(rows: list[dict]) -> list[str]:
    """Each row's speedup over its own engine's row without speculation (appliance: ``none``;
    llama.cpp: ``llama.cpp``), and per workload at concurrency 1 a line with the best setting of
    each and their ratio."""
    base = {}
    for r in rows:
        if r["setting"] in ("none", "llama.cpp"):
            base[(r["setting"] == "none", r["workload"], r["concurrency"])] = r["decode_tok_s"]
    for r in rows:
        b = base.get((not r["setting"].startswith("llama.cpp"), r["workload"], r["concurrency"]))
        if b:
            r["speedup"] = r["decode_tok_s"] / b
    lines = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        c1 = [r for r in rows if r["workload"] == w and r["concurrency"] == 1]
        ours = max((r for r in c1 if not r["setting"].startswith("llama.cpp")), key=lambda r: r["decode_tok_s"],
                   default=None)
        theirs = max((r for r in c1 if r["setting"].startswith("llama.cpp")), key=lambda r: r["decode_tok_s"],
                     default=None)
        if ours and theirs and theirs["decode_tok_s"]:
            lines.append(f"{w:5} c=1 best: appliance {ours['setting']} {ours['decode_tok_s']:.1f} tok/s vs "
                         f"{theirs['setting']} {theirs['decode_tok_s']:.1f} tok/s: "
                         f"{ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x")
    return lines


def format_row(r: dict) -> str:
    acc = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
    mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
    if "num_trimmed_tokens" in r:  # drafts verified / proposed (the rest trimmed by the cost policy)
        mal += f"  drafts {r['num_draft_tokens']}/{r['num_draft_tokens'] + r['num_trimmed_tokens']}"
    sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
    if "same_engine_speedup" in r:
        model = f", step model {r['step_model_speedup']:.2f}x" if "step_model_speedup" in r else ""
        sp += f" (same engine {r['same_engine_speedup']:.2f}x{model})"
    if "parts_from_plain_at" in r:
        at = r["parts_from_plain_at"]
        sp += "  text = plain" if at < 0 else f"  TEXT PARTS FROM PLAIN AT TOKEN {at}"
    steps = r.get("step_ms") or {}
    # the target's step time by tokens in the step, relative to a 1-token decode step
    cost = "  step " + " ".join(f"{n}:{t:.1f}ms" + (f"({t / steps[1]:.2f}x)" if n > 1 and 1 in steps else "")
                                for n, t in steps.items()) if steps else ""
    # tokens per request: where the model ended its turn, or max_tokens (ignore_eos)
    out = f"{r['output_tokens']:4.0f} tok  " if "output_tokens" in r else ""
    return (f"{r['setting']:15} {r['workload']:5} c={r['concurrency']:<3} {out}decode {r['decode_tok_s']:8.1f} tok/s/req  "
            f"aggregate {r['output_tok_s']:8.1f} tok/s  acceptance {acc:>5}  mean accepted length {mal:>5} {sp}{cost}")


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
