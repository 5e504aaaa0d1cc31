"""One frozen config tree (rule 1). Values known only at run time, such as the number of KV blocks,
are returned by the model runner and never written back here.

This module is the only reader of ``APPLIANCE_*`` environment variables for engine settings.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from appliance.errors import InvalidRequestError

DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "native", "reference", "cuda")
DEVICES = ("auto", "cpu", "cuda")  # auto: cuda when torch.cuda.is_available() (appliance/engine/device.py)
LINEAR_BACKENDS = ("auto", "torch", "onednn", "native", "native_bf16",  # float; then quantized (appliance/layers/quant.py)
                   "w8a8_onednn", "w8a8_native", "w8a16_int8pack", "w4a8_dynquant", "w4a16_int4pack",
                   "w4a8_native", "w6a8_native", "w5a8_native")
# "gguf": a GGUF's projections as the file stores them (vLLM's name), each in its type's scheme
QUANTIZATIONS = ("none", "w8a8", "w4a8", "gguf")
ALLOCATORS = ("mimalloc", "glibc-tuned", "system")
# vLLM's --kv-cache-dtype: auto = the model's dtype; "fp8" is fp8_e4m3 (vLLM's alias). The quantized
# ones keep a float32 scale per cached token and KV head (appliance/ops/reference.py, quantize_kv).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# vLLM's --runner: auto = pooling for a pooling architecture (a bare *Model), generate otherwise
RUNNERS = ("auto", "generate", "pooling")
# How replicas and tensor-parallel ranks 1..N-1 run: local processes, or Ray actors (appliance[ray])
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


def _positive(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}", param=name)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. ``model`` None means the embedded default model."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; None: a safe fraction of available RAM
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests force preemption with it)
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no extra per-request cap beyond the budget
    # Step-latency target while decodes run: "off", "auto" or milliseconds (engine/step_cost.py).
    # Off for the offline LLM (throughput); `serve` defaults to auto (streaming users never freeze).
    itl_target: str = "off"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    # --batch-invariant (vLLM's VLLM_BATCH_INVARIANT): a request's logits are the same bits whatever
    # else the step holds and however the engine splits its tokens into steps (batching, chunked
    # prefill, prefix cache, preemption, speculative verify chunks): row-invariant linear methods at
    # every step size and the native ops; CPU only
    batch_invariant: bool = False
    quantization: str = "none"  # quantize a float checkpoint at load (pre-quantized ones say so themselves)
    quant_group_size: int = 32  # W4 group size along the input dimension (W8 is per channel)
    seed: int = 0
    num_threads: int | None = None
    # Process-level: applied when a command starts the engine in its own process (serve, bench);
    # an in-process LLM() cannot preload an allocator into itself.
    allocator: str = "mimalloc"
    omp_threads_bind: str = "auto"
    device: str = "cpu"  # DEVICES; the CPU unless asked: this engine is CPU-first
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the GPU's memory this engine may use (vLLM's)
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    runner: str = "auto"
    # --pooler-config: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool} (a dict or its JSON text);
    # unset fields come from the checkpoint (appliance.layers.pooler.resolve_pooler_config)
    pooler_config: dict | str | None = None
    # --speculative-config (vLLM's JSON): a dict or its JSON text; parsed by speculative_config()
    speculative_config: dict | str | None = None
    # Data parallel (serve): this many engine cores, each with its own CPUs and KV cache, behind one
    # server (appliance/server/dp_client.py); the other fields above are per replica.
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # KV_CACHE_DTYPES: how the KV cache stores K and V (the engine runs on the model's dtype either way)
    kv_cache_dtype: str = "auto"
    # --tensor-parallel-size / -tp (vLLM's name): ranks the model is sharded over (appliance.distributed)
    tensor_parallel_size: int = 1
    # Set by the data-parallel frontend on each replica's copy (dp_client.replica_configs): the replica's
    # index; its omp_threads_bind then lists only this replica's tensor-parallel ranks. None elsewhere.
    data_parallel_rank: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}", "dtype")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}",
                "attention_backend",
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            raise InvalidRequestError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {self.linear_backend!r}",
                "linear_backend",
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}", "quantization")
        _positive("quant_group_size", self.quant_group_size)
        if self.allocator not in ALLOCATORS:
            raise InvalidRequestError(
                f"allocator must be one of {', '.join(ALLOCATORS)}; got {self.allocator!r}", "allocator")
        if self.runner not in RUNNERS:
            raise InvalidRequestError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}", "runner")
        if self.pooler_config is not None:
            from appliance.layers.pooler import parse_pooler_config

            parse_pooler_config(self.pooler_config)  # refuse a bad one before the model loads
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)  # refused before the model loads
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.long_prefill_token_threshold < 0:
            raise InvalidRequestError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
                "long_prefill_token_threshold",
            )
        from appliance.engine.step_cost import parse_itl_target

        try:
            parse_itl_target(self.itl_target)
        except ValueError as e:
            raise InvalidRequestError(str(e), "itl_target") from None
        if self.device not in DEVICES:
            raise InvalidRequestError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}", "device")
        if self.batch_invariant and (self.device == "cuda" or self.attention_backend in ("reference", "cuda")):
            raise InvalidRequestError(
                "batch_invariant needs the CPU's native kernels (the CUDA backend and the reference ops block "
                f"their work by the batch); got device={self.device!r}, attention_backend="
                f"{self.attention_backend!r}", "batch_invariant")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            # not shown yet: the all-reduce's summation order across more than two ranks (gloo splits
            # the message by its size)
            raise InvalidRequestError(
                f"batch_invariant runs with tensor_parallel_size 1 only (not yet tested sharded); got "
                f"{self.tensor_parallel_size}", "batch_invariant")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}", "gpu_memory_utilization")
        if not isinstance(self.data_parallel_size, int) or isinstance(self.data_parallel_size, bool) \
                or self.data_parallel_size < 1:
            raise InvalidRequestError(f"--data-parallel-size must be an integer >= 1, got {self.data_parallel_size!r}",
                                      "data_parallel_size")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise InvalidRequestError(
                f"--distributed-executor-backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; "
                f"got {self.distributed_executor_backend!r}", "distributed_executor_backend")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            from appliance.runtime.threads import engine_cpus

            cpus = len(engine_cpus())
            if self.tensor_parallel_size > cpus:
                raise InvalidRequestError(
                    f"tensor_parallel_size must be at most the {cpus} CPUs available to this process (one rank "
                    f"needs at least one), got {self.tensor_parallel_size}", "tensor_parallel_size")
        if self.data_parallel_rank is not None and not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise InvalidRequestError(f"data_parallel_rank must be in [0, data_parallel_size="
                                      f"{self.data_parallel_size}), got {self.data_parallel_rank!r}",
                                      "data_parallel_rank")
        from appliance.errors import ApplianceError
        from appliance.runtime.threads import check_rank_lists

        # one CPU list per rank: tensor-parallel size x data-parallel size of them (a replica's own
        # copy, data_parallel_rank set, lists its tensor-parallel ranks only)
        ranks = self.tensor_parallel_size * (self.data_parallel_size if self.data_parallel_rank is None else 1)
        try:
            check_rank_lists(self.omp_threads_bind, ranks, "omp_threads_bind")
        except ApplianceError as e:
            raise InvalidRequestError(str(e), "omp_threads_bind") from None
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}", "kv_cache_dtype")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise InvalidRequestError(
                f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}", "kv_cache_memory"
            )

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, filling unset ones from ``APPLIANCE_<NAME>`` env vars."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        for name, f in names.items():
            if name in kwargs or name == "extra":
                continue
            env = os.environ.get(f"APPLIANCE_{name.upper()}")
            if env is not None:
                kwargs[name] = _parse_env(env, f.type)
        return cls(**kwargs)


def _parse_env(value: str, type_name) -> object:
    t = str(type_name)
    if "bool" in t:
        return value.lower() in ("1", "true", "yes", "on")
    if "int" in t:
        return int(value)
    if "float" in t:
        return float(value)
    return value


def cache_dir() -> Path:
    """Where converted models and built kernels live: ``$APPLIANCE_CACHE_DIR``, else ``~/.cache/appliance``."""
    env = os.environ.get("APPLIANCE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "appliance"


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys). ``ngram``: prompt lookup over the
    request's own tokens, the longest suffix match of ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens proposes the ``num_speculative_tokens`` that followed it.
    ``draft_model``: ``model`` (same tokenizer and vocabulary) proposes them autoregressively.
    Speculation is off for a step with more than ``disable_by_batch_size`` running requests, and
    paused for a request whose running acceptance rate falls below ``min_acceptance_rate``. With
    ``cost_aware``, a step verifies each proposing request's first draft and only those further
    drafts whose expected gain (the request's acceptance rate) pays for their share of the step's
    measured time (engine/spec_decode/policy.py); false: every proposed draft. Both are appliance keys: vLLM has no such switches."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int = 8
    min_acceptance_rate: float = 0.2
    cost_aware: bool = True
    # vLLM's key: how the draft's weights run (one of QUANTIZATIONS); None: the target's. A float
    # target drafted by its own GGUF run as "gguf" is a draft much cheaper than the target.
    quantization: str | None = None


def parse_speculative_config(value: dict | str) -> SpeculativeConfig:
    """A SpeculativeConfig from a dict or its JSON text; a bad one raises InvalidRequestError naming
    ``speculative_config.<key>`` and the value."""
    import json

    name = "speculative_config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{name} is not valid JSON ({e}): {value!r}", name) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {value!r}", name)
    keys = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - keys)
    if unknown:
        raise InvalidRequestError(f"{name} has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(keys))}",
                                  f"{name}.{unknown[0]}")
    method = value.get("method")
    if method is None and value.get("model"):
        method = "draft_model"  # vLLM infers the method from a model path
    if method not in SPEC_METHODS:
        raise InvalidRequestError(f"{name}.method must be one of {', '.join(SPEC_METHODS)}; got {method!r}",
                                  f"{name}.method")
    if "num_speculative_tokens" not in value:
        raise InvalidRequestError(f"{name}.num_speculative_tokens is required", f"{name}.num_speculative_tokens")
    cfg = SpeculativeConfig(**{**value, "method": method})
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        _positive(f"{name}.{key}", getattr(cfg, key))
    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise InvalidRequestError(f"{name}.prompt_lookup_min={cfg.prompt_lookup_min} exceeds "
                                  f"prompt_lookup_max={cfg.prompt_lookup_max}", f"{name}.prompt_lookup_min")
    if not isinstance(cfg.min_acceptance_rate, (int, float)) or not 0 <= cfg.min_acceptance_rate <= 1:
        raise InvalidRequestError(f"{name}.min_acceptance_rate must be in [0, 1], got {cfg.min_acceptance_rate!r}",
                                  f"{name}.min_acceptance_rate")
    if not isinstance(cfg.cost_aware, bool):
        raise InvalidRequestError(f"{name}.cost_aware must be true or false, got {cfg.cost_aware!r}",
                                  f"{name}.cost_aware")
    if method == "draft_model" and not cfg.model:
        raise InvalidRequestError(f"{name}.model is required with method draft_model, got {cfg.model!r}",
                                  f"{name}.model")
    if cfg.quantization is not None and cfg.quantization not in QUANTIZATIONS:
        raise InvalidRequestError(f"{name}.quantization must be one of {', '.join(QUANTIZATIONS)}; got "
                                  f"{cfg.quantization!r}", f"{name}.quantization")
    if method == "ngram" and cfg.model is not None:
        raise InvalidRequestError(f"{name}.model applies to method draft_model only; got model={cfg.model!r} "
                                  f"with method ngram", f"{name}.model")
    return cfg
