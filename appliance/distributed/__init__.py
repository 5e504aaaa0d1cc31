"""Tensor parallelism over torch.distributed (issue 17).

- ``communicator``: the collective operations a rank needs (``Communicator``), on a gloo group
  (``GlooCommunicator``) or any other registered implementation (``make_communicator``).
- ``parallel_state``: this process's tensor-parallel group (rank, size, communicator); layers ask it
  when they are built, never build groups themselves. Size 1 is the default and costs nothing.
- ``executor``: rank 0's side of a tensor-parallel engine (it starts and drives ranks 1..N-1).
"""
