"""The shared-memory all-reduce (appliance/distributed/shm_allreduce.py, native/neon_sve/shm/):
against the fp64 sum and gloo's result, for 1 element to 8 MB, float32 and bfloat16; sequence
wrap; two groups at once; no leftovers in /dev/shm; a missing or dead rank is an error, not a hang.

Kernel-level tests run the ranks as threads of this process (each with its own mapping of the segment;
ctypes releases the GIL in the native call), which is cheap; the communicator tests run real ranks as
processes over torch.distributed on loopback."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from appliance.distributed.shm_allreduce import (
    SEGMENT_PREFIX, ShmAllReduceError, ShmSegment, load_library, new_segment_name, sweep_stale_segments,
)

HERE = Path(__file__).parent
REPO = HERE.parents[1]
SIZES = [1, 7, 1024, 4096 // 4, 1 << 18, (8 << 20) // 4, 1_000_003]  # elements: ..., 4 KB f32, 1 MB, 8 MB, odd


def _leaked() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(SEGMENT_PREFIX)}


@pytest.fixture(autouse=True)
def no_leak():
    before = _leaked()
    yield
    assert _leaked() - before == set(), "a segment was left in /dev/shm"


def _run_ranks(world, fn, chunk_bytes=1 << 20, timeout_s=20.0, start_seq=0):
    """fn(rank, segment) in one thread per rank; returns their results (re-raises the first error)."""
    name = new_segment_name()
    segs = [ShmSegment(name, world, 0, True, chunk_bytes, timeout_s, start_seq, wait=False)] + [None] * (world - 1)
    results, errors = [None] * world, []

    def body(r):
        try:
            if r == 0:
                segs[0].wait_attached()
            else:
                segs[r] = ShmSegment(name, world, r, False, chunk_bytes, timeout_s, start_seq)
            results[r] = fn(r, segs[r])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    for s in segs:
        if s is not None:
            s.close()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_matches_fp64_every_size(world, dtype):
    inputs = {n: [torch.randn(n, generator=torch.Generator().manual_seed(7 * r + n)).to(dtype) for r in range(world)]
              for n in SIZES}

    def fn(r, seg):
        outs = {}
        for n in SIZES:
            t = inputs[n][r].clone()
            seg.all_reduce_(t)
            outs[n] = t
        return outs

    res = _run_ranks(world, fn)
    for n in SIZES:
        exact = sum(x.double() for x in inputs[n])
        for r in range(1, world):
            assert torch.equal(res[r][n], res[0][n]), f"rank {r} differs from rank 0 at n={n}"
        got = res[0][n]
        if world == 2:
            # One rounding of an exact two-term sum: the correctly rounded fp64 sum, bit for bit.
            assert torch.equal(got, exact.to(dtype)), f"n={n}"
        else:
            # float32 accumulation of 3 terms, then one rounding to the dtype.
            ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
            tol = (2 * ulp * (exact.abs() + sum(x.double().abs() for x in inputs[n]))).max().item()
            assert (got.double() - exact).abs().max().item() <= tol, f"n={n}"


def test_sequence_number_wraps_and_chunks():
    steps = []

    def fn(r, seg):
        for i in range(20):
            t = torch.full((2500,), float(r + i))  # 10 KB through 4 KB slots: 3 steps a call
            seg.all_reduce_(t)
            assert torch.all(t == 1 + 2 * i), (r, i, t[:4])
        steps.append(seg.seq)

    _run_ranks(2, fn, chunk_bytes=4096, start_seq=2**32 - 7)
    assert steps == [(2**32 - 7 + 60) % 2**32] * 2  # crossed 2**32 and came back to small numbers


def test_c_entry_point_for_native_callers():
    # What a C++ caller gets: a plain function pointer and handle, here called through ctypes.
    import ctypes

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_char_p, ctypes.c_size_t)

    def fn(r, seg):
        addr, handle = seg.c_entry()
        t = torch.full((100,), float(r + 1), dtype=torch.bfloat16)
        err = ctypes.create_string_buffer(256)
        assert proto(addr)(handle, t.data_ptr(), t.numel(), 1, err, 256) == 0, err.value
        return t

    for t in _run_ranks(2, fn):
        assert torch.all(t == 3)


def test_missing_rank_raises_instead_of_hanging():
    ready = threading.Event()

    def fn(r, seg):
        if r == 1:
            ready.set()  # attached, then never calls the collective
            time.sleep(1.5)
            return None
        ready.wait()
        t0 = time.monotonic()
        with pytest.raises(ShmAllReduceError, match=r"rank 1 \(pid \d+\) did not reach the copy phase within 0.5 s"):
            seg.all_reduce_(torch.ones(16))
        took = time.monotonic() - t0
        with pytest.raises(ShmAllReduceError, match="failed earlier"):
            seg.all_reduce_(torch.ones(16))
        return took

    took = _run_ranks(2, fn, timeout_s=0.5)[0]
    assert 0.5 <= took < 5


def test_rank_that_never_attaches_and_name_is_unlinked():
    name = new_segment_name()
    seg = ShmSegment(name, 2, 0, True, 1 << 16, 0.3, wait=False)
    assert os.path.exists(f"/dev/shm{name}")
    with pytest.raises(ShmAllReduceError, match=r"only 1 of 2 ranks attached .* within 0.3 s"):
        seg.wait_attached()
    assert not os.path.exists(f"/dev/shm{name}")


def test_segment_of_a_creator_killed_before_attach_is_swept():
    # Rank 0 made its segment and died before any rank attached: the name stays until the next rank 0
    # sweeps it. A live creator's segment is left alone.
    code = ("import os; from appliance.distributed.shm_allreduce import ShmSegment, new_segment_name; "
            "s = ShmSegment(new_segment_name(), 2, 0, True, 4096, 5.0, wait=False); print(s.name, flush=True); "
            "os._exit(0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=120)
    dead_name = r.stdout.strip()
    assert dead_name and os.path.exists(f"/dev/shm{dead_name}")
    live = ShmSegment(new_segment_name(), 2, 0, True, 4096, 0.2, wait=False)
    removed = sweep_stale_segments()
    assert dead_name[1:] in removed and not os.path.exists(f"/dev/shm{dead_name}")
    assert os.path.exists(f"/dev/shm{live.name}")
    with pytest.raises(ShmAllReduceError, match="only 1 of 2 ranks attached"):
        live.wait_attached()  # and unlinks it


def test_bad_arguments_are_refused():
    with pytest.raises(ShmAllReduceError, match="world_size must be in 1..64 and rank in 0..world_size-1; got world_size=2 rank=2"):
        ShmSegment(new_segment_name(), 2, 2, True)
    with pytest.raises(ShmAllReduceError, match="chunk_bytes must be a multiple of 64 and >= 4096, got 100"):
        ShmSegment(new_segment_name(), 2, 0, True, chunk_bytes=100)
    seg = ShmSegment(new_segment_name(), 1, 0, True, 4096)
    with pytest.raises(ValueError, match="float32/bfloat16 CPU tensor, got torch.float64"):
        seg.all_reduce_(torch.ones(3, dtype=torch.float64))
    t = torch.arange(5.0)
    seg.all_reduce_(t)  # one rank: the identity
    assert torch.equal(t, torch.arange(5.0))
    seg.close()


# ---- real ranks over torch.distributed ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(mode, world, tmp_path, env=None, timeout=240):
    load_library()  # build once here rather than in every rank at once
    port = _free_port()
    e = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    outs = [tmp_path / f"{mode}{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "shm_worker.py"), mode, str(r), str(world), str(port),
                               str(outs[r])], env=e) for r in range(world)]
    try:
        # Poll every rank: reaping one that died makes its pid disappear, which its peers watch for.
        deadline = time.monotonic() + timeout
        while None in [p.poll() for p in procs] and time.monotonic() < deadline:  # poll each, no short cut
            time.sleep(0.05)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [json.loads(o.read_text()) if o.exists() else None for o in outs]


def test_communicator_equals_gloo_two_processes(tmp_path):
    codes, reports = _spawn("compare", 2, tmp_path)
    assert codes == [0, 0]
    for r, rep in enumerate(reports):
        assert rep["native"], rep["fallback"]
        assert rep["leaked_after_open"] == [] and rep["leaked_at_end"] == []
        assert rep["noncontiguous_ok"]
        assert rep["concurrent_bad"] == []
        no_segment, reason, summed = rep["fallback_after_create_failure"]
        assert no_segment and "chunk_bytes must be a multiple of 64 and >= 4096, got 100" in reason, reason
        assert summed == [3.0] * 5
        assert len(rep["cases"]) == 14
        for c in rep["cases"]:
            # Two ranks: a + b rounded once, which is what gloo computes and the rounded fp64 sum.
            assert c["vs_gloo"] == 0.0, (r, c)
            assert c["vs_fp64_rounded"] == 0.0, (r, c)


@pytest.mark.parametrize("hosts", ["a,a,b,b", "a,b,a"])
def test_ranks_on_several_hosts_share_memory_within_each_host(tmp_path, hosts):
    """Ranks on several hosts (Ray): each host's ranks sum through their own segment, the hosts' first
    ranks over gloo, the total goes back through the segment; every rank ends with the same sum,
    within the rounding bound of world - 1 additions of the fp64 sum; no native entry (the one-call
    stack would sum one host only); nothing left in /dev/shm."""
    names = hosts.split(",")
    world = len(names)
    codes, reports = _spawn("hosts", world, tmp_path, env={"SHM_TEST_HOSTS": hosts})
    assert codes == [0] * world, reports
    for r, rep in enumerate(reports):
        assert rep["fallback"] is None and rep["across"].startswith("ranks on 2 hosts"), rep
        assert rep["segment"] == (names.count(names[r]) > 1), (r, rep)
        assert rep["leader"] == (names.index(names[r]) == r), (r, rep)
        assert not rep["native_entry"] and rep["noncontiguous_ok"] and rep["leaked_at_end"] == []
        assert len(rep["cases"]) == 10
        for c in rep["cases"]:
            assert c["same_on_every_rank"] and c["err_over_bound"] <= 1.0, (r, c)


def test_dead_rank_is_reported_not_waited_for(tmp_path):
    codes, reports = _spawn("die", 2, tmp_path, env={"SHM_TEST_TIMEOUT": "60"})
    assert codes == [0, 3]
    rep = reports[0]
    assert rep["first"] == 2.0
    assert rep["error"] and "rank 1 (pid" in rep["error"] and "exited" in rep["error"], rep
    assert rep["seconds"] < 30  # noticed the exit, well before the 60 s timeout
    assert "failed earlier" in rep["again"]


def test_killed_child_rank_is_noticed_while_still_a_zombie():
    """Rank 0 is its peer's parent (a tensor-parallel engine and its spawned worker): the killed peer
    stays a zombie until rank 0 reaps it, and kill(pid, 0) still succeeds on a zombie. The wait must
    see it as dead at once, not wait out the timeout (60 s here)."""
    import signal

    name = new_segment_name()
    seg = ShmSegment(name, 2, 0, True, 1 << 16, 60.0, wait=False)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from appliance.distributed.shm_allreduce import ShmSegment\n"
         f"seg = ShmSegment({name!r}, 2, 1, False, 1 << 16, 60.0)\n"
         "print('attached', flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "attached"
        seg.wait_attached()
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still there for kill(): a zombie, not reaped
        t0 = time.monotonic()
        with pytest.raises(ShmAllReduceError, match=rf"rank 1 \(pid {child.pid}\) exited; rank 0 was waiting"):
            seg.all_reduce_(torch.ones(16))
        assert time.monotonic() - t0 < 10
    finally:
        child.kill()
        child.wait()
        seg.close()
