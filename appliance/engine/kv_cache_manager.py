"""Per-request view of the block pool: prefix-cache lookups and slot allocation. No torch."""
from __future__ import annotations

from appliance.engine.block_pool import NULL_BLOCK, BlockPool, KVBlock
from appliance.engine.request import Request


def max_blocks_held(num_tokens: int, block_size: int, sliding_window: int | None, max_chunk: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens (prompt + output) holds at once when no
    step gives it more than ``max_chunk`` new tokens. Without windows (``sliding_window`` None) that
    is all of them. With every layer windowed (W), a step at position c with a chunk of n tokens
    keeps the blocks from the one holding c - W + 1 to the one holding c + n - 1: at most
    cdiv(W + n - 2, bs) + 1. The engine's admission check and the server's 400 both use this."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    n = max(1, min(max_chunk, num_tokens))
    return min(full, cdiv(sliding_window + n - 2, block_size) + 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None):
        """``sliding_window``: set when every attention layer is windowed, to the largest window (the
        farthest any layer looks back); None when some layer attends to the whole context."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, block_size, enable_caching)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], list[int]]:
        """Longest cached prefix of the request, in full blocks. The last token is never
        covered (it must be computed to get logits), so at most ``(num_tokens - 1) // block_size``
        blocks hit. Returns the blocks and their hashes. Counts queries and hits in tokens."""
        if not self.enable_caching:
            return [], []
        bs = self.block_size
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        blocks, hashes = [], []
        parent = None
        for i in range(max_blocks):
            h, b = self.pool.lookup(parent, tokens[i * bs:(i + 1) * bs])
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        self.pool.num_queries += len(tokens)
        self.pool.num_hits += len(blocks) * bs
        return blocks, hashes

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        computed_hashes: list[int] | None = None,
    ) -> bool:
        """Give ``req`` the blocks to hold ``num_new_tokens`` more tokens (after any prefix hit in
        ``computed_blocks``). All or nothing: returns False and changes nothing if the pool is short.
        On success, registers every block that this step fills completely in the prefix cache."""
        computed_blocks = computed_blocks or []
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(computed_blocks) * bs
        total_blocks = cdiv(num_computed + num_new_tokens, bs)
        num_required = total_blocks - len(req.block_ids) - len(computed_blocks)
        # With every layer windowed, hit blocks wholly before the next query's window are never read:
        # they stay where they are (cached, not held) and the table gets NULL_BLOCK in their place,
        # so a long cached prefix costs no more blocks than a fresh one (the admission bound holds).
        skip = min(len(computed_blocks), self._num_out_of_window(num_computed))
        held = computed_blocks[skip:]
        # Hit blocks with no references sit in the free queue: taking them uses up free blocks.
        num_revived = sum(1 for b in held if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - num_revived:
            return False
        if computed_blocks:
            self.pool.touch(held)
            req.block_ids.extend([NULL_BLOCK] * skip)
            req.block_ids.extend(b.block_id for b in held)
            req.block_hashes.extend(computed_hashes)
            req.num_computed_tokens = num_computed
        if num_required > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(num_required))
        if self.enable_caching:
            # only known tokens are hashed: draft tokens scheduled past them are unverified
            self._cache_full_blocks(req, min(num_computed + num_new_tokens, req.num_tokens))
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        tokens = req.all_token_ids
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else None
            chunk = tokens[i * bs:(i + 1) * bs]
            h, _ = self.pool.lookup(parent, chunk)
            self.pool.cache_block(req.block_ids[i], h, parent, chunk)
            req.block_hashes.append(h)

    def free_out_of_window(self, req: Request) -> int:
        """With every layer windowed: release the request's blocks that no layer can read again and
        put NULL_BLOCK in their place in its block table. The next query sits at position
        ``num_computed_tokens`` and sees keys from ``num_computed_tokens - W + 1`` on, so the blocks
        wholly before that one are done with (``reference.paged_attention`` starts reading at that
        very block). They keep their hashes, as any freed block: a prefix-cache hit may revive them
        until they are allocated again. Returns how many were released."""
        if self.sliding_window is None:
            return 0
        ids = req.block_ids
        n = self._num_out_of_window(req.num_computed_tokens)
        released = []
        for i in range(min(n, len(ids)) - 1, -1, -1):  # back to the first already released one
            if ids[i] == NULL_BLOCK:
                break
            released.append(ids[i])  # latest first, as free() does: the oldest stay cached longest
            ids[i] = NULL_BLOCK
        self.pool.free(released)
        return len(released)

    def _num_out_of_window(self, position: int) -> int:
        """How many leading blocks no layer reads for a query at ``position`` (0 unless every layer
        is windowed)."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, max_chunk)

    def free_tail(self, req: Request, num_tokens: int) -> int:
        """Release the blocks past the first ``cdiv(num_tokens, block_size)`` of the request's table:
        after a speculative step they held only rejected draft tokens (never hashed: only known
        tokens are). Latest first, as ``free`` does. Returns how many were released."""
        keep = cdiv(num_tokens, self.block_size)
        tail = req.block_ids[keep:]
        if not tail:
            return 0
        assert len(req.block_hashes) <= keep, "a block past the verified tokens is in the prefix cache"
        del req.block_ids[keep:]
        self.pool.free([b for b in reversed(tail) if b != NULL_BLOCK])
        return len(tail)

    def free(self, req: Request) -> None:
        self.pool.free([b for b in reversed(req.block_ids) if b != NULL_BLOCK])
        req.block_ids = []
        req.block_hashes = []
