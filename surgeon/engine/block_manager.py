"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, and a prefix cache.

A full block is known by a hash chained over every token before it (and the digest of any image
whose placeholders it holds), so two requests sharing a prefix share its blocks. A block's hash is
registered only once its keys have been computed (chunked prefill fills a prompt over several
steps). Freed blocks keep their hash until reused, least recently freed first, so a prefix
survives its request while memory allows.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class Block:
    __slots__ = ("id", "refs", "hash", "tokens")

    def __init__(self, block_id: int):
        self.id, self.refs, self.hash, self.tokens = block_id, 0, None, None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.hits = self.lookups = 0  # prefix-cache statistics, in tokens

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _chain(self, seq: Sequence, index: int, previous: int | None) -> tuple[int, tuple]:
        begin = index * self.block_size
        tokens = tuple(seq.token_ids[begin : begin + self.block_size])
        key = (tokens, seq.image_key(begin, begin + self.block_size))
        return hash((previous, key)), key

    def _take(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        if block.refs == 0:
            del self.free[block_id]
        block.refs += 1
        return block

    def _fresh(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.by_hash.get(block.hash) == block_id:
            del self.by_hash[block.hash]
        block.hash, block.tokens, block.refs = None, None, 1
        return block

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= self.num_free

    def allocate(self, seq: Sequence, reuse: bool = True) -> None:
        """Blocks for all of seq's tokens, reusing cached full blocks of its prefix (unless not
        `reuse`: fresh blocks only). The last token is never taken from the cache: its logits are
        needed."""
        assert not seq.block_table
        previous, cached = None, 0
        usable = (len(seq) - 1) // self.block_size if self.prefix_caching and reuse else 0
        for index in range(usable):
            chained, key = self._chain(seq, index, previous)
            block_id = self.by_hash.get(chained)
            if block_id is None or self.blocks[block_id].tokens != key:
                break
            seq.block_table.append(self._take(block_id).id)
            seq.block_hashes.append(chained)
            previous, cached = chained, cached + self.block_size
        for _ in range(len(seq.block_table), self.blocks_needed(len(seq))):
            seq.block_table.append(self._fresh().id)
        seq.computed = cached
        self.hits += cached
        self.lookups += len(seq)

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self._fresh().id)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past what seq's tokens need (a speculative step's rejected tail). Those
        blocks were fresh and never committed, so no prefix-cache entry points into them."""
        while len(seq.block_table) > self.blocks_needed(len(seq)):
            block = self.blocks[seq.block_table.pop()]
            block.refs -= 1
            if block.refs == 0:
                self.free[block.id] = None

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full and computed in the last step."""
        if not self.prefix_caching:
            return
        for index in range(len(seq.block_hashes), seq.computed // self.block_size):
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            chained, key = self._chain(seq, index, previous)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None:
                block.hash, block.tokens = chained, key
                self.by_hash.setdefault(chained, block.id)
            seq.block_hashes.append(chained)

    def release(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                self.free[block_id] = None
        seq.block_table, seq.block_hashes, seq.computed = [], [], 0
