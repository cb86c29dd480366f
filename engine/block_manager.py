"""Block bookkeeping for the paged KV cache: block tables, refcounts, prefix caching, pinned prefixes.

The pool holds `num_blocks` blocks of `block_size` positions. Block 0 is the scratch block (padded and
inactive rows write there) and is never handed out; blocks 1..num_blocks-1 are allocatable. A sequence
owns a block table: position p lives in block table[p // block_size] at offset p % block_size.

Every allocatable block is in exactly one of three states:
  used         refcount > 0: referenced by live tables (+1 held by the manager when pinned)
  free         refcount 0, holds nothing reusable (a plain free list)
  cached_free  refcount 0, hashed: its KV is a known token block, kept for reuse in an LRU (least
               recently freed first) and evicted only when a fresh block is needed and `free` is empty

Prefix caching. A FULL block i of a sequence gets the chained key
    key_i = hash_fn(key_{i-1}, tuple(tokens of block i)),  key_{-1} = b""
The default `hash_fn` is SHA-256 over key_{i-1} followed by the tokens as little-endian int64, so keys
are stable across processes (unlike Python's salted `hash`). Keys only pick a bucket: every cached
block also keeps its tokens and the registration id of its parent block, and a lookup accepts a block
only when its tokens equal the prompt's and its parent is the block matched one step earlier. By
induction a match means the whole prefix is equal, so a hash collision (or a parent that was evicted
and re-used in the meantime: registration ids are never reused) is a miss, never a wrong reuse.
`hash_fn` is injectable so tests can force collisions.

Shared blocks are never written: allocate() matches at most floor((len(prompt)-1)/block_size) blocks,
so the block holding the last prompt token is private and a sequence writes only positions >=
num_cached_tokens. A block is hashed (commit) only once it is full and its KV has been written, and a
sequence never writes below its committed length again.

Pinned prefixes (the seed's shared-prefix mode) are registered in the same index and hold an extra
refcount owned by the manager, so they are never freed or evicted. They are matched on allocate with
or without `prefix_caching`; without it, commit() registers nothing, so pinned blocks are the only
ones that can be shared. With `whole_pinned` (a hybrid model, whose recurrent state is snapshotted only at the
pinned prefix's end) a sequence shares the pinned prefix whole or not at all: a match of some of its blocks counts
as none, so every shared length has a state to go with it.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

HashFn = Callable[[Hashable, tuple], Hashable]

ROOT_KEY = b""  # the parent key of block 0
ROOT_REG = 0    # the parent registration id of block 0 (real registrations start at 1)


def sha256_block_hash(parent_key: Hashable, tokens: tuple) -> bytes:
    """Default chained key: SHA-256(parent digest || tokens as little-endian int64)."""
    h = hashlib.sha256(parent_key if isinstance(parent_key, bytes) else repr(parent_key).encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class PoolExhausted(Exception):
    """No block can be had: allocate/append/pin_prefix needed more blocks than are allocatable.
    Callers check can_allocate/can_append first."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 hash_fn: HashFn | None = None, whole_pinned: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the scratch block), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        if whole_pinned and prefix_caching:
            raise ValueError("whole_pinned shares only the pinned prefix; it cannot go with prefix_caching")
        self.whole_pinned = whole_pinned
        self.hash_fn: HashFn = hash_fn or sha256_block_hash

        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: first = least recently freed
        self._pinned: set[int] = set()
        self._num_used = 0
        self._peak_used = 0
        # prefix-cache index: key -> blocks registered under it (more than one only on hash collisions)
        self._index: dict[Hashable, list[int]] = {}
        self._key: list[Hashable | None] = [None] * num_blocks     # None = not hashed
        self._tokens: list[tuple | None] = [None] * num_blocks
        self._reg: list[int] = [0] * num_blocks                     # registration id (0 = not hashed)
        self._parent_reg: list[int] = [0] * num_blocks
        self._next_reg = 1
        # per sequence
        self._tables: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}          # positions the table must cover
        self._cached: dict[int, int] = {}       # num_cached_tokens returned by allocate
        self._committed: dict[int, int] = {}    # tokens whose KV the sequence reported written
        self._hashed: dict[int, int] = {}       # leading blocks whose chain state is known (matched/committed)
        self._chain: dict[int, tuple[Hashable, int]] = {}  # (key, registration id) of the last of those
        # stats
        self._hit_tokens = 0
        self._query_tokens = 0
        self._evictions = 0

    # ------------------------------------------------------------------ sizes
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks allocatable now: plain free + evictable cached blocks."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by live sequences or pinned."""
        return self._num_used

    @property
    def peak_used(self) -> int:
        return self._peak_used

    def stats(self) -> dict:
        return {
            "blocks": self.num_blocks,
            "used": self._num_used,
            "peak_used": self._peak_used,
            "free": len(self._free),
            "cached_free": len(self._cached_free),
            "pinned": len(self._pinned),
            "evictions": self._evictions,
            "prefix_hits_tokens": self._hit_tokens,       # sum of num_cached_tokens over allocate()
            "prefix_queries_tokens": self._query_tokens,  # sum of len(prompt) over allocate()
        }

    # ------------------------------------------------------------------ lookup
    def _block_tokens(self, tokens: Sequence[int], i: int) -> tuple:
        bs = self.block_size
        return tuple(int(t) for t in tokens[i * bs:(i + 1) * bs])

    def _find(self, key: Hashable, toks: tuple, parent_reg: int) -> int | None:
        for b in self._index.get(key, ()):
            if self._tokens[b] == toks and self._parent_reg[b] == parent_reg:
                return b
        return None

    def _match(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], Hashable, int]:
        """Longest chain of cached blocks equal to the start of `tokens` (at most max_blocks):
        (blocks, key of the last, registration id of the last)."""
        key, reg, out = ROOT_KEY, ROOT_REG, []
        if not self._index:
            return out, key, reg
        for i in range(max_blocks):
            toks = self._block_tokens(tokens, i)
            k = self.hash_fn(key, toks)
            b = self._find(k, toks, reg)
            if b is None:
                break
            out.append(b)
            key, reg = k, self._reg[b]
        return out, key, reg

    def _max_shared(self, num_tokens: int) -> int:
        return max(num_tokens - 1, 0) // self.block_size

    # ------------------------------------------------------------------ block moves
    def _take_fresh(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._cached_free.popitem(last=False)  # evict the least recently freed
            self._unregister(b)
            self._evictions += 1
        self._ref[b] = 1
        self._num_used += 1
        return b

    def _ref_inc(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._cached_free[b]  # a matched block with refcount 0 is always cached
            self._num_used += 1
        self._ref[b] += 1

    def _ref_dec(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self._num_used -= 1
            if self._key[b] is not None:
                self._cached_free[b] = None  # most recently freed: evicted last
            else:
                self._free.append(b)

    def _register(self, b: int, key: Hashable, toks: tuple, parent_reg: int) -> int:
        self._index.setdefault(key, []).append(b)
        self._key[b], self._tokens[b], self._parent_reg[b] = key, toks, parent_reg
        self._reg[b] = self._next_reg
        self._next_reg += 1
        return self._reg[b]

    def _unregister(self, b: int) -> None:
        bucket = self._index[self._key[b]]
        bucket.remove(b)
        if not bucket:
            del self._index[self._key[b]]
        self._key[b] = self._tokens[b] = None
        self._reg[b] = self._parent_reg[b] = 0

    def _note_peak(self) -> None:
        self._peak_used = max(self._peak_used, self._num_used)

    def _exhausted(self, what: str, need: int, avail: int) -> PoolExhausted:
        return PoolExhausted(f"{what} needs {need} new KV blocks, only {avail} free "
                             f"(pool of {self.num_blocks - 1} allocatable blocks of {self.block_size} positions, "
                             f"{self._num_used} in use)")

    # ------------------------------------------------------------------ sequences
    def _plan(self, tokens: Sequence[int], total_tokens: int, max_shared: int):
        matched, key, reg = self._match(tokens, max_shared)
        if self.whole_pinned and len(matched) < len(self._pinned):
            matched, key, reg = [], ROOT_KEY, ROOT_REG
        need = self.blocks_for(total_tokens) - len(matched)
        # matched blocks sitting in the cached LRU stop being allocatable once taken
        avail = self.num_free - sum(1 for b in matched if self._ref[b] == 0)
        return matched, key, reg, need, avail

    def can_allocate(self, prompt: Sequence[int], reserve_tokens: int = 0) -> bool:
        """Enough free (or evictable cached) blocks for the prompt's uncached blocks plus blocks for
        `reserve_tokens` more positions after the prompt."""
        _, _, _, need, avail = self._plan(prompt, len(prompt) + reserve_tokens, self._max_shared(len(prompt)))
        return need <= avail

    def allocate(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Build seq_id's table for len(prompt) positions; return num_cached_tokens (a multiple of
        block_size, < len(prompt)): the leading prompt tokens whose KV is already in shared blocks."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table; free it before allocating again")
        n = len(prompt)
        if n == 0:
            raise ValueError(f"sequence {seq_id!r}: cannot allocate an empty prompt")
        matched, key, reg, need, avail = self._plan(prompt, n, self._max_shared(n))
        if need > avail:
            raise self._exhausted(f"sequence {seq_id!r} ({n} prompt tokens, {len(matched)} blocks cached)", need, avail)
        for b in matched:
            self._ref_inc(b)
        table = matched + [self._take_fresh() for _ in range(need)]
        self._note_peak()
        cached = len(matched) * self.block_size
        self._tables[seq_id], self._len[seq_id] = table, n
        self._cached[seq_id] = self._committed[seq_id] = cached
        self._hashed[seq_id], self._chain[seq_id] = len(matched), (key, reg)
        self._hit_tokens += cached
        self._query_tokens += n
        return cached

    def _seq(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None

    def can_append(self, seq_id: int, new_len: int) -> bool:
        return self.blocks_for(new_len) - len(self._seq(seq_id)) <= self.num_free

    def grow(self, seq_id: int, new_len: int) -> int:
        """Cover new_len positions if the free pool allows it: the number of blocks added (0 when the
        table already covers them), or -1 with nothing changed when the pool is short."""
        table = self._seq(seq_id)
        if new_len <= len(table) * self.block_size:  # the common case: no new block
            if new_len > self._len[seq_id]:
                self._len[seq_id] = new_len
            return 0
        need = self.blocks_for(new_len) - len(table)
        if need > self.num_free:
            return -1
        self.append(seq_id, new_len)
        return need

    def append(self, seq_id: int, new_len: int) -> None:
        """Grow seq_id's table to cover new_len positions (no-op if it already does)."""
        table = self._seq(seq_id)
        need = self.blocks_for(new_len) - len(table)
        if need > self.num_free:
            raise self._exhausted(f"sequence {seq_id!r} growing to {new_len} positions", need, self.num_free)
        for _ in range(need):
            table.append(self._take_fresh())
        self._len[seq_id] = max(self._len[seq_id], new_len)
        self._note_peak()

    def commit_needs_tokens(self, seq_id: int, length: int) -> bool:
        """Whether committing `length` written positions fills a block the prefix cache must hash (so
        the caller must pass the tokens); otherwise `mark_written` records the length alone."""
        return self.prefix_caching and length // self.block_size > self._hashed[seq_id]

    def mark_written(self, seq_id: int, length: int) -> None:
        """`commit` for a length that fills no new block to hash (see commit_needs_tokens)."""
        if length > len(self._tables[seq_id]) * self.block_size:
            raise ValueError(f"sequence {seq_id!r}: {length} positions written but the table covers "
                             f"{len(self._tables[seq_id]) * self.block_size}")
        if length > self._committed[seq_id]:
            self._committed[seq_id] = length

    def commit(self, seq_id: int, tokens: Sequence[int], length: int | None = None) -> None:
        """The first `length` of `tokens` (default: all) have their KV written. Every block now full and
        not yet hashed is registered in the prefix cache (only with prefix_caching)."""
        table = self._seq(seq_id)
        n = len(tokens) if length is None else length
        if n > len(table) * self.block_size or n > len(tokens):
            raise ValueError(f"sequence {seq_id!r}: commit of {n} tokens ({len(tokens)} known) but the table "
                             f"covers {len(table) * self.block_size} positions")
        self._committed[seq_id] = max(self._committed[seq_id], n)
        if not self.prefix_caching:
            return
        full = n // self.block_size
        key, reg = self._chain[seq_id]
        for i in range(self._hashed[seq_id], full):
            toks = self._block_tokens(tokens, i)
            key = self.hash_fn(key, toks)
            b = table[i]
            dup = self._find(key, toks, reg)
            if dup is not None:
                # the same prefix block was computed by another sequence and registered first: keep
                # this copy private and continue the chain through the registered one
                reg = self._reg[dup]
            else:
                reg = self._register(b, key, toks, reg)
        if full > self._hashed[seq_id]:
            self._hashed[seq_id], self._chain[seq_id] = full, (key, reg)

    def free(self, seq_id: int) -> None:
        """Drop seq_id; blocks reaching refcount 0 return to the pool (hashed ones to the cached LRU).
        Blocks are released tail first, so a chain's later blocks are evicted before its earlier ones."""
        table = self._seq(seq_id)
        for b in reversed(table):
            self._ref_dec(b)
        for d in (self._tables, self._len, self._cached, self._committed, self._hashed, self._chain):
            del d[seq_id]

    def table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id))

    def refcount(self, block: int) -> int:
        """Owning tables + 1 if pinned (0 for free and cached-free blocks)."""
        return self._ref[block]

    def num_cached(self, seq_id: int) -> int:
        """num_cached_tokens that allocate() returned for seq_id."""
        self._seq(seq_id)
        return self._cached[seq_id]

    @property
    def seq_ids(self) -> list[int]:
        return list(self._tables)

    # ------------------------------------------------------------------ pinned prefix
    def pin_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Pin the block-aligned prefix of `tokens` (floor((len-1)/block_size) full blocks): the
        manager holds a refcount on each, so they are never freed or evicted, and every request whose
        prompt starts with these tokens shares them on allocate. Returns the block ids in order; the
        caller fills their KV once (blocks already cached for the same tokens are reused, so a refill
        writes the KV they already hold). Pinning the same prefix again is a no-op."""
        n = self._max_shared(len(tokens))
        if self.whole_pinned and self._pinned and not (len(self._pinned) == n == len(self._match(tokens, n)[0])):
            raise ValueError("whole_pinned keeps one pinned prefix (one state snapshot): pin the same tokens or none")
        matched, key, reg, need, avail = self._plan(tokens, n * self.block_size, n)
        if need > avail:
            raise self._exhausted(f"pinning a {n}-block prefix ({len(matched)} blocks cached)", need, avail)
        blocks = list(matched)
        for b in matched:
            if b not in self._pinned:
                self._ref_inc(b)
                self._pinned.add(b)
        for i in range(len(matched), n):
            toks = self._block_tokens(tokens, i)
            key = self.hash_fn(key, toks)
            b = self._take_fresh()
            reg = self._register(b, key, toks, reg)
            self._pinned.add(b)
            blocks.append(b)
        self._note_peak()
        return blocks

    @property
    def pinned(self) -> list[int]:
        return sorted(self._pinned)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violated invariant."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(msg)

        N, bs = self.num_blocks, self.block_size
        owners = [0] * N
        for sid, table in self._tables.items():
            need(len(set(table)) == len(table), f"seq {sid!r}: a block appears twice in its table {table}")
            need(len(table) == self.blocks_for(self._len[sid]),
                 f"seq {sid!r}: table has {len(table)} blocks for {self._len[sid]} positions")
            for b in table:
                need(0 < b < N, f"seq {sid!r}: block id {b} is the scratch block or out of range")
                owners[b] += 1
        need(self._ref[0] == 0 and 0 not in self._pinned and 0 not in self._cached_free
             and 0 not in self._free and self._key[0] is None, "scratch block 0 is in use, free or cached")

        free_set = set(self._free)
        need(len(free_set) == len(self._free), "free list holds a block twice")
        used = 0
        for b in range(1, N):
            pin = b in self._pinned
            need(self._ref[b] == owners[b] + pin,
                 f"block {b}: refcount {self._ref[b]} != {owners[b]} owning tables + {int(pin)} pin")
            states = (self._ref[b] > 0) + (b in free_set) + (b in self._cached_free)
            need(states == 1, f"block {b}: in {states} of used/free/cached_free (must be exactly one)")
            if self._ref[b] > 0:
                used += 1
            hashed = self._key[b] is not None
            if b in free_set:
                need(not hashed, f"block {b}: on the plain free list but hashed")
            if b in self._cached_free:
                need(hashed, f"block {b}: in the cached LRU but not hashed")
            if pin:
                need(hashed, f"block {b}: pinned but not registered")
            if owners[b] > 1:
                need(hashed or pin, f"block {b}: shared by {owners[b]} sequences but neither hashed nor pinned")
            if hashed:
                need(b in self._index.get(self._key[b], ()), f"block {b}: hashed but missing from the index")
                need(self._tokens[b] is not None and len(self._tokens[b]) == bs,
                     f"block {b}: hashed without a full block of tokens")
                need(self._reg[b] > 0, f"block {b}: hashed without a registration id")
        need(used == self._num_used, f"used count {self._num_used} != {used} blocks with refcount > 0")
        need(len(self._free) + used + len(self._cached_free) == N - 1,
             f"free {len(self._free)} + used {used} + cached_free {len(self._cached_free)} != {N - 1}")
        need(sum(len(v) for v in self._index.values()) == sum(k is not None for k in self._key),
             "index size differs from the number of hashed blocks")
        for key, bucket in self._index.items():
            for b in bucket:
                need(self._key[b] == key, f"block {b}: indexed under a key it does not hold")

        for sid, table in self._tables.items():
            cached = self._cached[sid]
            need(cached % bs == 0 and cached < max(self._len[sid], 1),
                 f"seq {sid!r}: num_cached_tokens {cached} not block-aligned or not < prompt length")
            for j in range(cached // bs):
                b = table[j]
                need(self._key[b] is not None, f"seq {sid!r}: cached block {b} at index {j} is not hashed")
            # the first position the sequence may still write, and every block from there on, is private
            start = max(cached, self._committed[sid]) // bs
            for j in range(start, len(table)):
                b = table[j]
                need(self._key[b] is None and b not in self._pinned and self._ref[b] == 1,
                     f"seq {sid!r}: block {b} at index {j} may still be written but is shared/hashed/pinned")
