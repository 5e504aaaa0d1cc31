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
LINEAR_BACKENDS = ("auto", "torch", "onednn", "native",  # float; then quantized (appliance/layers/quant.py)
                   "w8a8_onednn", "w8a8_native", "w8a16_int8pack", "w4a8_dynquant", "w4a16_int4pack",
                   "w4a8_native", "w6a8_native")
# "gguf": a GGUF's projections as the file stores them (vLLM's name), each in its type's scheme
QUANTIZATIONS = ("none", "w8a8", "w4a8", "gguf")
ALLOCATORS = ("mimalloc", "glibc-tuned", "system")
# vLLM's --runner: auto = pooling for a pooling architecture (a bare *Model), generate otherwise
RUNNERS = ("auto", "generate", "pooling")


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
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}", "gpu_memory_utilization")
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
