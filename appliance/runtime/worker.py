"""The engine process's runtime, set up in two halves.

Parent (``appliance serve`` / ``appliance bench``), before it starts the engine process::

    placement = threads.resolve(args.omp_threads_bind, args.num_threads)
    env = worker_env(args.allocator, placement=placement)
    with child_environ(env):          # spawn copies os.environ into the child's exec
        proc.start()
    os.sched_setaffinity(0, threads.frontend_cpus(placement))   # optional: keep HTTP off the engine's cores

Child (first lines of the process's target, before torch does any work)::

    report = worker_startup(placement)   # pins, sets torch threads, checks mimalloc + libgomp are live
    log.info("%s", describe(report))     # and put `report` into the ready info / banner / metrics
"""
from __future__ import annotations

import contextlib
import os
import platform
from typing import Iterator

from appliance.runtime import allocator as _alloc
from appliance.runtime import openmp as _omp
from appliance.runtime import threads as _threads


def worker_env(allocator: str = "mimalloc", libgomp: str | None = "auto",
               placement: _threads.Placement | None = None, base: dict | None = None) -> dict[str, str]:
    """Every environment addition for the engine process: the allocator (LD_PRELOAD mimalloc or
    glibc tunables), on aarch64 the replacement libgomp (also LD_PRELOAD), and the OpenMP
    placement. ``libgomp``: "auto" (see ``openmp.choose_libgomp``), a path, or None to keep torch's."""
    base = dict(os.environ if base is None else base)
    env: dict[str, str] = {}
    if libgomp is not None:
        g = _omp.preload_env(libgomp, base)
        if g:
            env.update(g)
            env["APPLIANCE_LIBGOMP_PRELOADED"] = g["LD_PRELOAD"].split(":")[0]
            base["LD_PRELOAD"] = g["LD_PRELOAD"]
    env.update(_alloc.preload_env(allocator, base))  # mimalloc ends up first in LD_PRELOAD
    if placement is not None:
        env.update(_threads.omp_env(placement))
    return env


@contextlib.contextmanager
def child_environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in os.environ for the duration (wrap the ``Process.start()`` / ``Popen`` call),
    then restore: the parent itself keeps running on what it started with."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def worker_startup(placement: _threads.Placement | None = None) -> dict:
    """Apply the placement in this (engine) process and report what is live. The report is
    JSON-safe: allocator (``allocator.allocator_in_use``), libgomp (mapped path, whether it is the
    one the parent preloaded), and the OpenMP settings."""
    if placement is not None:
        _threads.apply(placement)
    report: dict = {"allocator": _alloc.allocator_in_use()}
    try:
        import torch

        torch.zeros(8).add_(1)  # loads the OpenMP runtime if nothing has yet
    except ImportError:
        pass
    want = os.environ.get("APPLIANCE_LIBGOMP_PRELOADED")
    mapped = _omp.mapped_libgomp()
    report["libgomp"] = {"mapped": mapped, "preloaded": want,
                         "preload_live": _omp.verify_preloaded(want)[0] if want else None,
                         "arch": platform.machine()}
    report["omp"] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
                                                     "OMP_SCHEDULE")}
    report["omp"]["cpus_allowed"] = _threads.format_cpu_list(sorted(os.sched_getaffinity(0)))
    if placement is not None:
        report["omp"]["placement"] = placement.describe()
        report["omp"]["warnings"] = list(placement.warnings)
    return report


def describe(report: dict) -> dict[str, str]:
    """Banner rows: ``allocator``, ``libgomp``, ``openmp``."""
    g = report.get("libgomp", {})
    if g.get("preloaded"):
        gomp = f"{g['mapped']} ({'preloaded' if g.get('preload_live') else 'PRELOAD NOT LIVE'})"
    else:
        gomp = g.get("mapped") or "not loaded"
    o = report.get("omp", {})
    omp = o.get("placement") or f"{o.get('OMP_NUM_THREADS') or 'default'} threads, CPUs {o.get('cpus_allowed')}"
    return {"allocator": _alloc.describe(report["allocator"]), "libgomp": gomp, "openmp": omp}
