"""The engine core process: an ``LLMEngine`` stepping in a loop, driven by typed messages.

The frontend (HTTP, tokenization, chat templates, detokenization, stop strings, SSE) lives in
another process, so a model step never blocks the event loop and neither an HTTP request nor
detokenization delays a step. The two talk over a pair of ``multiprocessing`` pipes. The core
sends *deltas* (new token ids, new logprobs, how a sequence ended), not the engine's cumulative
outputs, so a step's message stays small however long the outputs grow. The core never decodes
text: the frontend does, and when a stop string ends a sequence it sends ``StopSequences`` (or
``AbortRequests`` when no sequence of the request is left).

Invariants: every message is one of the dataclasses below; the core answers a ``GetStats`` between
two steps (never mid-step); a request the core refuses gets exactly one ``RequestError`` and no
output; an aborted request gets no further output.
"""
from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field

from appliance.config import EngineConfig
from appliance.errors import ApplianceError, InvalidRequestError
from appliance.sampling_params import SamplingParams

log = logging.getLogger("appliance.engine_core")


# -- frontend -> core -------------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class StopSequences:
    request_id: str
    indices: list[int]  # sequences (choices) of the request that a stop string ended


@dataclass
class GetStats:
    ticket: int


@dataclass
class Shutdown:
    pass


# -- core -> frontend -------------------------------------------------------------------------------
@dataclass
class Ready:
    info: dict  # model path, dtype, kernels, KV blocks, limits: what the frontend and banner need


@dataclass
class StartupFailed:
    message: str


@dataclass
class ChoiceDelta:
    index: int
    text: str  # new stable text since the previous delta of this choice (filled in by the frontend)
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per new token
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestDelta:
    request_id: str
    choices: list[ChoiceDelta]  # only the choices that changed
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # sent once, with the request's first delta
    first: bool = False
    queue_time: float | None = None  # seconds from arrival in the core to first scheduled; first delta only
    embedding: list[float] | None = None  # a pooling request's vector (its one, final delta)


@dataclass
class StepOutputs:
    deltas: list[RequestDelta]
    stats: dict = field(default_factory=dict)


@dataclass
class RequestError:
    request_id: str
    message: str
    param: str | None


@dataclass
class Stats:
    ticket: int
    stats: dict


@dataclass
class EngineDead:
    message: str


def engine_stats(engine) -> dict:
    pool = engine.kv.pool
    return {
        "num_running": engine.scheduler.num_running,
        "num_waiting": engine.scheduler.num_waiting,
        "kv_cache_usage": engine.kv_cache_usage(),
        "prefix_cache_queries": pool.num_queries,
        "prefix_cache_hits": pool.num_hits,
        "num_preemptions": engine.scheduler.num_preemptions,
        "steps": engine.stats["steps"],
        "prefill_capped_steps": engine.scheduler.num_capped_steps,
        # speculative decoding counters (spec_decode_*), only when it is configured
        **(engine.spec.stats() if getattr(engine, "spec", None) is not None else {}),
    }


def _weight_groups(runner) -> list[dict]:
    """Per layer group: stored format, method, layers, resident bytes (``appliance.layers.weight_report``)."""
    from appliance.layers.weight_report import as_dicts, weight_groups

    model = getattr(runner, "model", None)
    return as_dicts(weight_groups(model)) if model is not None else []


def engine_info(engine) -> dict:
    runner = engine.runner
    ops = getattr(runner, "ops", None)
    kernels = getattr(ops, "__name__", str(ops)).rsplit(".", 1)[-1]
    import torch

    return {
        "model_path": str(engine.model_path),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "kernels": kernels,
        "linear": getattr(runner, "linear_groups", {}),
        "weights": _weight_groups(runner),
        "num_kv_blocks": runner.num_blocks,
        "block_size": engine.config.block_size,
        "kv_sliding_window": engine.kv.sliding_window,
        "max_chunk_tokens": engine.max_chunk_tokens,
        "kv_cache_gib": runner.num_blocks * runner.bytes_per_block / (1 << 30),
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "prefix_caching": engine.config.enable_prefix_caching,
        "itl_target": engine.config.itl_target,
        "speculative": engine.spec.describe() if getattr(engine, "spec", None) is not None else None,
        "num_threads": torch.get_num_threads(),
        "pid": os.getpid(),
        **tensor_parallel_info(runner),
        **pooling_info(engine),
    }


def tensor_parallel_info(runner) -> dict:
    """A tensor-parallel engine's ranks (``distributed.executor.TPExecutor``): size, all-reduce, workers."""
    if getattr(runner, "world_size", 1) <= 1:
        return {}
    return {"tensor_parallel": {"world_size": runner.world_size, "communicator": runner.communicator,
                                "worker_pids": [p.pid for p in runner.procs]}}


def pooling_info(engine) -> dict:
    """What /v1/embeddings needs to check a request: the runner, the hidden size, matryoshka dimensions."""
    from appliance.layers.pooler import matryoshka_dimensions

    allowed, only = matryoshka_dimensions(engine.info.hf_config)
    pc = engine.pooler_config
    return {"runner": engine.runner_type, "hidden_size": engine.runner.model.config.hidden_size,
            "matryoshka": allowed, "matryoshka_dimensions": only,
            "pooler_config": None if pc is None else {"pooling_type": pc.pooling_type, "normalize": pc.normalize}}


class EngineCore:
    """Turns the engine's cumulative ``RequestOutput``s into ``RequestDelta``s."""

    def __init__(self, engine):
        self.engine = engine
        # request id -> per choice [sent token count, finish sent]
        self.sent: dict[str, list[list[int]]] = {}

    def add(self, msg: AddRequest) -> RequestError | None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except InvalidRequestError as e:
            return RequestError(msg.request_id, str(e), e.param)
        self.sent[msg.request_id] = [[0, 0] for _ in range(msg.params.n)]
        return None

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for rid in request_ids:
            self.sent.pop(rid, None)

    def stop(self, msg: StopSequences) -> None:
        if self.engine.stop_sequences(msg.request_id, msg.indices):
            self.sent.pop(msg.request_id, None)
        elif msg.request_id in self.sent:
            for i in msg.indices:
                self.sent[msg.request_id][i][1] = 1  # the frontend already knows how it ended

    def step(self) -> list[RequestDelta]:
        deltas = []
        for out in self.engine.step():
            sent = self.sent.get(out.request_id)
            if sent is None:  # aborted while in the step
                continue
            if getattr(out.outputs, "embedding", None) is not None:  # a pooling request: done in one delta
                del self.sent[out.request_id]
                deltas.append(RequestDelta(out.request_id, [], True, out.num_cached_tokens, first=True,
                                           embedding=out.outputs.embedding))
                continue
            first = all(s[0] == 0 for s in sent)
            choices = []
            for c in out.outputs:
                s = sent[c.index]
                if s[1] or (len(c.token_ids) == s[0] and c.finish_reason is None):
                    continue  # ended earlier (and said so), or nothing new
                choices.append(ChoiceDelta(
                    c.index, "", c.token_ids[s[0]:],
                    c.logprobs[s[0]:] if c.logprobs is not None else None,
                    c.cumulative_logprob, c.finish_reason, c.stop_reason))
                s[0], s[1] = len(c.token_ids), c.finish_reason is not None
            if out.finished:
                del self.sent[out.request_id]
            deltas.append(RequestDelta(out.request_id, choices, out.finished, out.num_cached_tokens,
                                       out.prompt_logprobs if first else None, first,
                                       _queue_time(out.metrics) if first else None))
        return deltas


def _queue_time(m: dict) -> float | None:
    if m.get("scheduled_time") is None or m.get("arrival_time") is None:
        return None
    return m["scheduled_time"] - m["arrival_time"]


def run_engine_core(config: EngineConfig, in_conn, out_conn, log_level: int = logging.INFO,
                    placement=None) -> None:
    """Entry point of the engine process (spawned). Returns when told to shut down or when the
    frontend goes away (its end of the pipe closes)."""
    # Ctrl-C and a group-wide SIGTERM (systemd, `timeout`, docker --init) reach this process too;
    # the frontend decides when the core stops (Shutdown message), or the core sees the pipe close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(message)s")
    core, msg = start_engine_core(config, placement)
    out_conn.send(msg)
    if core is not None:
        serve_engine_core(core, in_conn, out_conn)


def start_engine_core(config: EngineConfig, placement=None) -> tuple[EngineCore | None, Ready | StartupFailed]:
    """Pin this process, load the model and warm it up: (the core, Ready) or (None, StartupFailed).
    Shared by the spawned process above and the Ray actor (appliance/server/ray_executor.py)."""
    try:
        from appliance.engine.llm_engine import LLMEngine
        from appliance.runtime.worker import worker_startup

        runtime = worker_startup(placement)  # pin threads; confirm mimalloc / libgomp are live
        engine = LLMEngine(config, detokenize=False)
        _warm_up(engine)
        info = engine_info(engine)
        info["runtime"] = runtime
    except ApplianceError as e:
        return None, StartupFailed(str(e))
    except Exception as e:  # noqa: BLE001 - report any load failure to the frontend, then exit
        return None, StartupFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return EngineCore(engine), Ready(info)


def serve_engine_core(core: EngineCore, in_conn, out_conn) -> None:
    """Run the message loop until Shutdown or the frontend's end closes. ``in_conn`` needs
    ``poll(timeout)`` and ``recv()``, ``out_conn`` ``send(msg)`` (a Pipe's ends, or queues in an actor)."""
    try:
        _loop(core, in_conn, out_conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the frontend is gone: nothing left to serve
    except Exception as e:  # noqa: BLE001 - the frontend must learn why the core died
        log.exception("engine core failed")
        try:
            out_conn.send(EngineDead(f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass


def _warm_up(engine) -> None:
    """One short greedy request before serving: the first forward of each shape is slow (kernel
    and allocator set-up), and the first user should not pay for it. The prompt is shorter than a
    block, so nothing enters the prefix cache; the counters are reset so /metrics starts at zero."""
    n = max(1, min(8, engine.config.block_size - 1, engine.max_model_len - 3))
    if engine.runner_type == "pooling":
        from appliance.pooling_params import PoolingParams

        engine.add_request("__warmup__", list(range(1, n + 1)), PoolingParams())
    else:
        engine.add_request("__warmup__", list(range(1, n + 1)), SamplingParams(max_tokens=2, temperature=0.0,
                                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.pool.num_queries = engine.kv.pool.num_hits = 0


def _loop(core: EngineCore, in_conn, out_conn) -> None:
    engine = core.engine
    while True:
        # Idle: block until the frontend sends something. Busy: only drain what is already there.
        if not engine.has_unfinished_requests():
            in_conn.poll(None)
        replies = []
        while in_conn.poll(0):
            msg = in_conn.recv()
            if isinstance(msg, AddRequest):
                err = core.add(msg)
                if err is not None:
                    replies.append(err)
            elif isinstance(msg, AbortRequests):
                core.abort(msg.request_ids)
            elif isinstance(msg, StopSequences):
                core.stop(msg)
            elif isinstance(msg, GetStats):
                replies.append(Stats(msg.ticket, engine_stats(engine)))
            elif isinstance(msg, Shutdown):
                core.abort(list(core.sent))
                return
        for r in replies:
            out_conn.send(r)
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            deltas = core.step()
            if deltas:
                out_conn.send(StepOutputs(deltas, {**engine_stats(engine),
                                                   "step_s": time.perf_counter() - t0}))
