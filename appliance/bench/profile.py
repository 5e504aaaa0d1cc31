"""Where the time goes: an offline workload under ``torch.profiler``, with the engine's parts wrapped
(for the duration of the run only) in timers that are also ``record_function`` ranges, so a Chrome
trace shows them by name.

Buckets are exclusive (a range nested in another is subtracted from its parent):
  linear          every ``Linear.forward`` and ``QuantLinear.forward`` (q/k/v, o, gate/up, down, lm_head);
                  the native gate/up GEMM with silu(gate) * up in its epilogue (``forward_silu_mul``)
  attention       ``Attention.forward``: KV cache write + paged attention / prefill SDPA
  norm_rotary_act RMSNorm, rotary embedding, SiLU-and-mul
  other_forward   the rest of the model forward: embedding, views, residual adds
  sampling        ``Sampler.__call__``
  sched_prep      ``Scheduler.schedule`` + ``update_computed`` + the runner's input preparation
  detokenize      incremental detokenization
  python_overhead everything else inside ``LLMEngine.step`` and the generate loop
"""
from __future__ import annotations

import contextlib
import resource
import threading
import time

BUCKETS = ("linear", "attention", "norm_rotary_act", "other_forward", "sampling", "sched_prep", "detokenize",
           "python_overhead")


class _Timers:
    """Exclusive per-bucket time on one thread (the engine's)."""

    def __init__(self):
        self.total = dict.fromkeys(BUCKETS + ("input_prep",), 0.0)
        self.stack: list[list] = []  # [bucket, start, child_seconds]

    def wrap(self, bucket: str, fn):
        import torch

        def wrapped(*a, **kw):
            with torch.profiler.record_function(f"appliance::{bucket}"):
                self.stack.append([bucket, time.perf_counter(), 0.0])
                try:
                    return fn(*a, **kw)
                finally:
                    b, start, child = self.stack.pop()
                    dt = time.perf_counter() - start
                    self.total[b] += dt - child
                    if self.stack:
                        self.stack[-1][2] += dt

        return wrapped


class _OpsProxy:
    """The runner's op set with the elementwise ops timed; everything else passes through."""

    def __init__(self, ops, timers: _Timers):
        self._ops = ops
        # Per-op buckets need the per-op path: the model's one-call native decoder stack
        # (ops.native.llama_layers, the same kernels) would put everything in other_forward. The
        # profiled run therefore also carries the Python between ops that the fused call saves.
        self.FUSED_LAYERS = False
        for name in ("rotary_embedding", "silu_and_mul", "rms_norm", "fused_add_rms_norm"):
            if hasattr(ops, name):
                setattr(self, name, timers.wrap("norm_rotary_act", getattr(ops, name)))

    def __getattr__(self, name):
        return getattr(self._ops, name)


@contextlib.contextmanager
def instrumented(engine, timers: _Timers):
    """Wrap the engine's parts in timers; restore everything on exit."""
    from appliance.engine.detokenizer import IncrementalDetokenizer
    from appliance.engine.sampler import Sampler
    from appliance.layers.attention import Attention
    from appliance.layers.linear import Linear
    from appliance.layers.norm import RMSNorm
    from appliance.layers.quant import QuantLinear

    saved_cls = [(Linear, "forward", "linear"), (Linear, "forward_silu_mul", "linear"), (QuantLinear, "forward", "linear"),
                 (Attention, "forward", "attention"),
                 (RMSNorm, "forward", "norm_rotary_act"), (Sampler, "__call__", "sampling"),
                 (IncrementalDetokenizer, "add_tokens", "detokenize"), (IncrementalDetokenizer, "flush", "detokenize")]
    originals = []
    for cls, attr, bucket in saved_cls:
        orig = cls.__dict__[attr]
        originals.append((cls, attr, orig))
        setattr(cls, attr, timers.wrap(bucket, orig))
    inst = [(engine.scheduler, "schedule", "sched_prep"), (engine.scheduler, "update_computed", "sched_prep"),
            (engine.runner, "_inputs", "input_prep")]
    for obj, attr, bucket in inst:
        setattr(obj, attr, timers.wrap(bucket, getattr(obj, attr)))
    # the runner's op set is what each step's forward context carries, the one place modules read it
    runner = engine.runner
    old_ops = runner.ops
    runner.ops = _OpsProxy(old_ops, timers)
    try:
        yield
    finally:
        runner.ops = old_ops
        for obj, attr, _ in inst:
            delattr(obj, attr)  # back to the class's method
        for cls, attr, orig in originals:
            setattr(cls, attr, orig)


def _faults() -> tuple[int, int, int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt, ru.ru_nvcsw, ru.ru_nivcsw


def run_profile(llm, prompts: list[list[int]], output_len: int, trace_file: str | None = None,
                top_k: int = 10) -> dict:
    """Keys fixed by ``schema.RESULTS['profile']``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from appliance import SamplingParams
    from appliance.bench.common import _allocator, _libgomp
    from appliance.bench.offline import _reset_stats, warmup

    eng = llm.engine
    warmup(llm, prompts)
    _reset_stats(eng)
    timers = _Timers()
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    f0 = _faults()
    with profile(activities=[ProfilerActivity.CPU]) as prof, instrumented(eng, timers):
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
    f1 = _faults()
    t = timers.total
    # The runner's input preparation (engine prepare_s) is timed with the forward here: it is taken out of
    # other_forward and reported with the scheduler.
    in_forward = t["linear"] + t["attention"] + t["norm_rotary_act"] + t["input_prep"]
    t["other_forward"] = max(0.0, eng.stats["forward_s"] + eng.stats["prepare_s"] - in_forward)
    t["sched_prep"] += t.pop("input_prep")
    named = sum(v for k, v in timers.total.items() if k != "python_overhead")
    timers.total["python_overhead"] = max(0.0, wall - named)
    buckets = [{"name": k, "seconds": timers.total[k], "fraction": timers.total[k] / wall} for k in BUCKETS]
    ops = sorted((e for e in prof.key_averages() if not e.key.startswith("appliance::")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:top_k]
    top_ops = [{"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": int(e.count)} for e in ops]
    if trace_file:
        prof.export_chrome_trace(trace_file)
    try:
        import psutil

        n_threads = psutil.Process().num_threads()
    except ImportError:
        n_threads = threading.active_count()
    return {"wall_s": wall, "steps": int(eng.stats["steps"]),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "buckets": buckets, "top_ops": top_ops,
            "page_faults": {"minor": f1[0] - f0[0], "major": f1[1] - f0[1]},
            "context_switches": {"voluntary": f1[2] - f0[2], "involuntary": f1[3] - f0[3]},
            "threads": {"process": n_threads, "torch_intra_op": torch.get_num_threads(),
                        "torch_inter_op": torch.get_num_interop_threads()},
            "allocator": _allocator(), "libgomp": _libgomp(), "trace_file": trace_file}
