"""Linear layers and the choice of their methods.

Fused projections (q/k/v, gate/up) are one GEMM whose weight is filled shard by shard at load
time. After loading, each layer gets one linear method (``appliance.layers.methods``), chosen once
per weight shape (never per step): float layers (``Linear``) ``torch``, ``onednn`` or ``native``;
quantized layers (``appliance.layers.quant.QuantLinear``: W8A8, W4A8, swapped in at load) the
methods of their scheme. The method packs the layer's weight once and applies it.

``auto`` times the candidates of each layer (the methods that run its shape on this host) on the
real shapes at decode and prefill batch sizes and keeps the fastest, remembering the choice per
host, torch build, dtype and shape (and quantization scheme) in the user cache. A choice timed while
other processes loaded the host (and won by a small margin, or the load was heavy) is provisional:
timed again at the next start, a few times at most (``_BUSY``, ``_FRAGILE``, ``_SATURATED``,
``_RETIMES``). Every layer kind implements ``LinearBase``.
"""
from __future__ import annotations

import json
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("appliance")

from appliance.config import LINEAR_BACKENDS
from appliance.errors import InvalidRequestError
from appliance.layers import methods
from appliance.layers.methods import FusedLinear, LinearMethod
from appliance.layers.methods.floating import FloatMethod, native_gemm_available, onednn_available  # noqa: F401
from appliance.layers.methods.floating import pack_onednn as _pack_onednn  # noqa: F401 - bench scripts

# Batch sizes (rows of x) a choice is timed at: single-sequence decode, a speculative verify chunk or
# a few streams, batched decode (16, 32), a prefill chunk. Each counts alike (relative_cost), so the
# decode sizes, where serving spends its steps, hold four votes of five. With (1, 32, 256) alone, a
# method fastest at 4-16 rows and slower at 256 (the native panels' batched GEMM) tied with torch's,
# and the coin toss decided a 16-request decode's speed (default model, float32: 235-265 tok/s with
# torch's o/down against 304-317 with native, bench/results/spec.txt).
_PROBE_ROWS = (1, 4, 16, 32, 256)


def share_of_probe_rows(share: float) -> tuple[int, ...]:
    """The probe batch sizes of a layer that sees ``share`` of the step's rows (a mixture-of-experts
    expert: top_k / num_experts of them, at least one). Timed at the step's sizes instead, a
    Qwen3-30B-A3B expert (1 and 2 rows at decode, ~16 in a 256-token prefill, where the native panel
    GEMM is fastest) was given oneDNN (fastest at 32 and 256 rows), 1.2-1.6x slower at the rows it runs."""
    return tuple(sorted({max(1, round(r * share)) for r in _PROBE_ROWS}))


class LinearBase(nn.Module):
    """What select_backends needs from a linear layer (float ``Linear``, ``quant.QuantLinear``)."""

    method: LinearMethod | None = None  # the layer's linear method (set_backend), None before one is set
    # tensor parallelism (appliance.layers.parallel): "column" | "row" | "vocab", None when unsharded
    tp_mode: str | None = None
    # the batch sizes its method is chosen at (select_backends); None: _PROBE_ROWS, the step's sizes
    probe_rows: tuple[int, ...] | None = None

    @property
    def backend(self) -> str:
        """The method's name ("none" before one is set)."""
        return "none" if self.method is None else self.method.name

    @property
    def shape_key(self) -> str:  # what a backend choice is cached under, e.g. "1728x576"
        raise NotImplementedError

    def candidates(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        raise NotImplementedError

    def measure(self, candidates: list[str], rows, timer) -> dict[str, float]:
        """Cost per candidate (``relative_cost``: lower is better) over ``rows`` (batch sizes), on
        random weights of this shape."""
        raise NotImplementedError

    def held_bytes(self, candidates: list[str]) -> dict[str, int]:
        """Bytes each candidate would hold for this layer (as timed by ``measure``); empty when they
        do not differ enough to matter (float layers)."""
        return {}

    def set_backend(self, name: str) -> None:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        raise NotImplementedError

    def fused_descriptor(self) -> FusedLinear | None:
        """How the one-call decoder stack applies this layer, or None when it cannot."""
        return None


class Linear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None, tp: str | None = None):
        """Full (checkpoint) sizes; ``tp`` shards the layer over the tensor-parallel group it is built
        in (``appliance.layers.parallel``): it then holds this rank's part only."""
        super().__init__()
        from appliance.layers import parallel

        in_features, out_features, shards = parallel.setup(self, tp, in_features, out_features, shards)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # shard name -> (row offset, rows): where each checkpoint tensor lands in a fused weight
        self.shards = shards or {}
        self.method: FloatMethod = methods.get("torch")
        self.packed: dict | None = None  # what set_backend's method packed; None: F.linear on the weight
        self.keep_weight = False  # True when the weight is shared (tied embeddings)
        # Set by the MLP on its [gate; up] projection: it is always followed by silu_and_mul, which the
        # native method folds into the GEMM (rows interleaved at packing; see forward_silu_mul).
        self.silu_mul_next = False

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: str | None = None) -> None:
        """``param``'s rows of checkpoint shard ``shard_id`` (see ``appliance.layers.weight_loading``)."""
        from appliance.layers.weight_loading import load_float_linear

        load_float_linear(self, param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) if self.packed is None else self.method.apply(self.packed, x)
        if self.tp_mode is not None:
            from appliance.layers.parallel import finish

            return finish(self, y)
        return y

    @property
    def fused_silu_mul(self) -> bool:
        return self.packed is not None and self.method.fused_silu_mul(self.packed)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this [gate; up] projection in one native GEMM (``fused_silu_mul``)."""
        return self.method.apply_silu_mul(self.packed, x)

    @property
    def shape_key(self) -> str:
        return f"{self.out_features}x{self.in_features}"  # float choices keep their pre-quantization keys

    def candidates(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        return float_candidates(dtype, device)

    def measure(self, candidates: list[str], rows, timer) -> dict[str, float]:
        return measure(self.weight, candidates, rows, timer, silu_mul=self.silu_mul_next)

    def set_backend(self, name: str) -> None:
        m = methods.get(name)
        if not isinstance(m, FloatMethod):
            raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}; got {name!r}")
        if self.weight.numel() == 0 and self.in_features * self.out_features:
            raise RuntimeError("Linear.set_backend: already packed (the checkpoint weight is released)")
        self.packed = m.pack(self.weight, self.bias, silu_mul=self.silu_mul_next and not self.keep_weight)
        self.method = m
        if not (m.keeps_weight or self.keep_weight):  # the checkpoint layout is no longer read
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def weight_bytes(self) -> int:
        t = [self.weight if self.packed is None else self.packed["w"]] + ([self.bias] if self.bias is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    def fused_descriptor(self) -> FusedLinear | None:
        p = self.packed if self.packed is not None else self.method.pack(self.weight, self.bias)
        return self.method.fused_descriptor(p, self.silu_mul_next)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"


FLOAT_BACKENDS = tuple(m.name for m in methods.of_scheme("float"))


def float_candidates(dtype: torch.dtype, device: torch.device) -> list[str]:
    return [m.name for m in methods.of_scheme("float") if m.host_problem(dtype, device) is None]


def float_backend_problem(name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why float backend ``name`` cannot run ``dtype`` layers on this host, or None."""
    m = methods.get(name)
    return m.host_problem(dtype, device) if isinstance(m, FloatMethod) else None


def host_problem(name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why linear backend ``name`` (float or quantized) cannot run on this host, or None."""
    m = methods.get(name)
    return None if m is None else m.host_problem(dtype, device)


_SCRATCH: torch.Tensor | None = None


def _evict_caches() -> None:
    """Write 64 MiB (more than the last-level caches of the CPUs this targets) so the next call
    finds its weights in DRAM, as a decode step does: each weight is read once per step, after
    every other layer's. Timed hot, a kernel that streams weights badly would look as good as one
    that prefetches them. The scratch is kept between the calls of one ``select_backends`` and
    released at its end (``_release_scratch``): 64 MiB resident for the process's life otherwise."""
    global _SCRATCH
    with torch.inference_mode():  # callers time both inside and outside inference mode
        if _SCRATCH is None:
            _SCRATCH = torch.empty(64 << 20, dtype=torch.uint8)
        _SCRATCH.fill_(1)


def _release_scratch() -> None:
    """Free ``_evict_caches``' scratch (a later timing allocates it again)."""
    global _SCRATCH
    _SCRATCH = None


_ROUNDS = 3  # interleaved rounds of timing per (candidate, batch size)
# After the first round, a candidate scoring more than this many times the best score is not timed
# again: timing noise on a shared host is far below 3x, so it cannot win. What this saves is the
# slow references (x86's w4a8_dynquant is ~20x slower at 32 and 256 rows: ~2 s a call at 896x4864,
# two thirds of a cold GGUF load's timing).
_HOPELESS = 3.0


def relative_cost(fns: dict[str, dict[int, object]], timer) -> dict[str, float]:
    """Time ``fns[candidate][rows]()`` for every candidate and batch size, interleaved (round after
    round over all of them, so that a drift in the machine's speed hits every candidate alike; a
    shared host here moves 10-30% within a minute), keep each one's best, and score each candidate by
    the sum over batch sizes of its time relative to the fastest at that size. Every batch size then
    counts alike: a raw sum of seconds would let the largest (prefill) decide alone, and decode
    steps, where most of the time goes, differ most. Lower is better; the fastest everywhere scores
    ``len(rows)``."""
    best: dict[str, dict[int, float]] = {c: {} for c in fns}
    timed = dict(fns)
    for i in range(_ROUNDS):
        for c, per in timed.items():
            for m, f in per.items():
                t = timer(f)
                best[c][m] = min(best[c].get(m, float("inf")), t)
        if i == 0 and len(timed) > 1:
            cost = _scores(best)
            low = min(cost.values())
            timed = {c: per for c, per in timed.items() if cost[c] <= _HOPELESS * low}
    return _scores(best)


# Candidates scoring within this fraction of the fastest count as equally fast (timing a shared host
# moves 10-30%); of those, the one holding the fewest bytes wins. A GGUF Q5_0 layer then stays in its
# 5-bit form (0.81 B/weight) rather than going to int8 (1.25 B/weight) on a timing coin toss, and
# decode, which reads every weight once per token, reads fewer bytes.
_MEMORY_MARGIN = 0.10


def choose(cost: dict[str, float], held: dict[str, int] | None = None) -> str:
    """The candidate to run: the fastest by ``relative_cost``, or, among those within
    ``_MEMORY_MARGIN`` of it, the one with the fewest ``held`` bytes (ties: the faster)."""
    fastest = min(cost, key=cost.get)
    if not held:
        return fastest
    limit = cost[fastest] + _MEMORY_MARGIN * abs(cost[fastest])
    near = [c for c in cost if cost[c] <= limit and c in held]
    return min(near, key=lambda c: (held[c], cost[c])) if near else fastest


def _scores(best: dict[str, dict[int, float]]) -> dict[str, float]:
    sizes = {m for per in best.values() for m in per}
    ref = {m: min(best[c][m] for c in best if m in best[c]) for m in sizes}
    return {c: sum(t / max(ref[m], 1e-12) for m, t in per.items()) for c, per in best.items()}


def _time(fn, reps: int = 2) -> float:
    """Best of ``reps`` calls of ``fn``, each started with cold caches."""
    fn()
    best = float("inf")
    for _ in range(reps):
        _evict_caches()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(weight: torch.Tensor, candidates: list[str], rows=_PROBE_ROWS, timer=None,
            silu_mul: bool = False) -> dict[str, float]:
    """Each candidate's ``relative_cost`` over the probe batch sizes, on this weight's shape.
    ``silu_mul``: the layer is an MLP's [gate; up] projection, always followed by silu_and_mul; each
    candidate is timed with it (the native GEMM does it in its epilogue, the others as the op)."""
    timer = timer or _time
    n, k = weight.shape
    w = torch.randn(n, k, dtype=weight.dtype, device=weight.device) * 0.02
    act = None
    if silu_mul:
        from appliance.ops import get_ops

        act = get_ops("auto").silu_and_mul
    fns = {}
    with torch.inference_mode():
        for name in candidates:
            m = methods.get(name)
            p = m.pack(w, None, silu_mul=silu_mul)
            if m.fused_silu_mul(p):
                f = lambda x, m=m, p=p: m.apply_silu_mul(p, x)  # noqa: E731
            elif act is not None:
                f = lambda x, m=m, p=p: act(m.apply(p, x))  # noqa: E731
            else:
                f = lambda x, m=m, p=p: m.apply(p, x)  # noqa: E731
            xs = {r: torch.randn(r, k, dtype=w.dtype, device=w.device) for r in rows}  # not timed
            fns[name] = {r: (lambda f=f, x=xs[r]: f(x)) for r in rows}
        return relative_cost(fns, timer)


ISA_CAP_VARS = ("APPLIANCE_KERNELS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def isa_caps() -> str:
    """The ISA caps in force (native dispatcher override, oneDNN's and ATen's caps): choices timed
    under one cap are not reused under another."""
    import os

    return ",".join(f"{v}={os.environ[v]}" for v in ISA_CAP_VARS if os.environ.get(v)) or "uncapped"


# A choice is provisional when it was timed while other processes took at least _BUSY of the usable
# CPUs' time (``runtime.host_load``) AND either its margin (the nearest other candidate's cost over the
# chosen one's, ``margin``) is under _FRAGILE or others took _SATURATED or more (then no margin is
# trusted). It is timed again at the next start, at most _RETIMES times, then kept (a host that is
# always busy does not re-time on every start). A quiet timing, or a large margin on a host that was
# only moderately busy, makes it final.
# _FRAGILE: timing a shared host moves 10-30% (relative_cost), unevenly between candidates, so a lead
# under 30% may be the load's doing; a larger one is not (a 16-request decode's native o/down lost to
# torch's on loaded timings, bench/results/spec.txt). Quiet-host float leads are 3-30%
# (bench/results/backend_choice.txt): a narrow choice is the usual case, not the exception.
# _BUSY: others holding a tenth of the cores' time over the window is the low end of that 10-30%
# (an interleaved best-of timing slows by up to about the share others take of the cores it runs
# on); a quiet host reads 0-2% (bench/results/retime.txt).
# _SATURATED: from about half the cores' time taken by others the timing is not noisy but biased:
# the timed threads lose whole scheduler slices (ms) inside calls of 0.05-1 ms, the statically split
# OpenMP GEMMs (native, oneDNN) wait for their preempted thread and torch's does not. The default
# model's float shapes timed at 51-83% others picked torch or oneDNN 33 times of 36, by margins up to
# 1763%; every one of 17 timings at 0-10% picked native, by 10-49% (bench/results/retime.txt): a
# large margin proves nothing there. Set at half the lowest load that gave such a pick (51%): a
# provisional choice costs at most _RETIMES re-timings, a wrong final one 15-25% of a 16-request
# decode for good (bench/results/spec.txt).
_BUSY = 0.10
_FRAGILE = 0.30
_SATURATED = 0.25
_RETIMES = 3
_META = "_meta"  # the cache file's entry for provisional choices: {ckey: {"tries", "busy", "margin"}}


def margin(cost: dict[str, float], pick: str) -> float:
    """How far the nearest other candidate's cost is from ``pick``'s, relative to it: what timing
    noise must overcome to change the choice (inf for a lone candidate)."""
    gaps = [abs(c - cost[pick]) for n, c in cost.items() if n != pick]
    return min(gaps) / max(abs(cost[pick]), 1e-12) if gaps else float("inf")


def _provisional(cache: dict) -> dict[str, dict]:
    """The cache's provisional records, read tolerantly (files written before them have none: every
    choice there is final)."""
    meta = cache.get(_META)
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, dict) and isinstance(v.get("tries"), int)}


def _time_choice(m: LinearBase, key: str, cands: list[str], rows, prior: dict | None) -> tuple[str, dict | None]:
    """Time ``m``'s candidates and choose: (the choice, its provisional record or None when final).
    ``prior``: the provisional record of the choice this re-times, if any."""
    from appliance.runtime.host_load import OthersLoad

    with OthersLoad() as load:
        times = m.measure(cands, rows, _time)
    held = m.held_bytes(cands)
    pick = choose(times, held)
    gap, tries = margin(times, pick), (int(prior.get("tries", 0)) + 1 if prior else 0)
    fragile = load.share >= _BUSY and (gap < _FRAGILE or load.share >= _SATURATED)
    record = {"tries": tries, "busy": round(load.share, 3), "margin": round(min(gap, 1e6), 3)} \
        if fragile and tries < _RETIMES else None
    state = ("provisional: re-timed at the next start" if record else
             f"kept after {tries} re-timings on a busy host" if fragile else "final")
    log.info("linear %s: relative cost %s%s -> %s (others used %.0f%% of the CPUs, margin %s: %s)", key,
             {k: f"{v:.2f}" for k, v in times.items()},
             f", MiB held {({k: round(v / 2**20, 2) for k, v in held.items()})}" if held else "",
             pick, 100 * load.share, f"{gap:.0%}", state)
    return pick, record


def _choice_cache_path():
    from appliance.config import cache_dir

    return cache_dir() / "linear_backends.json"


def select_backends(model: nn.Module, requested: str, dtype: torch.dtype, device: torch.device,
                    extra_rows: tuple[int, ...] = (), batch_invariant: bool = False) -> dict[str, str]:
    """Give every linear layer of ``model`` a backend; returns ``{shape key: backend}`` for the banner/doctor.

    ``batch_invariant`` (--batch-invariant): only ``row_invariant`` methods, packed for it (a row's
    output the same bits at every step size); a layer none of them can run is refused.

    ``extra_rows``: batch sizes timed besides ``_PROBE_ROWS`` (speculative decoding's 1 + k verify
    chunk; its choices are cached apart from the plain ones).

    ``requested`` is ``auto`` (measure the valid candidates per shape, cached per host) or one backend
    name, which every layer that can run it gets; other layers (the float ``lm_head`` of a quantized
    model; quantized layers when a float backend is forced) are chosen as under ``auto``. A name no
    layer can run is an error."""
    if requested != "auto" and methods.get(requested) is None:
        raise InvalidRequestError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}; got {requested!r}",
                                  "linear_backend")
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    if batch_invariant and requested != "auto" and not methods.get(requested).row_invariant:
        raise InvalidRequestError(f"linear_backend={requested} is not row-invariant (another row count takes "
                                  f"another path through it): batch_invariant takes auto or one of "
                                  f"{', '.join(_row_invariant_names())}", "linear_backend")
    if requested != "auto" and layers and not any(requested in m.candidates(dtype, device) for m in layers):
        kinds = sorted({getattr(m, "scheme", "float") for m in layers})
        available = sorted({c for m in layers for c in m.candidates(dtype, device)})
        why = host_problem(requested, dtype, device) or f"it does not run {', '.join(kinds)} layers with dtype {dtype}"
        raise InvalidRequestError(f"linear_backend={requested} cannot run this model ({', '.join(kinds)} layers, "
                                  f"dtype {dtype}) on this host: {why}. Available here: {', '.join(available)}",
                                  "linear_backend")
    choices: dict[str, str] = {}
    cache, dirty, host, provisional = None, False, None, {}
    step_rows = tuple(sorted(set(_PROBE_ROWS) | set(extra_rows)))
    # the sizes are part of the key (choices timed at other sizes, an earlier _PROBE_ROWS's, are
    # timed again)
    step_rows_key = f"|rows{'-'.join(map(str, step_rows))}"
    chosen: dict[int, str] = {}  # id(layer) -> backend
    for m in layers:
        key, rows = _choice_key(m)
        # a layer timed at its own batch sizes (experts) has them in its key; the others are timed at
        # the step's sizes, the verify chunk's included, and cached apart when those differ
        rows_key = ""
        if not m.probe_rows:
            rows, rows_key = step_rows, step_rows_key
        cands = m.candidates(dtype, device)
        if not cands:
            raise ValueError(f"no linear backend can run layer {key} with dtype {dtype} on {device}")
        if batch_invariant:
            allowed = [c for c in cands if methods.get(c).row_invariant]
            if not allowed:
                raise InvalidRequestError(
                    f"batch_invariant: no row-invariant linear method runs layer {key} (dtype {dtype}) on this "
                    f"host; its methods here: {', '.join(cands)}; row-invariant ones: "
                    f"{', '.join(_row_invariant_names())}", "batch_invariant")
            cands = allowed
        # layers of one shape whose stored formats differ (a GGUF mix: a q/k/v holding a Q8_0 v beside
        # all-Q5_0 ones) have other candidates: each candidate set is chosen on its own
        key = f"{key}|{'+'.join(sorted(map(_candidate_tag, cands)))}"
        if key in choices:
            chosen[id(m)] = choices[key]
            continue
        if requested in cands:
            choices[key] = chosen[id(m)] = requested
            continue
        preferred = getattr(m, "preferred_backend", lambda: None)()  # e.g. a K-quant layer's own scales kept
        if preferred in cands:
            choices[key] = chosen[id(m)] = preferred
            continue
        if len(cands) == 1:
            choices[key] = chosen[id(m)] = cands[0]
            continue
        if cache is None:
            from appliance.runtime.cpu_features import detect

            try:
                cache = json.loads(_choice_cache_path().read_text())
            except (OSError, json.JSONDecodeError):
                cache = {}
            host = f"{detect().model_name}|{isa_caps()}|{torch.__version__}|{torch.get_num_threads()}t|{dtype!s}"
            provisional = _provisional(cache)
        # the candidates timed are part of the key: a method added or withdrawn here is timed anew
        ckey = f"{host}{rows_key}|{key}"
        prior = provisional.get(ckey)
        if ckey not in cache or cache[ckey] not in cands or prior:
            if prior and cache.get(ckey) in cands:
                log.info("linear %s: re-timing %s, chosen while other processes used %.0f%% of the CPUs with a "
                         "margin of %.0f%% (provisional under %.0f%%, or at any margin from %.0f%% busy): "
                         "re-time %d of at most %d", key, cache[ckey], 100 * prior.get("busy", 0),
                         100 * prior.get("margin", 0), 100 * _FRAGILE, 100 * _SATURATED,
                         int(prior.get("tries", 0)) + 1, _RETIMES)
            cache[ckey], record = _time_choice(m, key, cands, rows, prior)
            if record:
                provisional[ckey] = record
            else:
                provisional.pop(ckey, None)
            dirty = True
        choices[key] = chosen[id(m)] = cache[ckey]
    _release_scratch()  # timing is over: its 64 MiB would stay resident beside the weights
    if dirty:
        cache.pop(_META, None)
        if provisional:
            cache[_META] = provisional
        path = _choice_cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache, indent=1))
        except OSError as e:
            log.warning("could not save linear backend choices to %s: %s", path, e)
    for m in layers:
        m.set_backend(chosen[id(m)])
        if batch_invariant:
            packed = m.method.row_invariant_pack(m.packed)
            if packed is None:
                raise InvalidRequestError(
                    f"batch_invariant: layer {m.shape_key} on {m.backend} is not row-invariant as this checkpoint "
                    f"stores it (its zero points are added by a GEMM that blocks by the row count)", "batch_invariant")
            m.packed = packed
    # {"KxN": backend} for float layers, {"w8a8 KxN": backend} for quantized ones, " rows 1,2,16" appended
    # where a layer is chosen at its own batch sizes (experts); layers of one shape chosen differently
    # (their candidate sets differ) are listed apart, each with its backends in brackets
    report: dict[str, str] = {}
    for m in layers:
        name = (f"{getattr(m, 'scheme', '') + ' ' if hasattr(m, 'scheme') else ''}{m.in_features}x{m.out_features}"
                f"{_rows_suffix(m)}")
        if report.get(name, chosen[id(m)]) != chosen[id(m)]:
            name += f" [{'+'.join(sorted(m.candidates(dtype, device)))}]"
        report[name] = chosen[id(m)]
    return report


def _row_invariant_names() -> list[str]:
    return [n for n, m in methods.REGISTRY.items() if m.row_invariant]


def _candidate_tag(name: str) -> str:
    """A candidate as the choice's key names it: ``native``, or ``native@r1`` from its revision 1 on
    (``LinearMethod.revision``), so that a choice timed before a method changed is not reused."""
    rev = methods.get(name).revision
    return f"{name}@r{rev}" if rev else name


def _rows_suffix(m: LinearBase) -> str:
    rows = m.probe_rows or _PROBE_ROWS
    return "" if tuple(rows) == _PROBE_ROWS else " rows " + ",".join(map(str, rows))


def _choice_key(m: LinearBase) -> tuple[str, tuple[int, ...]]:
    """(what the choice is kept under, the batch sizes it is timed at): the shape key, and for a layer
    timed at its own sizes (``probe_rows``) those sizes too, since the same shape may be chosen
    differently at the step's sizes; " +silu" for a [gate; up] projection timed with its silu_and_mul
    (``measure``'s ``silu_mul``): a GeGLU model's projection of the same shape is timed without it, and
    neither choice is the other's (the native method's fused silu epilogue wins one, not the other)."""
    silu = " +silu" if getattr(m, "silu_mul_next", False) else ""
    return m.shape_key + _rows_suffix(m) + silu, tuple(m.probe_rows or _PROBE_ROWS)





def weight_bytes(model: nn.Module) -> int:
    """Bytes the forward pass reads for weights: every linear layer as packed, plus other parameters
    (embeddings, norms). A tied lm_head shares the embedding and is counted once."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, LinearBase) and not getattr(m, "keep_weight", False):
            total += int(m.weight_bytes())
            seen.update(id(p) for p in m.parameters(recurse=False))
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
