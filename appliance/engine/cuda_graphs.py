"""Decode steps replayed from CUDA graphs.

A decode step's kernels are the same every step for a given batch size; only the inputs change. The
runner captures the model's forward once per size in ``capture_sizes`` (1, 2, 4, 8, ... up to
max_num_seqs) over persistent input buffers, and runs a batch of n sequences by copying it into the
buffers, padding to the next captured size and replaying that size's graph.

Padding rows are inert: slot -1 (no cache write), one token of context in block 0 (a valid, finite
read), and their outputs are never looked at. Every op works row by row, so real rows' outputs do not
depend on them (tests/cuda/test_cuda_graphs.py checks exactly that).

``capture`` turns "run the forward on the buffers" into a replayable callable: ``cuda_graph_capture``
on a GPU; the CPU tests pass a stand-in that simply calls it (eager replay on the same buffers).
"""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from appliance.layers.forward_context import AttentionMetadata, ForwardContext, set_forward_context

Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


def cuda_graph_capture(pool=None) -> Capture:
    """A ``Capture`` recording ``fn`` into a ``torch.cuda.CUDAGraph`` (sharing one memory pool across
    sizes). ``fn`` is run twice first on a side stream: Triton compiles and autotunes then, and
    lazily created state (cuBLAS workspaces) exists before recording."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, ops: ModuleType, kv_caches: list, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, capture: Capture):
        self.model, self.ops, self.kv_caches = model, ops, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        n, dev = self.max_size, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        # decode: sequence b's one query is row b, whatever the batch size
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        # largest first: with a shared pool, smaller graphs reuse the largest one's memory. Inference
        # mode as in the steps that replay them (no autograd state recorded into the graphs).
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.graphs[size] = capture(self._forward_fn(size))

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_seq_len=0,  # max_seq_len: read by no kernel; host values are frozen here
            is_prefill_only=False)
        ctx = ForwardContext(md, self.kv_caches, self.ops)
        ids, pos = self.input_ids[:size], self.positions[:size]

        def forward() -> torch.Tensor:
            with set_forward_context(ctx):
                return self.model(ids, pos)

        return forward

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` runs at, or None when it is too large."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode batch (one token per sequence). The result is
        a view of the graph's output buffer: valid until the next ``run``."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if size is None or md.max_query_len != 1:
            raise ValueError(f"DecodeGraphRunner.run: a decode batch of at most {self.max_size} sequences, "
                             f"got {n} sequences with max_query_len {md.max_query_len}")
        width = md.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(f"block_table has {width} blocks per sequence; the buffers hold "
                             f"{self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.block_table[:n, :width].copy_(md.block_table)
        self.seq_lens[:n].copy_(md.seq_lens)
        # padding rows: inert (see the module docstring)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.block_table[n:size, 0].zero_()
        self.seq_lens[n:size].fill_(1)
        return self.graphs[size]()[:n]
