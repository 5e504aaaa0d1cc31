"""How busy the rest of the host was while this process worked: the share of its usable CPUs' time
that other processes (and, in a VM, the hypervisor's steal) took over a window. A timing made in a
busy window is suspect (``appliance.layers.linear`` re-times such choices).

Linux only: busy time per CPU from /proc/stat, this process's own CPU time (all its threads) from
getrusage. Elsewhere (no /proc/stat) nothing is known and every window counts as quiet (share 0).
"""
from __future__ import annotations

import os
import time

# /proc/stat columns after "cpuN": user nice system idle iowait irq softirq steal guest guest_nice.
# Busy: user, nice, system, irq, softirq, steal (guest time is already inside user and nice).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def read_proc_stat() -> str | None:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None


def busy_ticks(stat: str, cpus) -> tuple[int, int] | None:
    """(busy clock ticks summed over ``cpus``, how many CPUs that is) from a /proc/stat text; the
    all-CPU line when one of them is not listed (a container's numbering); None without CPU lines."""
    lines = {}
    for line in stat.splitlines():
        name, *vals = line.split() or [""]
        if name.startswith("cpu"):
            lines[name] = [int(v) for v in vals]
    want = [f"cpu{c}" for c in cpus]
    if want and all(n in lines for n in want):
        rows, n = [lines[n] for n in want], len(want)
    elif "cpu" in lines:
        rows, n = [lines["cpu"]], sum(1 for name in lines if name != "cpu") or 1
    else:
        return None
    return sum(r[i] for r in rows for i in _BUSY_COLUMNS if i < len(r)), n


def own_cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    try:
        import resource  # POSIX; finer than os.times' clock ticks
    except ImportError:
        t = os.times()
        return t.user + t.system
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class OthersLoad:
    """``with OthersLoad() as load: ...`` then ``load.share``: the fraction (0-1) of the usable CPUs'
    time over the block that was busy and not this process's own, i.e.
    (host busy ticks / CLK_TCK - own CPU seconds) / (wall seconds x usable CPUs).

    ``cpus``: the CPUs this process may use (default: the engine's, ``threads.engine_cpus``);
    ``read``, ``own`` and ``clock`` are the sources (injected by tests; ``read`` defaults to this
    module's ``read_proc_stat`` as it is when the window opens)."""

    def __init__(self, cpus=None, read=None, own=own_cpu_seconds, clock=time.monotonic):
        if cpus is None:
            from appliance.runtime.threads import engine_cpus

            cpus = engine_cpus()
        self.cpus, self._read, self._own, self._clock = list(cpus), read or read_proc_stat, own, clock
        self.share = 0.0

    def _sample(self):
        stat = self._read()
        ticks = busy_ticks(stat, self.cpus) if stat else None
        return ticks, self._own(), self._clock()

    def __enter__(self) -> "OthersLoad":
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        (t0, own0, w0), (t1, own1, w1) = self._start, self._sample()
        if t0 is None or t1 is None or w1 <= w0:
            self.share = 0.0  # no /proc/stat: nothing known, counted as quiet
            return
        capacity = (w1 - w0) * t1[1]
        others = (t1[0] - t0[0]) / os.sysconf("SC_CLK_TCK") - (own1 - own0)
        self.share = min(1.0, max(0.0, others / capacity))
