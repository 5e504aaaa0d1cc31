"""Communication among the ranks of a tensor-parallel group: the ``Communicator`` interface and its
registry (communicator.py), and the shared-memory all-reduce for ranks on one host (shm_allreduce.py)."""
