"""Tensor parallelism over torch.distributed (issue 17).

- ``communicator``: the collective operations a rank needs (``Communicator``) and their registry:
  "gloo" (torch.distributed) and "shm" (``shm_allreduce``: a shared-memory all-reduce for the ranks
  of one host).
- ``parallel_state``: this process's tensor-parallel group (rank, size, communicator); layers ask it
  when they are built, never build groups themselves. Size 1 is the default and costs nothing.
- ``executor``: rank 0's side of a tensor-parallel engine (it starts and drives ranks 1..N-1).
"""
