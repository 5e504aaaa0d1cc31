"""Rank 0 of a tensor-parallel engine: it starts ranks 1..N-1 and drives them step by step.

``TPExecutor`` stands where the engine's ``ModelRunner`` stands (``LLMEngine`` builds one when
``tensor_parallel_size > 1``) and answers like it: the engine's scheduler, sampler and
detokenizer run in this process, unchanged, on rank 0's runner. Each step rank 0 sends the
schedule to the workers as plain ints (per request: first position, token count, the tokens, the
block ids, its length), then every rank runs the same forward (the sharded layers meet in their
all-reduces and in the logits gather) and rank 0 samples.

The schedule goes over one pipe per worker, pickled once. ``bench/bench_tp_message.py`` (2 ranks,
loopback, this shared 2-core host under load from other jobs, so noisy): a pipe round trip took
0.15-0.6 ms for 1-16 decode requests and 3.9 ms for 256, gloo's ``broadcast_object`` plus a
barrier 6-15 ms (two collectives for the object: its size, then its bytes).

Workers are spawned (never forked: this process holds torch threads), each pinned with
``runtime.worker.worker_startup`` to its share of the CPUs. They exit when rank 0 does (their
pipe reaches EOF; daemonic processes are also ended by multiprocessing at exit). A worker that
dies makes the next step (or the collective in flight, which gloo ends when the peer's socket
closes) raise ``TensorParallelError`` naming the rank, its pid and exit code; nothing waits
without a timeout.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import time
import traceback

import torch

from appliance.errors import ApplianceError, InvalidRequestError, ModelLoadError

log = logging.getLogger("appliance")

# Every collective's limit (gloo's timeout): a rank that dies is noticed at once through its closed
# socket; this bounds a rank that hangs.
COLLECTIVE_TIMEOUT_S = 60.0
# Spawning a worker, importing torch and loading a model on a busy host.
STARTUP_TIMEOUT_S = 600.0


class TensorParallelError(ApplianceError):
    """A tensor-parallel rank failed (died, raised, or never started); the engine cannot continue."""


def check_tensor_parallel(config, info, device: torch.device) -> None:
    """Refuse, before anything starts, a tensor-parallel size this model or device cannot run."""
    from appliance.models.registry import check_tp_sizes, tensor_parallel_architectures

    n = config.tensor_parallel_size
    supported = tensor_parallel_architectures()
    if info.architecture not in supported:
        raise ModelLoadError(f"tensor_parallel_size={n}: architecture {info.architecture} does not shard yet; "
                             f"tensor parallelism supports {', '.join(supported)} (use tensor_parallel_size=1)")
    if device.type != "cpu":
        raise InvalidRequestError(f"tensor_parallel_size={n} runs on the CPU (device=cpu); this engine's device is "
                                  f"{device.type} (device={config.device})", "tensor_parallel_size")
    check_tp_sizes(info.architecture, info.hf_config, n)


def rank_placements(config) -> list:
    """Each rank's CPUs (``runtime.threads.Placement``), from ``omp_threads_bind`` by
    ``threads.resolve_ranks``: "0-31|32-63" one list per rank, auto one rank per NUMA node (or the
    physical cores split evenly), among the CPUs this engine process may use."""
    from appliance.errors import ApplianceError
    from appliance.runtime import threads

    n = config.tensor_parallel_size
    allowed = threads.engine_cpus()
    if n > len(allowed):
        raise InvalidRequestError(f"tensor_parallel_size={n} exceeds the {len(allowed)} CPUs available to this "
                                  f"process ({threads.format_cpu_list(allowed)})", "tensor_parallel_size")
    try:
        return threads.resolve_ranks(config.omp_threads_bind, n, config.num_threads, allowed=set(allowed))
    except ApplianceError as e:
        raise InvalidRequestError(str(e), "omp_threads_bind") from None


def kv_blocks(config, info, dtype: torch.dtype) -> int:
    """The number of KV blocks every rank allocates: what one process would (each rank then holds its
    1/N of the heads, so together they use the memory one process would). Fixed here, before the
    ranks start, so that they agree."""
    from appliance.engine.model_runner import DEFAULT_KV_CAP_GIB, DEFAULT_KV_FRACTION, GiB

    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    hf = info.hf_config
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = hf.get("num_key_value_heads") or heads
    per_block = 2 * hf["num_hidden_layers"] * config.block_size * kv_heads * head_dim * dtype.itemsize
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory * GiB
    else:
        import psutil

        budget = min(DEFAULT_KV_FRACTION * psutil.virtual_memory().available, DEFAULT_KV_CAP_GIB * GiB)
    n = int(budget // per_block)
    if n < 1:
        raise ValueError(f"kv_cache_memory={budget / GiB:.3f} GiB holds no KV block "
                         f"(one block needs {per_block / GiB:.6f} GiB)")
    return n


# ------------------------------------------------------------------ the schedule on the wire

def encode_schedule(sched, plp_rows, kind: str = "execute") -> bytes:
    """A step as plain ints: per scheduled request (first position, tokens, block ids, length, the
    speculative drafts scheduled after them), and
    the batch rows whose prompt logprobs rank 0 computes (the logits gather needs every rank)."""
    reqs = []
    for req, n in sched.scheduled:
        start = req.num_computed_tokens
        num_spec = start + n - req.num_tokens  # > 0: speculative drafts follow the known tokens
        reqs.append((start, req.all_token_ids[start:start + n], list(req.block_ids), req.num_tokens,
                     list(req.spec_token_ids[:num_spec]) if num_spec > 0 else []))
    return pickle.dumps((kind, reqs, sched.num_batched_tokens, sorted(plp_rows or ())),
                        protocol=pickle.HIGHEST_PROTOCOL)


class _Window:
    """The tokens ``[start, start + len(ids))`` of a sequence, indexed by absolute position."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start:s.stop - self.start]


class _WireRequest:
    """What ``ModelRunner._inputs`` reads of a request."""

    __slots__ = ("num_computed_tokens", "all_token_ids", "block_ids", "num_tokens", "spec_token_ids")

    def __init__(self, start, ids, block_ids, num_tokens, spec_token_ids):
        self.num_computed_tokens, self.all_token_ids = start, _Window(start, ids)
        self.block_ids, self.num_tokens = block_ids, num_tokens
        # every rank computes logits at the same rows (the vocab-parallel gather needs it)
        self.spec_token_ids = spec_token_ids


def decode_schedule(reqs, num_batched_tokens):
    from appliance.engine.scheduler import SchedulerOutput

    return SchedulerOutput([(_WireRequest(*r), len(r[1]) + len(r[4])) for r in reqs], num_batched_tokens)


# ------------------------------------------------------------------ the worker process

def worker_main(rank: int, conn, world_size: int, port: int, config, info, dtype, max_model_len: int,
                pooler_config, placement, communicator: str, default_group: bool, host: str = "127.0.0.1") -> None:
    """Ranks 1..N-1: join the group, build this rank's runner, then run every step rank 0 sends
    until told to stop or rank 0's end of the pipe closes."""
    try:
        from appliance.runtime.worker import worker_startup

        worker_startup(placement)
        from appliance.distributed.communicator import make_communicator
        from appliance.distributed.parallel_state import TPGroup, join_group, tp_group_scope
        from appliance.engine.model_runner import ModelRunner
        from appliance.layers.forward_context import ForwardContext, set_forward_context

        conn.send(("hello", os.getpid()))
        pg = join_group(rank, world_size, port, COLLECTIVE_TIMEOUT_S, default_group, host=host)
        comm = make_communicator(communicator, pg, rank, world_size)
        with tp_group_scope(TPGroup(rank, world_size, comm)):
            runner = ModelRunner(config, info, dtype, max_model_len, torch.device("cpu"), pooler_config)
        conn.send(("ready", runner.num_blocks))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # rank 0 is gone
            if msg[0] == "stop":
                return
            if msg[0] == "stats":
                conn.send(("stats", rank_stats(runner)))
                continue
            kind, reqs, num_batched, plp = msg
            sched = decode_schedule(reqs, num_batched)
            if kind == "execute":
                runner.execute(sched, dict.fromkeys(plp))
            else:  # "forward": a pooling step (the hidden states, replicated, are pooled on rank 0)
                with torch.inference_mode():
                    ids, pos, md, _ = runner._inputs(sched)
                    with set_forward_context(ForwardContext(md, runner.kv_caches, runner.ops)):
                        runner.model(ids, pos)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        comm.close()


def rank_stats(runner) -> dict:
    """What a rank reports about its own steps (``TPExecutor.rank_stats``): which forward path ran,
    and which of its layers hold a GGUF K-quant's own scales (``lowbit.pack_kquant``)."""
    model = runner.model
    kq = sorted(name for name, m in model.named_modules()
                if isinstance(getattr(m, "packed", None), dict) and "kf" in m.packed)
    return {"fused_calls": getattr(model, "fused_calls", 0), "kquant_layers": kq}


# ------------------------------------------------------------------ rank 0

class TPExecutor:
    """Rank 0's runner plus the workers; used by the engine as its ``runner`` (every attribute
    other than the steps is rank 0's ``ModelRunner``'s)."""

    def __init__(self, config, info, dtype: torch.dtype, max_model_len: int, device: torch.device,
                 pooler_config=None):
        from appliance.distributed.communicator import communicator_names, make_communicator
        from appliance.distributed.parallel_state import TPGroup, join_group, new_store, tp_group_scope
        from appliance.engine.model_runner import ModelRunner
        from appliance.runtime.worker import worker_env

        n = config.tensor_parallel_size
        check_tensor_parallel(config, info, device)
        placements = rank_placements(config)
        config = config.replace(num_kv_blocks=kv_blocks(config, info, dtype))
        import torch.distributed as dist

        # The shared-memory all-reduce within the host (appliance.distributed.shm_allreduce) sets
        # itself up through torch.distributed's default group: when this process has none yet, the
        # ranks form it (and this executor ends it on close); otherwise (a second tensor-parallel
        # engine in one process) they form a group of their own and reduce through gloo.
        self.default_group = not dist.is_initialized()
        self.communicator = "shm" if self.default_group and "shm" in communicator_names() else "gloo"
        self.world_size = n
        self.broken: str | None = None
        self.procs: list = []
        self.conns: list = []
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        store = new_store(n, timeout_s=STARTUP_TIMEOUT_S)
        self.ray_set = None
        if config.distributed_executor_backend == "ray":  # ranks 1..N-1 as Ray actors (ray_ranks)
            from appliance.distributed.ray_ranks import start_rank_actors
            from appliance.server.dp_client import check_backend

            check_backend(config)  # Ray not installed: refused, saying how to install it

            from appliance.runtime import threads

            def payload_for(r: int, host: str, placement) -> bytes:
                return pickle.dumps((n, store.port, config, info, dtype, max_model_len, pooler_config,
                                     placement, self.communicator, self.default_group, host))

            # each rank's CPUs as planned on the node Ray put it on (on one host: ``placements``)
            self.ray_set, self.procs, placements = start_rank_actors(
                placements, payload_for, lambda p: worker_env(config.allocator, placement=p),
                replica=config.data_parallel_rank, spec=config.omp_threads_bind, num_threads=config.num_threads,
                local_allowed=set(threads.engine_cpus()))
            self.conns = list(self.procs)  # a RayRank is its rank's process and pipe end at once
        else:
            self._spawn(n, store, config, info, dtype, max_model_len, pooler_config, placements)
        try:
            self._await("hello", STARTUP_TIMEOUT_S)
            self._apply_placement(placements[0])
            pg = join_group(0, n, store.port, COLLECTIVE_TIMEOUT_S, self.default_group, store=store)
            self.comm = make_communicator(self.communicator, pg, 0, n)
            self.group = TPGroup(0, n, self.comm)
            with tp_group_scope(self.group):
                self.runner = ModelRunner(config, info, dtype, max_model_len, device, pooler_config)
            blocks = self._await("ready", STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        assert all(b == self.runner.num_blocks for b in blocks), (blocks, self.runner.num_blocks)
        self._store = store  # rank 0 serves the store: it lives as long as the group
        log.info("tensor parallel: %d ranks (%s, %s), worker pids %s", n, self.communicator,
                 config.distributed_executor_backend, [p.pid for p in self.procs])

    def _spawn(self, n, store, config, info, dtype, max_model_len, pooler_config, placements) -> None:
        """Ranks 1..N-1 as spawned local processes, each with a pipe to this one."""
        from appliance.distributed import rank_worker
        from appliance.runtime.worker import child_environ, worker_env

        ctx = mp.get_context("spawn")
        proc_conf = mp.current_process()._config
        daemonic = proc_conf.get("daemon")
        # The server's engine process is daemonic, and multiprocessing refuses children to daemonic
        # processes (lest they be orphaned); these workers end on their own when this process does
        # (EOF on their pipe), so the flag is lifted for the start.
        proc_conf["daemon"] = False
        try:
            for r in range(1, n):
                here, there = ctx.Pipe()
                payload = pickle.dumps((n, store.port, config, info, dtype, max_model_len, pooler_config,
                                        placements[r], self.communicator, self.default_group))
                p = ctx.Process(target=rank_worker.main, name=f"appliance-tp-rank{r}", daemon=True,
                                args=(r, placements[r].cpus, payload, there))
                with child_environ(worker_env(config.allocator, placement=placements[r])):
                    p.start()
                there.close()
                self.procs.append(p)
                self.conns.append(here)
        finally:
            if daemonic:
                proc_conf["daemon"] = daemonic
        self._start_reaper()

    def _start_reaper(self) -> None:
        """Reap each worker the moment it exits. Until its parent reaps it, a dead process is a
        zombie that ``kill(pid, 0)`` still finds, and the shared-memory all-reduce, which watches
        its peers that way, would wait for it until its timeout instead of failing at once."""
        import threading
        from multiprocessing.connection import wait

        procs = list(self.procs)

        def reap():
            left = {p.sentinel: p for p in procs}
            while left:
                for s in wait(list(left)):
                    left.pop(s).join(10)  # its pipe closes a moment before it can be reaped

        threading.Thread(target=reap, name="appliance-tp-reaper", daemon=True).start()

    # -- rank 0's runner answers everything else
    def __getattr__(self, name):
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _apply_placement(self, placement) -> None:
        from appliance.runtime import threads

        threads.apply(placement)

    def _await(self, kind: str, timeout_s: float) -> list:
        """Each worker's ``kind`` message, in rank order; a worker that reports an error, dies or
        says nothing within ``timeout_s`` raises TensorParallelError."""
        deadline = time.monotonic() + timeout_s
        out = []
        for r, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            while not c.poll(0.1):
                if not p.is_alive():
                    raise self._failure(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise self._failure(f"rank {r} (pid {p.pid}) did not report {kind!r} within {timeout_s:.0f} s")
            try:
                msg = c.recv()
            except (EOFError, OSError):
                raise self._failure(f"rank {r} (pid {p.pid}) closed its pipe while starting") from None
            if msg[0] == "error":
                raise self._failure(f"rank {r} (pid {p.pid}) failed while starting:\n{msg[1]}")
            out.append(msg[1])
        return out

    def _failure(self, why: str) -> TensorParallelError:
        self.broken = why
        return TensorParallelError(f"tensor parallel (tensor_parallel_size={self.world_size}): {why}")

    def _dead_workers(self) -> str | None:
        """What happened to the workers that are gone (with an error they reported), or None."""
        gone = []
        for r, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            if p.is_alive():
                continue
            p.join(0)
            detail = ""
            try:
                while c.poll(0):
                    msg = c.recv()
                    if msg[0] == "error":
                        detail = f":\n{msg[1]}"
            except (EOFError, OSError):
                pass
            gone.append(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}{detail}")
        return "; ".join(gone) or None

    def _step(self, payload: bytes, run):
        if self.broken:
            raise TensorParallelError(f"tensor parallel (tensor_parallel_size={self.world_size}) is broken: "
                                      f"{self.broken}")
        dead = self._dead_workers()
        if dead:
            raise self._failure(dead)
        try:
            for c in self.conns:
                c.send_bytes(payload)
            return run()
        except Exception as e:
            # a worker that died mid-step ends the collective in flight (its socket closes)
            deadline = time.monotonic() + 2.0
            while (dead := self._dead_workers()) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            raise self._failure(dead or f"rank 0's step failed ({type(e).__name__}: {e})") from e

    def execute(self, sched, prompt_logprob_rows=None):
        return self._step(encode_schedule(sched, prompt_logprob_rows),
                          lambda: self.runner.execute(sched, prompt_logprob_rows))

    def execute_pooling(self, sched):
        return self._step(encode_schedule(sched, None, "forward"), lambda: self.runner.execute_pooling(sched))

    def rank_stats(self) -> list[dict]:
        """Every rank's ``rank_stats``, in rank order (the workers answer after their pending steps)."""
        for c in self.conns:
            c.send_bytes(pickle.dumps(("stats",)))
        return [rank_stats(self.runner)] + self._await("stats", COLLECTIVE_TIMEOUT_S)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and give this process its CPUs back."""
        for c in self.conns:
            try:
                c.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
        if self.__dict__.get("ray_set") is not None:
            self.ray_set.stop()
            self.ray_set = None
        comm = self.__dict__.get("comm")
        if comm is not None:
            comm.close()
            import torch.distributed as dist

            if self.default_group and dist.is_initialized():
                dist.destroy_process_group()
                if self.communicator == "shm":
                    from appliance.distributed.shm_allreduce import forget_groups

                    forget_groups()
        self.comm = None
        cpus, nthreads = self._saved
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass
        torch.set_num_threads(nthreads)
        self.broken = self.broken or "closed"
