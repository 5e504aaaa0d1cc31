"""One rank of the multi-process shared-memory all-reduce tests (tests/distributed/test_shm_allreduce.py
starts it as ``python shm_worker.py MODE RANK WORLD PORT OUT``; OUT receives a JSON report)."""
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from appliance.distributed.communicator import make_communicator
from appliance.distributed.shm_allreduce import SEGMENT_PREFIX, ShmAllReduceError, ShmCommunicator

SIZES = [1, 7, 1024, 4096 // 4, 1 << 18, (8 << 20) // 4, 1_000_003]  # elements: ..., 4 KB f32, 1 MB, 8 MB, odd
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


def leaked() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(SEGMENT_PREFIX))


def compare(rank: int, world: int) -> dict:
    shm = make_communicator("shm", None, rank, world)
    gloo = make_communicator("gloo", None, rank, world)
    out = {"native": shm.segment is not None, "fallback": shm.fallback_reason, "leaked_after_open": leaked(),
           "cases": []}
    for dname, dtype in DTYPES.items():
        for n in SIZES:
            x = rank_input(rank, n, dtype)
            a, b = x.clone(), x.clone()
            shm.all_reduce_(a)
            gloo.all_reduce_(b)
            exact = sum(rank_input(r, n, dtype).double() for r in range(world))
            out["cases"].append({"dtype": dname, "n": n, "vs_gloo": (a.double() - b.double()).abs().max().item(),
                                 "vs_fp64_rounded": (a.double() - exact.to(dtype).double()).abs().max().item(),
                                 "vs_fp64": (a.double() - exact).abs().max().item(),
                                 "max_abs": exact.abs().max().item()})
    # A non-contiguous view goes through a copy and lands back in place.
    m = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    shm.all_reduce_(m.t())
    out["noncontiguous_ok"] = torch.equal(m, torch.arange(12, dtype=torch.float32).view(3, 4) * sum(range(1, world + 1)))

    # Two groups' segments in use at once from two threads must not see each other's data.
    other = ShmCommunicator(dist.new_group(list(range(world))), rank, world)
    bad = []

    def hammer(comm, scale: float) -> None:
        for i in range(200):
            t = torch.full((300 + i,), scale * (rank + 1) + i, dtype=torch.float32)
            comm.all_reduce_(t)
            want = scale * world * (world + 1) / 2 + world * i
            if not torch.all(t == want):
                bad.append((scale, i, t[0].item(), want))

    th = [threading.Thread(target=hammer, args=(c, s)) for c, s in ((shm, 1.0), (other, 1000.0))]
    [t.start() for t in th]
    [t.join() for t in th]
    out["concurrent_bad"] = bad[:5]
    out["seq"] = shm.segment.seq if shm.segment else None

    # Rank 0 cannot make its segment (here: a chunk size it refuses): every rank falls back to gloo
    # instead of waiting for a name that never comes, and the sum is still right.
    failed = ShmCommunicator(None, rank, world, chunk_bytes=100 if rank == 0 else 4096)
    t = torch.full((5,), float(rank + 1))
    failed.all_reduce_(t)
    out["fallback_after_create_failure"] = [failed.segment is None, failed.fallback_reason, t.tolist()]
    shm.close()
    other.close()
    dist.barrier()
    out["leaked_at_end"] = leaked()
    return out


def die(rank: int, world: int) -> dict:
    comm = ShmCommunicator(None, rank, world, timeout_s=float(os.environ.get("SHM_TEST_TIMEOUT", "30")))
    t = torch.ones(1000)
    comm.all_reduce_(t)
    if rank == 1:
        os._exit(3)  # dies without a word between two collectives
    time.sleep(0.5)
    start = time.monotonic()
    try:
        comm.all_reduce_(torch.ones(1000))
        return {"error": None}
    except ShmAllReduceError as e:
        try:
            comm.all_reduce_(torch.ones(10))
            again = None
        except ShmAllReduceError as e2:
            again = str(e2)
        return {"error": str(e), "seconds": time.monotonic() - start, "again": again, "first": t[0].item()}


def across_hosts(rank: int, world: int) -> dict:
    """Ranks on the hosts named by SHM_TEST_HOSTS (one name per rank, given to socket.gethostname in
    this process): each host's ranks share a segment, the hosts' first ranks sum over gloo."""
    import hashlib
    import socket

    names = os.environ["SHM_TEST_HOSTS"].split(",")
    socket.gethostname = lambda: names[rank]
    comm = make_communicator("shm", None, rank, world)
    out = {"across": comm.across_hosts, "segment": comm.segment is not None, "leader": comm.is_leader,
           "native_entry": comm.native_all_reduce() is not None, "fallback": comm.fallback_reason, "cases": []}
    eps = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
    for dname, dtype in DTYPES.items():
        for n in (1, 7, 1024, 1 << 18, 1_000_003):  # 1_000_003 float32 spans two 4 MB chunks
            a = rank_input(rank, n, dtype)
            comm.all_reduce_(a)
            xs = [rank_input(r, n, dtype).double() for r in range(world)]
            exact = sum(xs)
            # each of the (world - 1) additions rounds once, by at most eps x the partial sum
            bound = (world - 1) * eps[dtype] * sum(x.abs() for x in xs) + 1e-30
            digest = hashlib.sha256(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy()
                                    .tobytes()).hexdigest()
            digests = [None] * world
            dist.all_gather_object(digests, digest)
            out["cases"].append({"dtype": dname, "n": n, "err_over_bound": ((a.double() - exact).abs() / bound).max()
                                 .item(), "same_on_every_rank": len(set(digests)) == 1})
    m = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    comm.all_reduce_(m.t())
    out["noncontiguous_ok"] = torch.equal(m, torch.arange(12, dtype=torch.float32).view(3, 4) * sum(range(1, world + 1)))
    comm.close()
    dist.barrier()
    out["leaked_at_end"] = leaked()
    return out


def main() -> None:
    mode, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    report = {"compare": compare, "die": die, "hosts": across_hosts}[mode](rank, world)
    with open(out, "w") as f:
        json.dump(report, f)
    os._exit(0)  # skip process-group teardown: after "die" the peer is gone


if __name__ == "__main__":
    main()
