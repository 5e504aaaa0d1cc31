"""The frontend's handle on the engine core process.

Two small threads move pickled messages across the process boundary so that the event loop never
blocks on a pipe: the writer sends what the loop queued (a full pipe waits in the thread, not in
the loop), the reader receives the core's messages and hands each to the loop in one
``call_soon_threadsafe``. Each request gets an ``asyncio.Queue`` of ``RequestDelta``s.

The core sends token ids only; text is made here, in the event loop, as each step's deltas arrive
(one ``ChoiceText`` per sequence: incremental detokenization and stop strings). When a stop string
ends a sequence, its later tokens are dropped and the core is told to stop it (``StopSequences``),
so the engine loop never spends time on text.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time

from appliance.config import EngineConfig
from appliance.engine.detokenizer import ChoiceText
from appliance.errors import ApplianceError, InvalidRequestError
from appliance.sampling_params import SamplingParams
from appliance.server.engine_core import (
    AbortRequests, AddRequest, EngineDead, GetStats, Ready, RequestDelta, RequestError, Shutdown,
    StartupFailed, Stats, StepOutputs, StopSequences, engine_stats, run_engine_core,
)

log = logging.getLogger("appliance.server")


class EngineDeadError(ApplianceError):
    """The engine core process exited or failed; no request can be served."""


class RequestAborted(ApplianceError):
    """The request was aborted by the server (shutdown) before it finished."""


_ABORTED = object()  # sentinel pushed into a stream when the server aborts it


class RequestStream:
    """One engine request as the frontend sees it. Its deltas go to ``queue`` (shared by the
    sub-requests of one HTTP request, so they can be read as one stream)."""

    def __init__(self, request_id: str, num_prompt_tokens: int, num_seqs: int, q: asyncio.Queue,
                 texts: list[ChoiceText] | None = None):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seqs = num_seqs
        self.queue = q
        self.texts = texts  # one per sequence; None: deltas pass through as the core sent them
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.finish_reasons: dict[int, str] = {}

    def apply_text(self, d: RequestDelta) -> list[int]:
        """Fill in the text of the core's delta ``d`` (in place) and apply stop strings: tokens after
        a stop string are dropped (with their logprobs) and the choice ends with it. Choices that
        already ended are removed. Returns the indices of the sequences a stop string ended here,
        which the core still runs."""
        if self.texts is None:
            return []
        stopped, kept = [], []
        for c in d.choices:
            ct = self.texts[c.index]
            if ct.finished:
                continue  # a stop string ended it; the core had not heard yet
            k = ct.update(c.token_ids, c.finish_reason, c.stop_reason)
            if k < len(c.token_ids):
                if c.logprobs is not None:
                    if c.cumulative_logprob is not None:
                        c.cumulative_logprob -= sum(lp[t] for t, lp in zip(c.token_ids[k:], c.logprobs[k:]))
                    c.logprobs = c.logprobs[:k]
                c.token_ids = c.token_ids[:k]
            c.text = ct.new_text()
            if ct.finished and c.finish_reason is None:
                stopped.append(c.index)
            c.finish_reason, c.stop_reason = ct.finish_reason, ct.stop_reason
            if c.token_ids or c.text or c.finish_reason is not None:
                kept.append(c)
        d.choices = kept
        d.finished = all(ct.finished for ct in self.texts)
        return stopped


async def iterate_streams(streams: list[RequestStream]):
    """Yield the deltas of ``streams`` (which share one queue) until every one has finished.
    Raises what the engine reported: InvalidRequestError, EngineDeadError or RequestAborted."""
    if not streams:
        return
    q = streams[0].queue
    # Count final deltas read from the queue, not ``finished`` flags: the reader may have flagged a
    # stream finished (and queued its last delta) before this generator first runs.
    remaining = len(streams)
    while remaining:
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        if item is _ABORTED:
            raise RequestAborted("the server aborted this request (shutting down)")
        if item.finished:
            remaining -= 1
        yield item


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO):
        self.config = config
        self.log_level = log_level
        self.info: dict = {}
        self.streams: dict[str, RequestStream] = {}
        self.dead: str | None = None
        self.last_stats: dict = {}
        self.on_delta = None  # optional callback(stream, delta): metrics and request logs
        self.tokenizer = None  # the frontend's: turns the core's token ids into text
        self._tickets = itertools.count()
        self._stat_waiters: dict[int, asyncio.Future] = {}
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc = None
        self._threads_started = False
        self._closing = False
        # Set by a data-parallel set (dp_client.py) before start_process: this replica's CPUs and name.
        self.placement = None
        self.name = "appliance-engine-core"
        self.on_dead = None  # optional callback(message), in the event loop, when the core dies

    # -- life cycle ---------------------------------------------------------------------------------
    def start_process(self) -> None:
        """Spawn the core; it starts loading the model. Pair with ``wait_ready``."""
        ctx = mp.get_context("spawn")  # never fork a process that holds torch / tokenizer threads
        in_r, self._in_w = ctx.Pipe(duplex=False)
        self._out_r, out_w = ctx.Pipe(duplex=False)
        from appliance.runtime import threads
        from appliance.runtime.worker import child_environ, worker_env

        # Placement is resolved here: once libgomp loads with OMP_PLACES it pins the child's main
        # thread, so the child could no longer see the CPUs it may use.
        placement = self.placement or threads.engine_placement(
            self.config.omp_threads_bind, self.config.num_threads, self.config.tensor_parallel_size)
        env = worker_env(self.config.allocator, placement=placement)
        self._proc = ctx.Process(target=run_engine_core, name=self.name,
                                 args=(self.config, in_r, out_w, self.log_level, placement), daemon=True)
        with child_environ(env):  # spawn execs a fresh interpreter with this environment (LD_PRELOAD)
            self._proc.start()
        in_r.close()
        out_w.close()

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Block until the core has loaded the model; returns its info. Raises ApplianceError with
        the core's message if loading fails."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._out_r.poll(0.2):
            if not self._proc.is_alive():
                raise ApplianceError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise ApplianceError(f"the engine did not load the model within {timeout} s")
        try:
            msg = self._out_r.recv()
        except EOFError:
            msg = StartupFailed(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
        if isinstance(msg, StartupFailed):
            self._proc.join(5)
            raise ApplianceError(msg.message)
        assert isinstance(msg, Ready), msg
        self.info = msg.info
        return self.info

    def start(self, timeout: float | None = None) -> dict:
        self.start_process()
        return self.wait_ready(timeout)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reader and writer threads that serve ``loop`` (call from inside the loop)."""
        self._loop = loop
        self._threads_started = True
        threading.Thread(target=self._reader, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._writer, name="engine-writer", daemon=True).start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core (aborting whatever it still holds) and reap it."""
        if self._proc is None:
            return
        self._closing = True
        if self._threads_started:
            self._send_q.put(Shutdown())
            self._send_q.put(None)  # stops the writer after it sent Shutdown
        else:
            try:
                self._in_w.send(Shutdown())
            except (OSError, EOFError):
                pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("engine process did not stop within %.1f s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(2)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2)
        self._proc = None

    # -- threads ------------------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            msg = self._send_q.get()
            if msg is None:
                return
            try:
                self._in_w.send(msg)
            except (OSError, EOFError):
                return

    def _reader(self) -> None:
        while True:
            try:
                msg = self._out_r.recv()
            except (EOFError, OSError):
                msg = EngineDead("the engine process exited")
            if not self._deliver(msg):
                return

    def _deliver(self, msg) -> bool:
        """Hand one core message to the event loop (from a reader thread). False when the reader
        should stop: the loop is closed (the server is gone) or the core is dead."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, msg)
        except RuntimeError:
            return False
        return not isinstance(msg, EngineDead)

    # -- in the event loop ------------------------------------------------------------------------
    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineDead) and self._closing:
            return
        if isinstance(msg, StepOutputs):
            self.last_stats = msg.stats
            for d in msg.deltas:
                stream = self.streams.get(d.request_id)
                if stream is None:
                    continue  # aborted or stopped by us; the core may have produced one more step
                stopped = stream.apply_text(d)
                if stopped:
                    self._send_q.put(StopSequences(d.request_id, stopped))
                if self.on_delta is not None:
                    self.on_delta(stream, d)
                if d.finished:
                    stream.finished = True
                    del self.streams[d.request_id]
                stream.queue.put_nowait(d)
        elif isinstance(msg, RequestError):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.finished = True
                stream.queue.put_nowait(InvalidRequestError(msg.message, msg.param))
        elif isinstance(msg, Stats):
            self.last_stats = msg.stats
            fut = self._stat_waiters.pop(msg.ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, EngineDead):
            if self.dead is None:
                self.dead = msg.message
                log.error("engine core died: %s", msg.message)
            for stream in self.streams.values():
                stream.finished = True
                stream.queue.put_nowait(EngineDeadError(f"the engine failed: {msg.message}"))
            self.streams.clear()
            for fut in self._stat_waiters.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError(msg.message))
            self._stat_waiters.clear()
            if self.on_dead is not None:
                self.on_dead(msg.message)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    queue: asyncio.Queue | None = None) -> RequestStream:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead}")
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        if self.tokenizer is None:
            raise RuntimeError("AsyncEngineClient.tokenizer must be set before adding requests")
        # a pooling request (PoolingParams) has no text: its one delta carries the vector
        texts = (None if not isinstance(params, SamplingParams)
                 else [ChoiceText(self.tokenizer, prompt_token_ids, params) for _ in range(params.n)])
        stream = RequestStream(request_id, len(prompt_token_ids), params.n,
                               queue if queue is not None else asyncio.Queue(), texts)
        self.streams[request_id] = stream
        self._send_q.put(AddRequest(request_id, list(prompt_token_ids), params))
        return stream

    def abort(self, request_ids: list[str], notify: bool = False) -> None:
        """Abort requests in the core. Their streams end: silently, or with RequestAborted if
        ``notify`` (server-side aborts, so the handler can tell the client)."""
        live = []
        for rid in request_ids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                live.append(rid)
                stream.finished = True
                if notify:
                    stream.queue.put_nowait(_ABORTED)
        if live:
            self._send_q.put(AbortRequests(live))

    async def get_stats(self, timeout: float = 5.0) -> dict:
        """A fresh snapshot from the core (answered between two steps); the last one seen if the
        core is busier than ``timeout``."""
        if self.dead is not None:
            return self.last_stats
        ticket = next(self._tickets)
        fut = self._loop.create_future()
        self._stat_waiters[ticket] = fut
        self._send_q.put(GetStats(ticket))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._stat_waiters.pop(ticket, None)
            return self.last_stats

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)


__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestAborted", "RequestStream", "engine_stats", "iterate_streams"]
