"""``appliance generate``: one prompt through the offline engine, streamed to the terminal."""
from __future__ import annotations

import sys
import time

from rich.console import Console

from appliance.config import EngineConfig
from appliance.engine.llm_engine import LLMEngine
from appliance.sampling_params import SamplingParams


def run_generate(config: EngineConfig, prompt: str, params: SamplingParams, chat: bool = False,
                 system: str | None = None, console: Console | None = None) -> list[str]:
    """Stream each of the ``params.n`` completions as it is produced; returns their final texts."""
    console = console or Console(stderr=True)
    t0 = time.perf_counter()
    with console.status("loading model..."):
        engine = LLMEngine(config)
    console.print(f"[dim]model {engine.model_path} | dtype {str(engine.dtype).replace('torch.', '')} | "
                  f"kernels {engine.runner.ops.__name__.rsplit('.', 1)[-1]} | linear "
                  f"{', '.join(f'{g} {b}' for g, b in engine.runner.linear_groups.items())} | KV blocks {engine.kv.num_blocks} "
                  f"x {config.block_size} | loaded in {time.perf_counter() - t0:.1f}s[/dim]")
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = engine.tokenize(prompt)
    rid = engine.add_request(None, ids, params)
    out = sys.stdout
    shown = [0] * params.n
    t1 = time.perf_counter()
    first = None
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if first is None:
                first = time.perf_counter()
            for c in o.outputs:
                if params.n == 1:
                    out.write(c.text[shown[0]:])
                    out.flush()
                    shown[0] = len(c.text)
            final = o
    t2 = time.perf_counter()
    texts = [c.text for c in final.outputs]
    if params.n == 1:
        out.write("\n")
    else:
        for c in final.outputs:
            console.print(f"[bold]--- completion {c.index} ({c.finish_reason})[/bold]")
            out.write(c.text + "\n")
    n_tok = sum(len(c.token_ids) for c in final.outputs)
    console.print(f"[dim]{len(ids)} prompt tokens, {n_tok} generated | time to first token "
                  f"{(first - t1) * 1e3:.0f} ms | {n_tok / max(t2 - t1, 1e-9):.1f} tok/s | finish: "
                  f"{', '.join(str(c.finish_reason) for c in final.outputs)}[/dim]")
    return texts
