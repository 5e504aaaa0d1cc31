"""Per-request view of the block pool: prefix-cache lookups and slot allocation. No torch."""
from __future__ import annotations

from appliance.engine.block_pool import BlockPool, KVBlock
from appliance.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
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
        # Hit blocks with no references sit in the free queue: taking them uses up free blocks.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_required > self.pool.num_free_blocks - num_revived:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            req.block_ids.extend(b.block_id for b in computed_blocks)
            req.block_hashes.extend(computed_hashes)
            req.num_computed_tokens = num_computed
        if num_required > 0:
            req.block_ids.extend(b.block_id for b in self.pool.allocate(num_required))
        if self.enable_caching:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
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

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.block_hashes = []

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
