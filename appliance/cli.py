"""The ``appliance`` command: serve | generate | bench | doctor (each a typer command below)."""
from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
import typer.core

app = typer.Typer(help="appliance: an Arm-CPU-first LLM inference engine and OpenAI-compatible server.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """appliance: an Arm-CPU-first LLM inference engine and OpenAI-compatible server."""


def _fail(message: str, code: int = 1):
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


Opt = typer.Option


class _ServeCommand(typer.core.TyperCommand):
    """Also takes vLLM's space-separated lists, ``serve MODEL --served-model-name a b --api-key k1 k2``."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        from appliance.vllm_compat import expand_multi_value_flags

        return super().parse_args(ctx, expand_multi_value_flags(args))


@app.command(cls=_ServeCommand)
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(
        help="HF model directory or .gguf file; default: the embedded model")] = None,
    model_opt: Annotated[Optional[str], Opt("--model", help="Same as the MODEL argument.")] = None,
    tokenizer: Annotated[Optional[str], Opt(help="Tokenizer directory (default: the model's).")] = None,
    host: Annotated[str, Opt(envvar="APPLIANCE_HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, Opt(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[Optional[list[str]], Opt(
        help="Model name clients use (default: MODEL); repeat for several names, all answer, the first is "
             "reported.")] = None,
    api_key: Annotated[Optional[list[str]], Opt(
        envvar="APPLIANCE_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; repeat for several "
             "keys (any one authorises). Also read from VLLM_API_KEY.")] = None,
    max_model_len: Annotated[Optional[int], Opt(help="Context length (default: the model's).")] = None,
    max_num_seqs: Annotated[Optional[int], Opt(help="Most sequences in one batch.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], Opt(help="Token budget of one step.")] = None,
    kv_cache_memory: Annotated[Optional[float], Opt(
        help="KV cache size in GiB (default: 1/4 of free RAM, at most 4). Also read from "
             "VLLM_CPU_KVCACHE_SPACE.")] = None,
    kv_cache_memory_bytes: Annotated[Optional[str], Opt(
        help="vLLM's spelling: KV cache size in bytes; suffixes k/m/g/t are decimal, K/M/G/T binary "
             "(4G = 4 GiB).")] = None,
    num_kv_blocks: Annotated[Optional[int], Opt(
        "--num-kv-blocks", "--num-gpu-blocks-override",
        help="Exact number of KV blocks (overrides --kv-cache-memory).")] = None,
    block_size: Annotated[Optional[int], Opt(help="Tokens per KV block.")] = None,
    dtype: Annotated[Optional[str], Opt(help="auto | float32 | bfloat16.")] = None,
    kv_cache_dtype: Annotated[Optional[str], Opt(
        help="KV cache storage: auto (the model's dtype) | bfloat16 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 | "
             "int8; the quantized ones keep a scale per token and head.")] = None,
    prefix_caching: Annotated[Optional[bool], Opt(
        "--prefix-caching/--no-prefix-caching", "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse KV blocks of shared prompt prefixes.")] = None,
    attention_backend: Annotated[Optional[str], Opt(help="auto | native | reference | cuda (Triton kernels).")] = None,
    linear_backend: Annotated[Optional[str], Opt(
        help="auto (measured per shape) | torch | onednn | native | native_bf16 (bfloat16 models) | w8a8_onednn | w8a8_native | w8a16_int8pack | w4a8_dynquant | w4a16_int4pack.")] = None,
    batch_invariant: Annotated[Optional[bool], Opt(
        "--batch-invariant/--no-batch-invariant",
        help="A request's logits are the same bits however it is batched, chunked or cached (row-invariant "
             "linear methods at every step size, native ops; CPU, one rank). Also VLLM_BATCH_INVARIANT=1.")] = None,
    quantization: Annotated[Optional[str], Opt(help="Quantize a float checkpoint at load: none | w8a8 | w4a8; gguf: a GGUF's projections as the file stores them.")] = None,
    quant_group_size: Annotated[Optional[int], Opt(help="W4 group size along the input dimension.")] = None,
    long_prefill_token_threshold: Annotated[Optional[int], Opt(
        help="Cap on one request's prefill tokens per step (0: none).")] = None,
    itl_target: Annotated[Optional[str], Opt(
        help="While decodes run, cap each step's new prefill tokens so the step stays within this latency: "
             "auto (2.5x the measured decode-only step; serve's default) | off | milliseconds.")] = None,
    num_threads: Annotated[Optional[int], Opt(help="Threads of the engine process (default: torch's).")] = None,
    tensor_parallel_size: Annotated[Optional[int], Opt(
        "--tensor-parallel-size", "-tp",
        help="Ranks the model is sharded over (processes on this host, the CPUs split between them; default 1).")] = None,
    allocator: Annotated[Optional[str], Opt(
        help="malloc of the engine process: mimalloc (LD_PRELOAD) | glibc-tuned | system.")] = None,
    omp_threads_bind: Annotated[Optional[str], Opt(
        help="Engine threads' CPUs: auto (physical cores of one NUMA node) | nobind | a list like 0-31. "
             "Also read from VLLM_CPU_OMP_THREADS_BIND; VLLM_CPU_NUM_OF_RESERVED_CPU=N leaves N of those "
             "cores to the frontend.")] = None,
    seed: Annotated[Optional[int], Opt(help="Seed of unseeded sampling.")] = None,
    runner: Annotated[Optional[str], Opt(
        help="auto (pooling for an embedding architecture) | generate | pooling (/v1/embeddings).")] = None,
    pooler_config: Annotated[Optional[str], Opt(
        help='Pooling runner: JSON like {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}.')] = None,
    speculative_config: Annotated[Optional[str], Opt(help=SPEC_HELP)] = None,
    max_queued_requests: Annotated[Optional[int], Opt(
        help="Sequences allowed to wait beyond max_num_seqs; more get 503 (default: no limit).")] = None,
    shutdown_timeout: Annotated[float, Opt(help="Seconds in-flight requests get to finish on SIGTERM.")] = 30.0,
    log_level: Annotated[str, Opt(help="debug | info | warning | error.")] = "info",
    uvicorn_log_level: Annotated[Optional[str], Opt(
        help="Log level of uvicorn's own loggers (default: --log-level).")] = None,
    allowed_origins: Annotated[Optional[list[str]], Opt(
        help="CORS: an allowed origin, or a JSON list like '[\"*\"]' as vLLM takes it; repeatable. "
             "CORS is off unless given.")] = None,
    allowed_methods: Annotated[Optional[list[str]], Opt(help="CORS: allowed methods (default: all).")] = None,
    allowed_headers: Annotated[Optional[list[str]], Opt(help="CORS: allowed headers (default: all).")] = None,
    allow_credentials: Annotated[bool, Opt(help="CORS: allow credentials.")] = False,
    ssl_keyfile: Annotated[Optional[str], Opt(help="HTTPS: the private key file (PEM).")] = None,
    ssl_certfile: Annotated[Optional[str], Opt(help="HTTPS: the certificate file (PEM).")] = None,
    root_path: Annotated[Optional[str], Opt(
        help="The URL prefix a path-routing proxy serves this server under (FastAPI's root_path).")] = None,
    generation_config: Annotated[str, Opt(
        help="auto: the model's generation_config.json (or a GGUF's general.sampling.* keys) gives default "
             "temperature/top_p/top_k/min_p/repetition_penalty and a max_tokens cap; vllm: ignore it.")] = "auto",
    device: Annotated[Optional[str], Opt(
        help="auto (cuda when torch can use a GPU) | cpu (the default) | cuda.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], Opt(
        help="CUDA: fraction of the GPU's memory this engine may use; the KV cache gets what weights and "
             "activations leave of it (default 0.9).")] = None,
    enforce_eager: Annotated[Optional[bool], Opt(
        "--enforce-eager/--no-enforce-eager", help="CUDA: run decode eagerly, without CUDA graphs.")] = None,
    enable_auto_tool_choice: Annotated[bool, Opt(
        help="Allow tool_choice 'auto': parse tool calls from the output (needs --tool-call-parser).")] = False,
    tool_call_parser: Annotated[Optional[str], Opt(
        help="The model's tool-call format: hermes | llama3_json | mistral | pythonic.")] = None,
    reasoning_parser: Annotated[Optional[str], Opt(
        help="Move <think>...</think> into reasoning_content: qwen3 | deepseek_r1.")] = None,
    chat_template: Annotated[Optional[str], Opt(
        help="Chat template: a file path, or the Jinja template itself (default: the tokenizer's).")] = None,
    default_chat_template_kwargs: Annotated[Optional[str], Opt(
        help='JSON object of chat template arguments, e.g. \'{"enable_thinking": false}\' (a request\'s '
             'chat_template_kwargs win).')] = None,
    data_parallel_size: Annotated[Optional[int], Opt(
        "--data-parallel-size", "-dp",
        help="Engine replicas behind this server, each with its own CPUs (an even split of the allowed "
             "cores, or one --omp-threads-bind list per replica: '0-31|32-63') and its own KV cache; "
             "new requests go to the least loaded one (default 1).")] = None,
    distributed_executor_backend: Annotated[Optional[str], Opt(
        help="How replicas and tensor-parallel ranks run: mp (local processes, the default) | ray (Ray actors; "
             "pip install \"appliance[ray]\").")] = None,
    config: Annotated[Optional[str], Opt(
        help="YAML file of flag values (keys: flag names, e.g. max-model-len: 4096); flags given here win.")] = None,
):
    """Serve a model over an OpenAI-compatible HTTP API."""
    from types import SimpleNamespace

    from appliance.config import EngineConfig
    from appliance.errors import ApplianceError
    from appliance.server.launcher import ServerConfig, serve as run_server

    from appliance import vllm_compat

    # Every parameter by name, so a --config file can set any of them (the command line wins there).
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ctx.params.items() if k != "config"}
    if config is not None:
        try:
            values.update(vllm_compat.config_file_values(ctx, config))
        except ApplianceError as e:
            _fail(str(e), 2)
    a = SimpleNamespace(**values)
    kv_cache_memory = a.kv_cache_memory
    if a.kv_cache_memory_bytes is not None:
        if kv_cache_memory is not None:
            _fail(f"give one of --kv-cache-memory ({kv_cache_memory} GiB) and --kv-cache-memory-bytes "
                  f"({a.kv_cache_memory_bytes}), not both", 2)
        try:
            kv_cache_memory = vllm_compat.bytes_to_gib(
                vllm_compat.parse_size("--kv-cache-memory-bytes", a.kv_cache_memory_bytes))
        except ApplianceError as e:
            _fail(str(e), 2)
    if a.model is not None and a.model_opt is not None and a.model != a.model_opt:
        _fail(f"the model is given twice: {a.model!r} and --model {a.model_opt!r}", 2)
    model = a.model if a.model is not None else a.model_opt
    engine_kwargs = dict(
        model=model, tokenizer=a.tokenizer, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
        num_kv_blocks=a.num_kv_blocks, block_size=a.block_size, dtype=a.dtype, enable_prefix_caching=a.prefix_caching,
        attention_backend=a.attention_backend, long_prefill_token_threshold=a.long_prefill_token_threshold,
        # a server streams: protect running decodes unless told otherwise (the offline LLM defaults off)
        itl_target=a.itl_target if a.itl_target is not None else os.environ.get("APPLIANCE_ITL_TARGET", "auto"),
        linear_backend=a.linear_backend, quantization=a.quantization, quant_group_size=a.quant_group_size,
        batch_invariant=a.batch_invariant,
        num_threads=a.num_threads, seed=a.seed, allocator=a.allocator,
        omp_threads_bind=a.omp_threads_bind, runner=a.runner, pooler_config=a.pooler_config,
        speculative_config=a.speculative_config,
        device=a.device, gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
        data_parallel_size=a.data_parallel_size, distributed_executor_backend=a.distributed_executor_backend,
        kv_cache_dtype=a.kv_cache_dtype,
        tensor_parallel_size=a.tensor_parallel_size,
    )
    try:
        engine_kwargs.update(vllm_compat.vllm_env_engine_kwargs(engine_kwargs))
        # Only flags given on the command line; unset ones come from APPLIANCE_* or the defaults.
        engine_config = EngineConfig.from_kwargs(**{k: v for k, v in engine_kwargs.items()
                                                    if v is not None or k == "model"})
        server_config = ServerConfig(host=a.host, port=a.port, served_model_name=a.served_model_name or None,
                                     api_key=a.api_key or vllm_compat.vllm_env_api_keys() or None,
                                     max_queued_requests=a.max_queued_requests, shutdown_timeout=a.shutdown_timeout,
                                     log_level=a.log_level.lower(),
                                     uvicorn_log_level=a.uvicorn_log_level.lower() if a.uvicorn_log_level else None,
                                     allowed_origins=a.allowed_origins or None,
                                     allowed_methods=a.allowed_methods or None,
                                     allowed_headers=a.allowed_headers or None, allow_credentials=a.allow_credentials,
                                     ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile,
                                     root_path=a.root_path or "", generation_config=a.generation_config,
                                     enable_auto_tool_choice=a.enable_auto_tool_choice,
                                     tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                                     chat_template=a.chat_template,
                                     default_chat_template_kwargs=a.default_chat_template_kwargs)
        from appliance.server.chat_tools import ChatOptions

        ChatOptions.from_flags(a.enable_auto_tool_choice, a.tool_call_parser, a.reasoning_parser, a.chat_template,
                               a.default_chat_template_kwargs)  # bad chat flags: exit 2 before anything starts
        from appliance.server.dp_client import check_backend, replica_placements, uses_replica_set

        check_backend(engine_config)  # ray asked for but missing, too many replicas for the CPUs: exit 2
        if uses_replica_set(engine_config):  # one engine (tensor parallel included) resolves its own ranks
            replica_placements(engine_config)
    except ApplianceError as e:
        _fail(str(e), 2)
    try:
        code = run_server(engine_config, server_config)
    except ApplianceError as e:
        _fail(str(e), 1)
    raise typer.Exit(code)


SPEC_HELP = ('Speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", "model": PATH, '
             '"num_speculative_tokens": 3}; also "disable_by_batch_size" (default 8) and '
             '"min_acceptance_rate" (default 0.2).')

@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text.")],
    model: Annotated[Optional[str], typer.Option(help="HF model directory or .gguf file; default: the embedded model")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt as a user message in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message (with --chat).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 or -1: off.")] = 0,
    min_p: Annotated[float, typer.Option()] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Per-request seed.")] = None,
    n: Annotated[int, typer.Option(help="Number of completions.")] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    repetition_penalty: Annotated[float, typer.Option()] = 1.0,
    presence_penalty: Annotated[float, typer.Option()] = 0.0,
    frequency_penalty: Annotated[float, typer.Option()] = 0.0,
    min_tokens: Annotated[int, typer.Option()] = 0,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past the end-of-sequence token.")] = False,
    dtype: Annotated[Optional[str], typer.Option(help="auto | float32 | bfloat16.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length (default: the model's).")] = None,
    kv_cache_memory: Annotated[Optional[float], typer.Option(help="KV cache size in GiB.")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Tokens per KV block.")] = None,
    attention_backend: Annotated[Optional[str], typer.Option(help="auto | native | reference | cuda (Triton kernels).")] = None,
    linear_backend: Annotated[Optional[str], typer.Option(help="auto (measured per shape) | torch | onednn | native | w8a8_onednn | ...")] = None,
    quantization: Annotated[Optional[str], typer.Option(help="Quantize at load: none | w8a8 | w4a8; gguf: a GGUF's projections as the file stores them.")] = None,
    quant_group_size: Annotated[Optional[int], typer.Option(help="W4 group size.")] = None,
    num_threads: Annotated[Optional[int], typer.Option(help="Threads for the model.")] = None,
    speculative_config: Annotated[Optional[str], typer.Option(help=SPEC_HELP)] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option(
        help="KV cache storage: auto | bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2 | int8.")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(
        "--tensor-parallel-size", "-tp", help="Ranks the model is sharded over (default 1).")] = None,
):
    """Generate from one prompt with the offline engine, streaming to the terminal."""
    from appliance.config import EngineConfig
    from appliance.errors import ApplianceError
    from appliance.generate import run_generate
    from appliance.sampling_params import SamplingParams

    engine_kwargs = dict(model=model, dtype=dtype, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                         block_size=block_size, attention_backend=attention_backend, linear_backend=linear_backend,
                         quantization=quantization, quant_group_size=quant_group_size, num_threads=num_threads,
                         speculative_config=speculative_config, kv_cache_dtype=kv_cache_dtype,
                         tensor_parallel_size=tensor_parallel_size)
    try:
        config = EngineConfig.from_kwargs(**{k: v for k, v in engine_kwargs.items() if v is not None or k == "model"})
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                stop=stop, max_tokens=max_tokens, repetition_penalty=repetition_penalty,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                min_tokens=min_tokens, ignore_eos=ignore_eos)
        run_generate(config, prompt, params, chat=chat, system=system)
    except ApplianceError as e:
        _fail(str(e), 2)


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Float Hugging Face model directory.")],
    dst: Annotated[str, typer.Argument(help="Output directory (compressed-tensors layout).")],
    quantization: Annotated[str, Opt(help="w8a8 | w4a8.")] = "w8a8",
    quant_group_size: Annotated[int, Opt(help="W4 group size along the input dimension.")] = 32,
):
    """Write a quantized checkpoint (compressed-tensors layout) that `serve`/`generate` load back."""
    from appliance.convert import run_convert
    from appliance.errors import ApplianceError

    try:
        out = run_convert(src, dst, quantization, quant_group_size)
    except (ApplianceError, ValueError) as e:
        _fail(str(e), 2)
    typer.echo(f"wrote {out}")


@app.command()
def doctor(json: Annotated[bool, Opt("--json", help="Print the report as JSON (schema in appliance.doctor).")] = False,
           model: Annotated[Optional[str], Opt("--model", help="Also load this model (a directory or .gguf "
                                               "file) and show, per layer group, its stored format, the method "
                                               "it runs with and the resident weight memory.")] = None,
           quantization: Annotated[str, Opt("--quantization", help="With --model: as `serve --quantization`.")]
           = "none",
           tensor_parallel_size: Annotated[Optional[int], Opt("--tensor-parallel-size", "-tp", help="Show each "
                                           "rank's placement for this tensor-parallel size (as serve).")] = None,
           data_parallel_size: Annotated[Optional[int], Opt("--data-parallel-size", "-dp", help="... and this "
                                         "data-parallel size (as serve).")] = None,
           omp_threads_bind: Annotated[Optional[str], Opt("--omp-threads-bind", help="... and this binding "
                                       "(as serve; VLLM_CPU_OMP_THREADS_BIND read too).")] = None,
           num_threads: Annotated[Optional[int], Opt("--num-threads", help="... and threads per rank (as serve).")]
           = None):
    """Report what this host and process give the engine (CPU, torch build, kernels, allocator, libgomp,
    OpenMP, each rank's placement for the parallel flags given) and how to fix each problem."""
    from appliance.doctor import run_doctor

    placement = {"tensor_parallel_size": tensor_parallel_size, "data_parallel_size": data_parallel_size,
                 "omp_threads_bind": omp_threads_bind, "num_threads": num_threads}
    raise typer.Exit(run_doctor(json=json, model=model, quantization=quantization, placement=placement))


from appliance.bench.cli import bench_app  # noqa: E402  (imports nothing heavy at start-up)

app.add_typer(bench_app, name="bench")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
