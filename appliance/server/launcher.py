"""``appliance serve``: start the engine core process, print the banner, run uvicorn, and shut down
gracefully on SIGTERM / Ctrl-C.

Shutdown: the first SIGTERM or SIGINT closes the listening sockets and refuses new requests (503),
lets in-flight requests finish for up to ``shutdown_timeout`` seconds, aborts what is left, stops
the engine process and returns normally, so the process exits 0. A second Ctrl-C forces the exit.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from appliance.config import EngineConfig
from appliance.errors import ApplianceError
from appliance.server.async_engine import AsyncEngineClient
from appliance.server.metrics import ServerMetrics
from appliance.server.openai_serving import OpenAIServing

log = logging.getLogger("appliance.server")


@dataclass(frozen=True)
class ServerConfig:
    """Server-side settings (the engine's are in ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    # None: the model argument (or the default model's name); several: all answer, the first is reported
    served_model_name: str | list[str] | None = None
    api_key: str | list[str] | None = None  # several: any one authorises
    max_queued_requests: int | None = None  # None: no limit beyond memory
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # None: log_level
    # CORS (off unless allowed_origins is given); vLLM's flags
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    root_path: str = ""
    generation_config: str = "auto"  # auto: the model's sampling defaults; vllm: none
    # Chat: tool calling, reasoning and the chat template (checked by chat_tools.ChatOptions.from_flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # a file or the template itself
    default_chat_template_kwargs: dict | str | None = None

    @property
    def served_model_names(self) -> list[str]:
        n = self.served_model_name
        return [] if not n else [n] if isinstance(n, str) else list(n)

    @property
    def api_keys(self) -> list[str]:
        k = self.api_key
        return [] if not k else [k] if isinstance(k, str) else list(k)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ApplianceError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ApplianceError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout < 0:
            raise ApplianceError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ApplianceError("HTTPS needs both --ssl-keyfile and --ssl-certfile; got only "
                                 + ("--ssl-keyfile" if self.ssl_keyfile else "--ssl-certfile"))
        for flag, f in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if f is not None and not Path(f).is_file():
                raise ApplianceError(f"{flag} {f}: no such file")
        if self.root_path and not self.root_path.startswith("/"):
            raise ApplianceError(f"--root-path must start with '/', got {self.root_path!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ApplianceError(f"--generation-config must be auto or vllm, got {self.generation_config!r} "
                                 "(a directory is not supported)")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level not in levels:
            raise ApplianceError(f"--uvicorn-log-level must be one of {', '.join(levels)}, "
                                 f"got {self.uvicorn_log_level!r}")
        from appliance.server.api import cors_values

        for items in (self.allowed_origins, self.allowed_methods, self.allowed_headers):
            cors_values(items, [])  # a bad JSON list fails here, before the engine starts
        if any(not k for k in self.api_keys):
            raise ApplianceError("--api-key must not be empty")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, shutdown_timeout: float):
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout
        self._term_requested = False
        self._drain_task: asyncio.Task | None = None
        self._dead_since: float | None = None

    def handle_exit(self, sig, frame) -> None:
        # Unlike uvicorn's, this does not re-raise the signal after shutdown: a server stopped by
        # SIGTERM has done what it was asked and exits 0.
        if self._term_requested or self.should_exit:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._term_requested = True

    async def on_tick(self, counter: int) -> bool:
        # An engine (or data-parallel replica) that died: its requests already ended with an error
        # and new ones get 503; stop after a moment for the handlers to send those, and exit non-zero.
        if self.serving.client.dead is not None and not self.should_exit:
            if self._dead_since is None:
                self._dead_since = time.monotonic()
            elif time.monotonic() - self._dead_since > 0.5:
                self.should_exit = True
        if self._term_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        serving, client = self.serving, self.serving.client
        serving.draining = True
        for s in self.servers:  # stop accepting connections now; uvicorn closes them again later
            s.close()
        n = client.num_in_flight
        log.info("shutting down: %d request(s) in flight, waiting up to %.1f s", n, self.shutdown_timeout)
        deadline = time.monotonic() + self.shutdown_timeout
        while client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.num_in_flight:
            log.warning("shutdown timeout (%.1f s): aborting %d request(s)", self.shutdown_timeout,
                        client.num_in_flight)
            serving.abort_all()
            await asyncio.sleep(0.2)  # let the handlers send their last bytes
        self.should_exit = True


def _load_tokenizer(path, from_gguf: bool = False):
    from appliance.engine.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path, from_gguf)
    except Exception as e:  # noqa: BLE001 - tokenizers raise many types for bad files
        raise ApplianceError(f"{path}: cannot load tokenizer ({e})") from e


def print_banner(engine_config: EngineConfig, server: ServerConfig, names: list[str], info: dict) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    from appliance.runtime.cpu_features import detect

    cpu = detect()
    feats = [f for f in ("asimd", "asimddp", "i8mm", "bf16", "sve", "sve2", "avx2", "avx512f", "avx512_bf16",
                         "amx_bf16") if cpu.has(f)]
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan")
    t.add_column()
    t.add_row("model", f"{', '.join(names)}  [dim]{info['model_path']}[/]")
    t.add_row("dtype", info["dtype"])
    t.add_row("kernels", f"{info['kernels']}  [dim]({info['num_threads']} threads)[/]")
    if info.get("linear"):
        t.add_row("linear", ", ".join(f"{g} {b}" for g, b in info["linear"].items()))
    if info.get("weights"):
        from rich.markup import escape

        from appliance.layers.weight_report import format_groups

        t.add_row("weights", escape(format_groups(info["weights"])))
    t.add_row("cpu", f"{cpu.model_name} [dim]{cpu.arch} {' '.join(feats)}[/]")
    t.add_row("KV cache", f"{info['num_kv_blocks']} blocks x {info['block_size']} tokens = "
                          f"{info['num_kv_blocks'] * info['block_size']} tokens ({info['kv_cache_gib']:.2f} GiB), "
                          f"prefix caching {'on' if info['prefix_caching'] else 'off'}")
    t.add_row("limits", f"max_model_len {info['max_model_len']}, max_num_seqs {info['max_num_seqs']}, "
                        f"max_num_batched_tokens {info['max_num_batched_tokens']}, max_queued_requests "
                        f"{server.max_queued_requests if server.max_queued_requests is not None else 'unlimited'}")
    t.add_row("scheduling", f"itl_target {info.get('itl_target', 'off')} (while decodes run, new prompts are "
                            f"chunked to keep each step within it)")
    if info.get("speculative"):
        t.add_row("speculative", info["speculative"])
    if info.get("runner") == "pooling":
        pc = info.get("pooler_config") or {}
        t.add_row("runner", f"pooling: /v1/embeddings ({pc.get('pooling_type')}, "
                            f"{'normalized' if pc.get('normalize') else 'not normalized'})")
    t.add_row("auth", "API key required" if server.api_keys else "none (set --api-key or APPLIANCE_API_KEY)")
    t.add_row("engine", f"core process pid {info['pid']}")
    if info.get("tensor_parallel"):
        tp = info["tensor_parallel"]
        t.add_row("tensor parallel", f"{tp['world_size']} ranks ({tp['communicator']}); workers "
                  + ", ".join(f"pid {p}" for p in tp["worker_pids"]))
    if info.get("replicas"):
        t.add_row("data parallel", f"{len(info['replicas'])} replicas ({info['distributed_executor_backend']}): "
                  + "; ".join(f"pid {r['pid']} CPUs {r['cpus']}"
                              + (f" (tensor parallel: ranks on {r['ranks']})" if r.get("ranks") else "")
                              for r in info["replicas"]))
    if info.get("runtime"):
        from appliance.runtime.worker import describe

        for k, v in describe(info["runtime"]).items():
            t.add_row(k, v)
    if info.get("default_sampling"):
        t.add_row("sampling", f"defaults from the model: {info['default_sampling']}")
    scheme = "https" if server.ssl_certfile else "http"
    t.add_row("address", f"[bold green]{scheme}://{server.host}:{server.port}{server.root_path}/v1[/]")
    import appliance

    Console(stderr=True).print(Panel(t, title=f"appliance {appliance.__version__}", expand=False))


def serve(engine_config: EngineConfig, server: ServerConfig) -> int:
    """Run the server until SIGTERM / Ctrl-C. Returns the process exit code."""
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from appliance.models.default_model import resolve_model_source, tokenizer_path
    from appliance.server.chat_tools import ChatOptions

    chat_options = ChatOptions.from_flags(  # bad flags fail here, before the model loads
        server.enable_auto_tool_choice, server.tool_call_parser, server.reasoning_parser, server.chat_template,
        server.default_chat_template_kwargs)
    model_path = resolve_model_source(engine_config.model)  # once, here: the core gets a plain path
    names = server.served_model_names or [engine_config.model if engine_config.model is not None
                                          else _default_name()]
    from appliance.server.dp_client import DPEngineClient, uses_replica_set

    client_cls = DPEngineClient if uses_replica_set(engine_config) else AsyncEngineClient
    client = client_cls(engine_config.replace(model=str(model_path)),
                        log_level=logging.getLevelName(server.log_level.upper()))
    t0 = time.perf_counter()
    client.start_process()
    try:
        # while the core loads the model
        tokenizer = _load_tokenizer(engine_config.tokenizer or tokenizer_path(model_path),
                                    from_gguf=engine_config.tokenizer is None and model_path.is_file())
        info = client.wait_ready()
    except BaseException:
        client.shutdown(timeout=2)
        raise
    log.info("engine ready in %.1f s", time.perf_counter() - t0)
    for i, r in enumerate(info.get("replicas", [])):
        log.info("data-parallel replica %d: pid %d, %d threads on CPUs %s, %d KV blocks%s", i, r["pid"],
                 r["num_threads"], r["cpus"], r["num_kv_blocks"], f", host {r['host']}" if r.get("host") else "")
    metrics = ServerMetrics(names[0])
    metrics.runtime = info.get("runtime") or {}
    serving = OpenAIServing(client, tokenizer, names, metrics, server.max_queued_requests, chat_options)
    if server.generation_config == "auto":
        from appliance.generation_defaults import load_generation_defaults

        serving.default_sampling = load_generation_defaults(model_path)
        if serving.default_sampling:
            log.info("Default sampling parameters from the model: %s", serving.default_sampling)
            info["default_sampling"] = serving.default_sampling

    async def on_shutdown():
        serving.abort_all()
        await asyncio.to_thread(client.shutdown)

    from appliance.server.api import build_app

    app = build_app(serving, server.api_keys or None, on_startup=client.attach, on_shutdown=on_shutdown)
    if server.allowed_origins:
        from appliance.server.api import add_cors

        add_cors(app, server)
    config = uvicorn.Config(app, host=server.host, port=server.port,
                            log_level=server.uvicorn_log_level or server.log_level, access_log=False,
                            timeout_graceful_shutdown=2, lifespan="on", ssl_keyfile=server.ssl_keyfile,
                            ssl_certfile=server.ssl_certfile, root_path=server.root_path)
    print_banner(engine_config, server, names, info)
    srv = _Server(config, serving, server.shutdown_timeout)
    try:
        srv.run()
    finally:
        client.shutdown(timeout=2)
    if not srv.started:
        return 1  # uvicorn could not bind (it logged why)
    if client.dead is not None:
        log.error("server stopped because the engine failed: %s", client.dead)
        return 1
    log.info("server stopped")
    return 0


def _default_name() -> str:
    try:
        from appliance.models.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    except ImportError:
        return "default"
