"""The KV block manager: plain integers, no torch (rule 3).

- A fixed set of blocks, each with a reference count.
- A free block queue: an O(1) doubly linked LRU list. Freed blocks go to the tail; allocation
  takes the head (least recently freed). A free block may still hold a cached prefix: it is
  evicted (its hash forgotten) only when allocation takes it, and it leaves the queue in O(1)
  when a prefix-cache hit revives it.
- Prefix caching: a full block's hash is ``hash((parent_hash, token_ids))`` where parent_hash is
  the previous block's hash (None for the first block). A hit is only accepted when the stored
  parent hash and token ids are equal too, so a hash collision can never corrupt output.
  Block hashes are write-once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

# A block-table entry whose block was released because no attention layer can read it any more
# (every layer windowed, the block wholly before every window): the kernels never read it, and the
# pool's bookkeeping skips it.
NULL_BLOCK = -1


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list with sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self.head.next
        if block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_queries = 0  # prefix-cache lookups, counted in tokens (as vLLM does)
        self.num_hits = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict the cached prefix it still held
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix-cache hit."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a request's blocks in reverse order, so that
        the blocks at the end of a sequence (least likely shared) are evicted first."""
        for bid in block_ids:
            b = self.blocks[bid]
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {bid} freed more often than allocated")
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def lookup(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int, KVBlock | None]:
        h = hash_block(parent_hash, token_ids)
        b = self.cached.get(h)
        if b is not None and b.parent_hash == parent_hash and b.token_ids == tuple(token_ids):
            return h, b
        return h, None

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Record that a full block holds ``token_ids`` after ``parent_hash`` (write-once)."""
        b = self.blocks[block_id]
        if b.block_hash is not None:
            if b.block_hash != block_hash:
                raise RuntimeError(f"block {block_id} already holds another prefix")
            return
        b.block_hash, b.parent_hash, b.token_ids = block_hash, parent_hash, tuple(token_ids)
        self.cached.setdefault(block_hash, b)

    def reset_prefix_cache(self) -> None:
        for b in self.blocks:
            if b.ref_cnt == 0:
                b.block_hash = b.parent_hash = b.token_ids = None
        self.cached = {h: b for h, b in self.cached.items() if b.ref_cnt > 0}

    def check(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Integrity (rule 4): free + used == total, free blocks have no references, and each
        block's ref count equals the number of block tables holding it (NULL_BLOCK entries aside)."""
        counts = [0] * self.num_blocks
        for table in block_tables:
            for bid in table:
                if bid != NULL_BLOCK:
                    counts[bid] += 1
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == self.free_queue.num_free, "free queue length out of sync"
        assert len(set(free_ids)) == len(free_ids), "a block is twice in the free queue"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert len(free_ids) + used == self.num_blocks, (
            f"free {len(free_ids)} + used {used} != total {self.num_blocks}")
        for bid in free_ids:
            assert self.blocks[bid].ref_cnt == 0, f"free block {bid} has ref_cnt {self.blocks[bid].ref_cnt}"
        for b in self.blocks:
            assert b.ref_cnt == counts[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {counts[b.block_id]} block tables")
        for h, b in self.cached.items():
            assert b.block_hash == h, f"cached block {b.block_id} hash mismatch"
