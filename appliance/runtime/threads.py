"""Where the engine's OpenMP threads run: how many, on which CPUs, and the environment that makes
libgomp bind them there.

Default (``--omp-threads-bind auto``): one thread per physical core of one NUMA node (the node with
the most CPUs this process may use), each pinned to its core, static schedule. SMT siblings are left
out: two threads on one core share its vector units and slow each other down. The HTTP frontend runs
on the CPUs left over (``frontend_cpus``), so the two processes never fight over a core.

``--omp-threads-bind`` also takes an explicit CPU list like vLLM's (``0-31``, ``0-15,32-47``, ``0,2,4``)
or ``nobind`` (no pinning; thread count = ``num_threads`` or the physical cores).

The placement is applied in two halves, because libgomp reads its settings when it is loaded:
``omp_env`` gives the child process ``OMP_NUM_THREADS``/``OMP_PLACES``/``OMP_PROC_BIND`` before it
starts; ``apply`` (called first thing in the child) sets the process's CPU mask and torch's thread
count.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from appliance.errors import ApplianceError

log = logging.getLogger(__name__)
_SYS = Path("/sys/devices/system")


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11] (sorted, no duplicates). Raises ApplianceError
    naming the bad part."""
    cpus: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ApplianceError(f"--omp-threads-bind: {part!r} in {spec!r} is not a CPU number or range "
                                 "(expected e.g. 0-31 or 0-15,32-47)") from None
        if a < 0 or b < a:
            raise ApplianceError(f"--omp-threads-bind: bad range {part!r} in {spec!r} (need 0 <= first <= last)")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ApplianceError(f"--omp-threads-bind: {spec!r} names no CPU")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    out, cpus = [], sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs; one node with every CPU when sysfs has none (inside
    ``on_node``: that node's)."""
    view = _VIEW.get()
    if view is not None:
        return {k: list(v) for k, v in view.numa.items()}
    nodes: dict[int, list[int]] = {}
    for d in sorted(_SYS.glob("node/node[0-9]*")):
        cl = _read(d / "cpulist")
        if cl:
            nodes[int(d.name[4:])] = parse_cpu_list(cl)
    if not nodes:
        nodes[0] = sorted(os.sched_getaffinity(0))
    return nodes


def core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU; SMT siblings share it. Falls back to the CPU itself."""
    view = _VIEW.get()
    if view is not None:
        return view.cores.get(cpu, (0, cpu))
    topo = _SYS / "cpu" / f"cpu{cpu}" / "topology"
    pkg, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
    if pkg is None or core is None:
        return (0, cpu)
    return (int(pkg), int(core))


def one_cpu_per_core(cpus: list[int]) -> list[int]:
    """The lowest-numbered logical CPU of each physical core among ``cpus``."""
    firsts: dict[tuple[int, int], int] = {}
    for c in sorted(cpus):
        firsts.setdefault(core_of(c), c)
    return sorted(firsts.values())


@dataclass(frozen=True)
class Placement:
    """The engine's OpenMP threads: ``cpus`` (None: not pinned) and ``num_threads``."""

    num_threads: int
    cpus: tuple[int, ...] | None
    numa_node: int | None = None
    spec: str = "auto"
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # Bind the process's memory to numa_node in apply() (per-rank placements: each rank's weights and
    # KV cache stay on its own node). A single engine keeps the default policy.
    bind_memory: bool = False

    def describe(self) -> str:
        where = f"pinned to CPUs {format_cpu_list(list(self.cpus))}" if self.cpus else "not pinned"
        node = f", NUMA node {self.numa_node}" if self.numa_node is not None else ""
        mem = ", memory bound to it" if self.bind_memory and self.numa_node is not None else ""
        return f"{self.num_threads} OpenMP threads, {where}{node}{mem}"


def resolve(spec: str = "auto", num_threads: int | None = None, allowed: set[int] | None = None) -> Placement:
    """Turn ``--omp-threads-bind`` (+ an optional explicit thread count) into a Placement."""
    allowed = _allowed() if allowed is None else set(allowed)
    warnings: list[str] = []
    if num_threads is not None and num_threads < 1:
        raise ApplianceError(f"--num-threads must be >= 1, got {num_threads}")
    spec = (spec or "auto").strip()
    if "|" in spec:
        raise ApplianceError(f"--omp-threads-bind {spec}: {spec.count('|') + 1} CPU lists ('|' separates ranks) "
                             "for 1 rank; give one list (e.g. 0-31), or as many lists as tensor x data parallel ranks")
    node = None
    if spec == "nobind":
        cores = len(one_cpu_per_core(sorted(allowed)))
        n = num_threads or cores
        if n > len(allowed):
            warnings.append(f"{n} threads on {len(allowed)} usable CPUs: oversubscribed; use --num-threads {cores}")
        return Placement(n, None, None, spec, tuple(warnings))
    if spec == "auto":
        nodes = {k: [c for c in v if c in allowed] for k, v in numa_nodes().items()}
        node = max(nodes, key=lambda k: (len(nodes[k]), -k))
        cpus = one_cpu_per_core(nodes[node]) or sorted(allowed)
    else:
        cpus = parse_cpu_list(spec)
        bad = [c for c in cpus if c not in allowed]
        if bad:
            raise ApplianceError(f"--omp-threads-bind {spec}: CPU(s) {format_cpu_list(bad)} are not available to "
                                 f"this process (allowed: {format_cpu_list(sorted(allowed))})")
        owners = {k for k, v in numa_nodes().items() for c in cpus if c in v}
        if len(owners) > 1:
            warnings.append(f"--omp-threads-bind {spec} spans NUMA nodes {sorted(owners)}: memory traffic "
                            "crosses the interconnect; bind to one node's cores")
        node = owners.pop() if len(owners) == 1 else None
        physical = one_cpu_per_core(cpus)
        if len(physical) < len(cpus):
            warnings.append(f"--omp-threads-bind {spec} puts threads on SMT siblings "
                            f"({len(cpus)} CPUs, {len(physical)} physical cores); use {format_cpu_list(physical)}")
    n = num_threads or len(cpus)
    if n > len(cpus):
        warnings.append(f"{n} OpenMP threads on {len(cpus)} cores: oversubscribed, threads will time-share; "
                        f"use --num-threads {len(cpus)} (or bind more cores)")
    elif n < len(cpus):
        cpus = cpus[:n]
    return Placement(n, tuple(cpus), node, spec, tuple(warnings))


def omp_env(p: Placement) -> dict[str, str]:
    """What libgomp must see when it loads: thread count, places (one CPU each), close binding,
    static schedule, no dynamic thread adjustment."""
    env = {"OMP_NUM_THREADS": str(p.num_threads), "OMP_SCHEDULE": "static", "OMP_DYNAMIC": "false"}
    if p.cpus:
        cpus = list(p.cpus)
        # With more threads than places libgomp would spread several threads per place; bind only
        # when every thread has its own CPU.
        if p.num_threads <= len(cpus):
            env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus[:p.num_threads])
            env["OMP_PROC_BIND"] = "close"
    return env


def apply(p: Placement) -> None:
    """In the engine process: set torch's intra-op thread count and, when libgomp is not binding
    the threads itself (no ``OMP_PLACES`` in the environment), restrict the process to the
    placement's CPUs.

    Resolve the placement in the parent and pass it in: once libgomp has loaded with OMP_PLACES it
    has bound the calling thread to place 0, so ``os.sched_getaffinity`` here shows one CPU."""
    for w in p.warnings:
        log.warning("%s", w)
    if p.cpus and "OMP_PLACES" not in os.environ:
        os.sched_setaffinity(0, set(p.cpus))
    if p.bind_memory and p.numa_node is not None:
        problem = bind_memory_to_node(p.numa_node)
        if problem:
            log.warning("%s", problem)
    try:
        import torch

        torch.set_num_threads(p.num_threads)
    except ImportError:
        pass


def frontend_cpus(p: Placement, allowed: set[int] | None = None) -> set[int]:
    """CPUs for the HTTP process: those the engine does not use (all of them when none are left)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    if not p.cpus:
        return allowed
    # Leave the engine's cores alone, including their SMT siblings.
    engine_cores = {core_of(c) for c in p.cpus}
    rest = {c for c in allowed if core_of(c) not in engine_cores}
    return rest or allowed


def thread_affinities(pid: int | str = "self") -> dict[int, str]:
    """tid -> Cpus_allowed_list of every thread of ``pid`` (to check pinning from outside)."""
    out: dict[int, str] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        st = _read(t / "status") or ""
        for line in st.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(t.name)] = line.split(":", 1)[1].strip()
    return out


def engine_cpus() -> list[int]:
    """The CPUs this engine process may use: its ``OMP_PLACES`` when it was started with one (the
    server's engine process: libgomp has bound the main thread to the first place once torch
    loaded, so the affinity mask shows one CPU), else its affinity mask."""
    import re

    cpus = [int(c) for c in re.findall(r"\{(\d+)\}", os.environ.get("OMP_PLACES", ""))]
    return sorted(set(cpus)) if cpus else sorted(os.sched_getaffinity(0))
# ---- one placement per rank (tensor / data parallel) ------------------------------------------------


def check_rank_lists(spec: str, ranks: int, name: str = "--omp-threads-bind") -> None:
    """Refuse a '|'-separated spec whose number of CPU lists is not ``ranks`` (syntax of each list too),
    before anything starts. ``name``: the flag or variable the spec came from."""
    if not spec or "|" not in spec:
        return
    lists = spec.split("|")
    if len(lists) != ranks:
        raise ApplianceError(f"{name}={spec!r}: {len(lists)} CPU lists ('|' separates ranks) for {ranks} rank(s) "
                             "(tensor-parallel size x data-parallel size); give one list per rank, or auto")
    for part in lists:
        parse_cpu_list(part)


def resolve_ranks(spec: str, world_size: int, num_threads: int | None = None,
                  allowed: set[int] | None = None) -> list[Placement]:
    """``--omp-threads-bind`` for ``world_size`` ranks on this host, one Placement per rank (rank order).

    - ``"0-31|32-63"``: one CPU list per rank, as vLLM's VLLM_CPU_OMP_THREADS_BIND; the count must
      equal ``world_size``, every CPU must exist and be allowed, and no CPU may be in two lists.
    - ``auto``: one rank per NUMA node (the lowest-numbered nodes with usable CPUs), one thread per
      physical core; with fewer nodes than ranks, the physical cores (in node order) are split into
      ``world_size`` even contiguous parts. Memory is bound to the rank's node when it has one.
    - ``nobind``: no pinning; each rank gets its share of the physical cores as threads.
    ``num_threads``: threads per rank (default: every core of its list)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ApplianceError(f"--omp-threads-bind: the number of ranks must be >= 1, got {world_size!r}")
    allowed = _allowed() if allowed is None else set(allowed)
    spec = (spec or "auto").strip()
    if world_size == 1 and "|" not in spec:
        return [resolve(spec, num_threads, allowed)]
    if num_threads is not None and num_threads < 1:
        raise ApplianceError(f"--num-threads must be >= 1, got {num_threads}")
    nodes = numa_nodes()
    if spec == "nobind":
        share = max(1, len(one_cpu_per_core(sorted(allowed))) // world_size)
        return [Placement(num_threads or share, None, None, spec) for _ in range(world_size)]
    if spec == "auto":
        return _auto_ranks(world_size, num_threads, allowed, nodes)
    lists = spec.split("|")
    if len(lists) != world_size:
        raise ApplianceError(f"--omp-threads-bind {spec}: {len(lists)} CPU list(s) for {world_size} ranks; give "
                             f"exactly {world_size} lists separated by '|' (e.g. 0-31|32-63), or auto")
    view = _VIEW.get()
    existing = {c for cpus in nodes.values() for c in cpus} | (set(view.cores) if view is not None
                                                               else set(range(os.cpu_count() or 0)))
    out, owner = [], {}
    for r, part in enumerate(lists):
        cpus = parse_cpu_list(part)
        missing = [c for c in cpus if c not in existing]
        if missing:
            raise ApplianceError(f"--omp-threads-bind {spec}: rank {r}'s CPU(s) {format_cpu_list(missing)} do not exist "
                                 f"(this host has CPUs {format_cpu_list(sorted(existing))})")
        for c in cpus:
            if c in owner:
                raise ApplianceError(f"--omp-threads-bind {spec}: CPU {c} is in the lists of ranks {owner[c]} and {r}; "
                                     "each rank needs its own cores")
            owner[c] = r
        p = resolve(part, num_threads, allowed)
        out.append(dataclasses.replace(p, spec=spec, bind_memory=p.numa_node is not None and len(nodes) > 1))
    return out


def _auto_ranks(world_size: int, num_threads: int | None, allowed: set[int],
                nodes: dict[int, list[int]]) -> list[Placement]:
    usable = {k: one_cpu_per_core([c for c in v if c in allowed]) for k, v in sorted(nodes.items())}
    usable = {k: v for k, v in usable.items() if v}
    if len(usable) >= world_size:
        parts = [(k, usable[k]) for k in list(usable)[:world_size]]
    else:
        cores = [c for v in usable.values() for c in v] or sorted(allowed)
        if len(cores) < world_size:
            raise ApplianceError(f"--omp-threads-bind auto: {world_size} ranks need a core each, but this process "
                                 f"may use {len(cores)} physical core(s) ({format_cpu_list(cores)})")
        per, extra = divmod(len(cores), world_size)
        parts, i = [], 0
        for r in range(world_size):
            n = per + (r < extra)
            chunk = cores[i:i + n]
            i += n
            owners = {k for k, v in usable.items() for c in chunk if c in v}
            parts.append((owners.pop() if len(owners) == 1 else None, chunk))
    out = []
    for node, cpus in parts:
        warnings = []
        n = num_threads or len(cpus)
        if n > len(cpus):
            warnings.append(f"{n} OpenMP threads per rank on {len(cpus)} cores: oversubscribed; "
                            f"use --num-threads {len(cpus)}")
        out.append(Placement(n, tuple(cpus[:n]) if n <= len(cpus) else tuple(cpus), node, "auto", tuple(warnings),
                             bind_memory=node is not None and len(nodes) > 1))
    return out


_MPOL_BIND = 2
# set_mempolicy(2) has no glibc wrapper; its number differs by architecture.
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}


def bind_memory_to_node(node: int) -> str | None:
    """Bind this process's future allocations to NUMA ``node`` (what ``numactl --membind`` does,
    through the set_mempolicy system call). None when done, else the reason it was not (to warn)."""
    import ctypes
    import platform

    nr = _SYS_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return f"memory not bound to NUMA node {node}: set_mempolicy is not wired up for {platform.machine()}"
    bits = 64 * (node // 64 + 1)
    mask = (ctypes.c_ulong * (bits // 64))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, _MPOL_BIND, mask, ctypes.c_ulong(bits + 1)) != 0:
        return f"memory not bound to NUMA node {node}: set_mempolicy failed: {os.strerror(ctypes.get_errno())}"
    return None


def memory_binding_support() -> str:
    """How ranks' memory gets bound to their node here (for doctor)."""
    import platform

    if platform.machine() in _SYS_SET_MEMPOLICY:
        return "set_mempolicy(MPOL_BIND) per rank on multi-node hosts"
    return f"not available on {platform.machine()}: ranks' memory follows the kernel's default policy"


def memory_policy() -> tuple[int, list[int]] | None:
    """(mode, nodes) of this thread's memory policy (mode 2 = bind), or None where it cannot be read."""
    import ctypes
    import platform

    nr = _SYS_GET_MEMPOLICY.get(platform.machine())
    if nr is None:
        return None
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64), None, ctypes.c_ulong(0)) != 0:
        return None
    return mode.value, [i for i in range(16 * 64) if mask[i // 64] >> (i % 64) & 1]


def engine_placement(spec: str, num_threads: int | None, tensor_parallel_size: int = 1) -> Placement:
    """The engine process's placement. With tensor parallelism the engine process is rank 0 and
    starts the other ranks, so it gets every rank's CPUs (``resolve_ranks``, rank 0's first: its
    OpenMP threads take the first places); each rank then narrows itself to its own
    (``appliance.distributed.executor``)."""
    if tensor_parallel_size <= 1:
        return resolve(spec, num_threads)
    return ranks_union(resolve_ranks(spec, tensor_parallel_size, num_threads), spec)


def ranks_union(ranks: list[Placement], spec: str) -> Placement:
    """The placement of a process that is rank 0 of ``ranks`` and starts the others: every rank's CPUs,
    rank 0's first (unpinned when the ranks are)."""
    if any(p.cpus is None for p in ranks):  # nobind
        return Placement(sum(p.num_threads for p in ranks), None, None, spec)
    cpus = tuple(c for p in ranks for c in p.cpus)
    nodes = {p.numa_node for p in ranks}
    return Placement(len(cpus), cpus, nodes.pop() if len(nodes) == 1 else None, spec,
                     tuple(w for p in ranks for w in p.warnings))


def rank_lists_spec(ranks: list[Placement]) -> str:
    """``ranks`` as an explicit ``--omp-threads-bind`` value ("0-1|2-3"), or "nobind" when unpinned."""
    if any(p.cpus is None for p in ranks):
        return "nobind"
    return "|".join(format_cpu_list(list(p.cpus)) for p in ranks)


# ---- a rank's placement on the node it runs on (Ray across hosts) ------------------------------------


@dataclass(frozen=True)
class NodeTopology:
    """What placement needs to know of one host, read on that host (``local_topology``): its NUMA
    nodes, each CPU's (package, core), and the CPUs a process there may use. Plain data, so a Ray
    task on another node can read it there and send it back."""

    host: str
    numa: dict[int, tuple[int, ...]]
    cores: dict[int, tuple[int, int]]
    allowed: tuple[int, ...]


_VIEW: contextvars.ContextVar[NodeTopology | None] = contextvars.ContextVar("appliance_node_view", default=None)


def _allowed() -> set[int]:
    view = _VIEW.get()
    return set(view.allowed) if view is not None else set(os.sched_getaffinity(0))


def local_topology(allowed: set[int] | None = None) -> NodeTopology:
    """This host's topology (``allowed``: the CPUs to plan on; default this process's mask)."""
    numa = {k: tuple(v) for k, v in numa_nodes().items()}
    cpus = sorted({c for v in numa.values() for c in v} | set(os.sched_getaffinity(0)))
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    return NodeTopology(socket.gethostname(), numa, {c: core_of(c) for c in cpus}, tuple(allowed))


@contextlib.contextmanager
def on_node(topo: NodeTopology):
    """Inside: ``numa_nodes``, ``core_of``, ``resolve`` and ``resolve_ranks`` see ``topo`` instead of
    this host (for this thread / task only)."""
    token = _VIEW.set(topo)
    try:
        yield topo
    finally:
        _VIEW.reset(token)


def node_rank_placements(spec: str, num_threads: int | None, rank_nodes: list,
                         topologies: dict) -> list[Placement]:
    """Each rank's Placement on the node it runs on, in that node's CPU numbering.

    ``rank_nodes[r]``: the node (any key of ``topologies``) rank r landed on. The ranks of one node
    (in rank order) are resolved by ``resolve_ranks`` on that node's topology as if they were the only
    ranks: ``auto`` one rank per NUMA node of that node (or its physical cores split evenly),
    ``nobind`` its cores shared, and an explicit "a|b|..." list (one per rank, as vLLM's
    VLLM_CPU_OMP_THREADS_BIND) gives rank r its own list, read as CPU numbers of r's node, checked
    there (they must exist and not overlap another rank's on that node). With every rank on one node
    this is ``resolve_ranks(spec, len(rank_nodes), ...)`` on that node."""
    spec = (spec or "auto").strip()
    lists = spec.split("|") if "|" in spec else None
    if lists is not None and len(lists) != len(rank_nodes):
        raise ApplianceError(f"--omp-threads-bind {spec}: {len(lists)} CPU list(s) for {len(rank_nodes)} ranks; give "
                             f"exactly {len(rank_nodes)} lists separated by '|', or auto")
    out: list[Placement | None] = [None] * len(rank_nodes)
    for node in dict.fromkeys(rank_nodes):
        ranks = [r for r, n in enumerate(rank_nodes) if n == node]
        topo = topologies[node]
        sub = "|".join(lists[r] for r in ranks) if lists is not None else spec
        try:
            with on_node(topo):
                ps = resolve_ranks(sub, len(ranks), num_threads, set(topo.allowed))
                if len(ranks) == 1 < len(rank_nodes):  # a rank alone on its node: bound to it, as ranks are
                    ps = [dataclasses.replace(ps[0], bind_memory=ps[0].numa_node is not None and len(topo.numa) > 1)]
        except ApplianceError as e:
            raise ApplianceError(f"rank(s) {', '.join(map(str, ranks))} on node {topo.host}: {e}") from None
        for r, p in zip(ranks, ps):
            out[r] = dataclasses.replace(p, spec=spec)
    return out  # type: ignore[return-value]
