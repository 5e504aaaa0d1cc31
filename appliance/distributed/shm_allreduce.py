"""All-reduce through shared memory for the ranks of a group that share one host.

gloo costs about a millisecond per all-reduce, more than a decode step of a small model; a /dev/shm
segment that every rank maps costs a few microseconds (native/neon_sve/shm/shm_allreduce.cpp has the
algorithm and its ordering argument). This module builds that little library on first use (a few
seconds, cached under ``<cache_dir>/shm/<hash of the source>``), loads it with ctypes, and wraps it:

- ``ShmSegment``: one segment among ``world_size`` ranks; ``all_reduce_`` sums a float32 / bfloat16
  CPU tensor in place. Rank 0 creates it; every rank unlinks its name as soon as all have mapped it,
  so nothing is left in /dev/shm whatever happens afterwards. A rank that does not arrive within
  ``timeout_s`` (or whose process is gone) makes the others raise ``ShmAllReduceError``.
- ``ShmCommunicator`` (registered as ``"shm"``): the native all-reduce when every rank of the group
  is on this host; with ranks on several hosts (Ray), shared memory among the ranks of each host and
  gloo between the hosts' first ranks (sum within the host, sum of the hosts' sums, then the result
  handed back through the host's segment); gloo otherwise (other dtypes, a library that cannot be
  built: each logged once); all_gather, broadcast_object and barrier go through gloo.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import secrets
import socket
import subprocess
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from appliance.config import cache_dir
from appliance.distributed.communicator import GlooCommunicator, register_communicator
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20  # one step's slot per rank; larger tensors go through in chunks
DEFAULT_TIMEOUT_S = 120.0
SEGMENT_PREFIX = "appliance-ar-"  # /dev/shm/<prefix>...: tests look for leaks by this prefix
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_ERR_LEN = 512


class ShmAllReduceError(ApplianceError):
    """A peer rank did not arrive in time or died, or the segment could not be made."""


def source_path() -> Path:
    return Path(__file__).resolve().parents[2] / "native" / "neon_sve" / "shm" / "shm_allreduce.cpp"


def library_path() -> Path:
    src = source_path()
    tag = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    return cache_dir() / "shm" / f"{os.uname().machine}-{tag}" / "libappliance_shm.so"


def build_command(src: Path, out: Path, cxx: str | None = None) -> list[str]:
    """The one compiler call that builds the library (tests run it with a cross compiler too)."""
    cxx = cxx or os.environ.get("CXX", "c++")
    return [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", "-Wall", str(src), "-o", str(out), "-lrt"]


_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def load_library() -> ctypes.CDLL:
    """Build (once per source version) and load the library. Raises ShmAllReduceError saying why not."""
    global _lib, _lib_error
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise ShmAllReduceError(_lib_error)
        path = library_path()
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
                r = subprocess.run(build_command(source_path(), tmp), capture_output=True, text=True)
                if r.returncode != 0:
                    raise ShmAllReduceError(f"building {source_path().name} failed:\n{r.stderr[-3000:]}")
                os.replace(tmp, path)  # atomic: ranks building at once never load half a file
            lib = ctypes.CDLL(str(path))
        except (OSError, ShmAllReduceError) as e:
            _lib_error = f"shared-memory all-reduce library unavailable: {e}"
            raise ShmAllReduceError(_lib_error) from None
        lib.appliance_shm_open.restype = ctypes.c_void_p
        lib.appliance_shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                           ctypes.c_uint32, ctypes.c_double, ctypes.c_char_p, ctypes.c_size_t]
        lib.appliance_shm_all_reduce.restype = ctypes.c_int
        lib.appliance_shm_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                 ctypes.c_char_p, ctypes.c_size_t]
        lib.appliance_shm_wait_attached.restype = ctypes.c_int
        lib.appliance_shm_wait_attached.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.appliance_shm_seq.restype = ctypes.c_uint32
        lib.appliance_shm_seq.argtypes = [ctypes.c_void_p]
        lib.appliance_shm_close.restype = None
        lib.appliance_shm_close.argtypes = [ctypes.c_void_p]
        lib.appliance_shm_segment_bytes.restype = ctypes.c_size_t
        lib.appliance_shm_segment_bytes.argtypes = [ctypes.c_int, ctypes.c_size_t]
        _lib = lib
        return lib


def new_segment_name() -> str:
    """A fresh name, carrying the creator's pid (``sweep_stale_segments`` reads it)."""
    return f"/{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def sweep_stale_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink segments whose creator process is gone. A name lives only from rank 0's create until every
    rank has attached; a rank 0 killed inside that window (say, by a launcher tearing down after another
    rank crashed at start) leaves one behind, and the next rank 0 on the host removes it here."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for n in names:
        pid = n[len(SEGMENT_PREFIX):].split("-", 1)[0] if n.startswith(SEGMENT_PREFIX) else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # the creator still runs (or the pid was reused): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(shm_dir, n))
            removed.append(n)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left by exited processes: %s", len(removed), ", ".join(removed))
    return removed


class ShmSegment:
    """One rank's view of a segment shared by ``world_size`` ranks. Rank 0 passes ``create=True``
    first; the others open the same ``name``. Construction returns once every rank has mapped it (and
    the name is gone from /dev/shm); rank 0 passes ``wait=False`` to publish the name first, then
    calls ``wait_attached``. ``start_seq``: the sequence number the steps count from (rank 0's wins;
    tests start near 2**32 to cross the wrap)."""

    def __init__(self, name: str, world_size: int, rank: int, create: bool,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S, start_seq: int = 0,
                 wait: bool = True):
        self._h = None
        self._lib = load_library()
        self.name, self.world_size, self.rank, self.timeout_s = name, world_size, rank, timeout_s
        err = ctypes.create_string_buffer(_ERR_LEN)
        h = self._lib.appliance_shm_open(name.encode(), world_size, rank, int(create), chunk_bytes,
                                         start_seq & 0xFFFFFFFF, float(timeout_s), err, _ERR_LEN)
        if not h:
            raise ShmAllReduceError(err.value.decode(errors="replace"))
        self._h = h
        self._err = err
        if wait:
            self.wait_attached()

    def wait_attached(self) -> None:
        if self._lib.appliance_shm_wait_attached(self._h, self.name.encode(), self._err, _ERR_LEN) != 0:
            msg = self._err.value.decode(errors="replace")
            self.close()
            raise ShmAllReduceError(msg)

    @property
    def seq(self) -> int:
        """The last step's sequence number (32-bit, wraps)."""
        return self._lib.appliance_shm_seq(self._h)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a contiguous float32 / bfloat16 CPU tensor over the ranks, in place."""
        if self._h is None:
            raise ShmAllReduceError("shm all-reduce: the segment is closed")
        code = _DTYPE_CODES.get(t.dtype)
        if code is None or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"shm all-reduce takes a contiguous float32/bfloat16 CPU tensor, got {t.dtype} on "
                             f"{t.device} (contiguous={t.is_contiguous()})")
        if self._lib.appliance_shm_all_reduce(self._h, t.data_ptr(), t.numel(), code, self._err, _ERR_LEN) != 0:
            raise ShmAllReduceError(self._err.value.decode(errors="replace"))
        return t

    def c_entry(self) -> tuple[int, int]:
        """(function address, handle) for native code that all-reduces by itself (the one-call decoder
        stack): call ``int fn(void* handle, void* data, size_t n, int dtype /* 0 float32, 1 bfloat16 */,
        char* err, size_t errlen)``; 0 on success, else -1 with a message in ``err``. Valid until close()."""
        if self._h is None:
            raise ShmAllReduceError("shm all-reduce: the segment is closed")
        return ctypes.cast(self._lib.appliance_shm_all_reduce, ctypes.c_void_p).value, self._h

    def close(self) -> None:
        if self._h is not None:
            self._lib.appliance_shm_close(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


_instances: dict[str, int] = {}  # process group name -> communicators made on it so far


def _all_ranks_ok(mine: bool, world_size: int, group) -> bool:
    """Whether every rank of ``group`` says ok (every rank must call this, once, at the same point)."""
    ok = [None] * world_size
    dist.all_gather_object(ok, mine, group=group)
    return all(ok)


def forget_groups() -> None:
    """After ``torch.distributed.destroy_process_group()``: the next groups reuse the names ("0", ...)
    with new ranks (a fresh process on the other side counts from 0), so this process's counts must
    restart too (``appliance.distributed.executor`` calls it when it ends its default group)."""
    with _lib_lock:
        _instances.clear()


class ShmCommunicator(GlooCommunicator):
    """The native shared-memory all-reduce within one host; gloo for everything else (see module doc).
    Collective calls on one communicator come from one thread at a time (each is a step of the
    sequence all ranks count together); separate communicators may run concurrently.
    ``fallback_reason``: why all-reduce goes through gloo (None: shared memory)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S, start_seq: int = 0):
        super().__init__(group, rank, world_size)
        self.segment: ShmSegment | None = None
        self.fallback_reason: str | None = None
        # several hosts: this host's ranks' segment (None when alone) plus the hosts' first ranks' gloo group
        self.across_hosts: str | None = None
        self.leader_group = None
        self.is_leader = True
        hosts = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            whole = group is None or dist.get_world_size(group) == dist.get_world_size()
            if whole:
                self._init_across_hosts(group, hosts, chunk_bytes, timeout_s, start_seq)
                return
            self.fallback_reason = f"ranks on {len(set(hosts))} hosts ({', '.join(sorted(set(hosts)))}): gloo"
        else:
            try:
                load_library()
            except ShmAllReduceError as e:
                self.fallback_reason = f"{e}; gloo"
            # Every rank must agree on using the segment, or rank 0 would wait for ranks that never attach.
            if not _all_ranks_ok(self.fallback_reason is None, world_size, group) and self.fallback_reason is None:
                self.fallback_reason = "the shared-memory library is unavailable on another rank; gloo"
        if self.fallback_reason is not None:
            self._fall_back(self.fallback_reason)
            return
        store = dist.distributed_c10d._get_default_store()
        group_name = dist.distributed_c10d._get_process_group_name(group or dist.group.WORLD)
        with _lib_lock:  # the ranks of a group make its communicators in the same order
            instance = _instances[group_name] = _instances.get(group_name, -1) + 1
        key = f"appliance/shm_allreduce/{group_name}/{instance}"
        if rank == 0:
            sweep_stale_segments()
            try:
                seg = ShmSegment(new_segment_name(), world_size, 0, True, chunk_bytes, timeout_s, start_seq, wait=False)
            except ShmAllReduceError as e:  # e.g. /dev/shm full: tell the others rather than leave them waiting
                store.set(key, "!" + str(e))
                self._fall_back(f"{e}; gloo")
                return
            store.set(key, seg.name)
            seg.wait_attached()
        else:
            name = store.get(key).decode()
            if name.startswith("!"):
                self._fall_back(f"rank 0 could not create the segment ({name[1:]}); gloo")
                return
            seg = ShmSegment(name, world_size, rank, False, chunk_bytes, timeout_s, start_seq)
        self.segment = seg

    def _init_across_hosts(self, group, hosts: list[str], chunk_bytes: int, timeout_s: float, start_seq: int) -> None:
        """Ranks on several hosts: one segment per host among its ranks, a gloo group of each host's
        first rank. Every rank of the group runs this (``new_group`` is collective over the world); any
        rank that cannot make or open its host's segment makes all of them reduce through gloo."""
        order = list(dict.fromkeys(hosts))
        mine = hosts[self.rank]
        local = [r for r, h in enumerate(hosts) if h == mine]
        leaders = [hosts.index(h) for h in order]
        self.is_leader = self.rank == local[0]
        self.leader_group = dist.new_group([self._global_rank(r) for r in leaders], backend="gloo")
        problem = None
        if len(local) > 1:
            try:
                load_library()
            except ShmAllReduceError as e:
                problem = str(e)
        if not _all_ranks_ok(problem is None, self.world_size, group) and problem is None:
            problem = "the shared-memory library is unavailable on another rank"
        if problem is None and len(local) > 1:
            store = dist.distributed_c10d._get_default_store()
            group_name = dist.distributed_c10d._get_process_group_name(group or dist.group.WORLD)
            with _lib_lock:
                instance = _instances[group_name] = _instances.get(group_name, -1) + 1
            key = f"appliance/shm_allreduce/{group_name}/{instance}/host{order.index(mine)}"
            try:
                if self.is_leader:
                    sweep_stale_segments()
                    try:
                        seg = ShmSegment(new_segment_name(), len(local), 0, True, chunk_bytes, timeout_s, start_seq,
                                         wait=False)
                    except ShmAllReduceError as e:
                        store.set(key, "!" + str(e))
                        raise
                    store.set(key, seg.name)
                    seg.wait_attached()
                else:
                    name = store.get(key).decode()
                    if name.startswith("!"):
                        raise ShmAllReduceError(f"rank {local[0]} could not create this host's segment ({name[1:]})")
                    seg = ShmSegment(name, len(local), local.index(self.rank), False, chunk_bytes, timeout_s,
                                     start_seq)
                self.segment = seg
            except ShmAllReduceError as e:
                problem = str(e)
        if not _all_ranks_ok(problem is None, self.world_size, group) and problem is None:
            problem = "another host's ranks could not share a segment"
        if problem is not None:
            self.close()
            self.leader_group, self.is_leader = None, True
            self._fall_back(f"ranks on {len(order)} hosts ({', '.join(order)}): {problem}; gloo")
            return
        self.across_hosts = (f"ranks on {len(order)} hosts ({', '.join(order)}): shared memory among each host's "
                             f"ranks, gloo between ranks {', '.join(map(str, leaders))}")
        log.info("all-reduce of rank %d/%d: %s", self.rank, self.world_size, self.across_hosts)

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning("all-reduce of rank %d/%d: %s", self.rank, self.world_size, reason)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        native = self.segment is not None or self.across_hosts is not None
        if not native or t.dtype not in _DTYPE_CODES or t.device.type != "cpu":
            return super().all_reduce_(t)
        if t.is_contiguous():
            return self._sum(t)
        c = t.contiguous()
        self._sum(c)
        t.copy_(c)
        return t

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.across_hosts is None:
            return self.segment.all_reduce_(t)
        if self.segment is not None:  # this host's sum
            self.segment.all_reduce_(t)
        if self.is_leader:  # the hosts' sums
            dist.all_reduce(t, group=self.leader_group)
        else:
            t.zero_()
        if self.segment is not None:  # the leader's total, to this host's other ranks (x + 0 + ... = x)
            self.segment.all_reduce_(t)
        return t

    def native_all_reduce(self) -> tuple[int, int] | None:
        # the same segment and sequence as all_reduce_: native and Python steps may interleave; across
        # hosts the segment sums one host only, so native callers take the per-op path
        return None if self.segment is None or self.across_hosts is not None else self.segment.c_entry()

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


register_communicator("shm", ShmCommunicator)
