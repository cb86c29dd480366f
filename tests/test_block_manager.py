"""Paged-KV block bookkeeping: exhaustion, growth, prefix caching, pinned prefixes, and random
interleavings checked against a simulated KV store (every block remembers which token it holds at
each offset, so a wrong reuse or a write into a shared block shows up as wrong content)."""
import random

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from onepass.engine.block_manager import BlockManager, PoolExhausted, sha256_block_hash


def toks(n, start=1000):
    return list(range(start, start + n))


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("nb,bs", [(1, 4), (0, 4), (8, 3), (8, 0), (8, -4), (8, 6)])
def test_bad_construction(nb, bs):
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockManager(nb, bs)


def test_blocks_for_and_scratch():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.num_free == 7 and bm.num_used == 0
    bm.allocate(1, toks(28))  # all 7 allocatable blocks
    assert 0 not in bm.table(1) and sorted(bm.table(1)) == list(range(1, 8))
    bm.check_invariants()


def test_allocate_twice_and_empty_prompt():
    bm = BlockManager(8, 4)
    bm.allocate(1, toks(3))
    with pytest.raises(ValueError, match="already"):
        bm.allocate(1, toks(3))
    with pytest.raises(ValueError, match="empty"):
        bm.allocate(2, [])
    with pytest.raises(KeyError):
        bm.free(99)


# ---------------------------------------------------------------------------- exhaustion
def test_exhaustion_and_recovery():
    bm = BlockManager(6, 4)  # 5 allocatable
    assert bm.can_allocate(toks(12))
    bm.allocate(1, toks(12))  # 3 blocks
    assert bm.num_free == 2
    p = toks(9, start=5000)  # 3 blocks, 2 free
    assert not bm.can_allocate(p)
    assert bm.can_allocate(toks(8, start=5000))
    assert not bm.can_allocate(toks(8, start=5000), reserve_tokens=1)
    with pytest.raises(PoolExhausted, match=r"needs 3 new KV blocks, only 2 free"):
        bm.allocate(2, p)
    bm.check_invariants()  # the failed allocate changed nothing
    assert bm.num_free == 2 and bm.num_used == 3
    bm.free(1)
    assert bm.can_allocate(p)
    bm.allocate(2, p)
    assert len(bm.table(2)) == 3
    bm.check_invariants()


def test_never_fits_detectable():
    bm = BlockManager(5, 4)  # 4 allocatable = 16 positions
    assert bm.blocks_for(16) <= bm.num_blocks - 1
    assert bm.blocks_for(17) > bm.num_blocks - 1
    assert not bm.can_allocate(toks(17))
    with pytest.raises(PoolExhausted):
        bm.allocate(1, toks(17))


# ---------------------------------------------------------------------------- growth
def test_append_growth_and_free():
    bm = BlockManager(10, 4)
    assert bm.allocate(1, toks(3)) == 0
    assert len(bm.table(1)) == 1
    for n in range(4, 21):
        assert bm.can_append(1, n)
        bm.append(1, n)
        assert len(bm.table(1)) == bm.blocks_for(n)
        bm.check_invariants()
    bm.append(1, 10)  # shrinking is a no-op
    assert len(bm.table(1)) == 5
    assert bm.peak_used == 5
    table = bm.table(1)
    assert len(set(table)) == 5
    bm.allocate(2, toks(16, 3000))  # 4 blocks: 9 allocatable - 5
    assert not bm.can_append(1, 21)
    with pytest.raises(PoolExhausted, match="needs 1 new KV blocks, only 0 free"):
        bm.append(1, 21)
    bm.free(1)
    bm.free(2)
    assert bm.num_free == 9 and bm.num_used == 0 and bm.peak_used == 9
    bm.check_invariants()


# ---------------------------------------------------------------------------- prefix caching
BS = 4


def run_prompt(bm, sid, prompt, extra=()):
    """Allocate, compute the prompt (and `extra` decoded tokens), commit like the scheduler does."""
    cached = bm.allocate(sid, prompt)
    seq = list(prompt)
    bm.commit(sid, seq)
    for t in extra:
        seq.append(t)
        bm.append(sid, len(seq))
        bm.commit(sid, seq[:-1])  # the newest token's KV is written on the next step
    return cached


def test_prefix_sharing_and_private_last_block():
    bm = BlockManager(32, BS, prefix_caching=True)
    prefix = toks(3 * BS)
    a = prefix + [1, 2, 3]
    b = prefix + [7, 8, 9, 10, 11]
    assert run_prompt(bm, 1, a) == 0
    assert run_prompt(bm, 2, b) == 3 * BS
    ta, tb = bm.table(1), bm.table(2)
    assert ta[:3] == tb[:3]
    assert set(ta[3:]).isdisjoint(tb[3:])
    assert all(bm.refcount(x) == 2 for x in ta[:3])
    assert all(bm.refcount(x) == 1 for x in ta[3:] + tb[3:])
    # a block-aligned prompt identical to the prefix: the block holding its last token stays private
    assert bm.allocate(3, list(prefix)) == 2 * BS
    t3 = bm.table(3)
    assert t3[:2] == ta[:2] and t3[2] not in ta + tb
    assert bm.refcount(ta[0]) == 3 and bm.refcount(ta[2]) == 2
    s = bm.stats()
    assert s["prefix_hits_tokens"] == 5 * BS
    assert s["prefix_queries_tokens"] == len(a) + len(b) + len(prefix)
    bm.check_invariants()


def test_committed_decode_blocks_are_shared():
    bm = BlockManager(32, BS, prefix_caching=True)
    p = toks(BS + 2)
    run_prompt(bm, 1, p, extra=[50, 51, 52])  # 9 tokens, 8 committed: two full blocks hashed
    assert bm.allocate(2, p + [50, 51, 52, 53]) == 2 * BS
    assert bm.table(2)[:2] == bm.table(1)[:2]
    bm.check_invariants()


def test_cached_blocks_reused_after_free_then_evicted_lru():
    bm = BlockManager(9, BS, prefix_caching=True)  # 8 allocatable
    prefix = toks(3 * BS)
    run_prompt(bm, 1, prefix + [1])
    run_prompt(bm, 2, prefix + [2])
    shared = bm.table(1)[:3]
    bm.free(1)
    bm.free(2)
    st_ = bm.stats()
    assert st_["used"] == 0 and st_["cached_free"] == 3 and bm.num_free == 8
    assert all(bm.refcount(x) == 0 for x in shared)
    # third request hits the cached blocks (they leave the LRU)
    assert run_prompt(bm, 3, prefix + [3]) == 3 * BS
    assert bm.table(3)[:3] == shared
    assert bm.stats()["cached_free"] == 0
    bm.free(3)
    bm.check_invariants()
    # pressure: a fresh 8-block request must evict every cached block
    other = toks(8 * BS, start=9000)
    assert bm.can_allocate(other)
    assert run_prompt(bm, 4, other) == 0
    assert bm.stats()["cached_free"] == 0 and bm.stats()["evictions"] >= 3
    bm.free(4)
    # the old prefix is gone now (its blocks were overwritten by request 4) ...
    assert bm.allocate(5, prefix + [4]) == 0
    bm.free(5)
    bm.check_invariants()


def test_lru_eviction_order():
    bm = BlockManager(7, BS, prefix_caching=True)  # 6 allocatable
    pa, pb = toks(BS, 100), toks(BS, 200)
    run_prompt(bm, 1, pa + [1])  # 2 blocks, first one hashed (the 2nd is partial)
    run_prompt(bm, 2, pb + [2])
    a0, b0 = bm.table(1)[0], bm.table(2)[0]
    bm.free(1)  # a0 freed first -> evicted first
    bm.free(2)
    assert bm.stats()["cached_free"] == 2
    run_prompt(bm, 3, toks(5 * BS, 7000))  # 5 fresh blocks: 4 plain free + 1 eviction
    assert a0 in bm.table(3) and b0 not in bm.table(3)
    bm.free(3)
    assert bm.allocate(4, pb + [9]) == BS and bm.table(4)[0] == b0
    bm.free(4)
    assert bm.allocate(5, pa + [9]) == 0
    bm.check_invariants()


def test_can_allocate_counts_cached_hits_taken_from_lru():
    bm = BlockManager(5, BS, prefix_caching=True)  # 4 allocatable
    p = toks(3 * BS)
    run_prompt(bm, 1, p + [1])  # 4 blocks, 3 hashed
    bm.free(1)
    assert bm.num_free == 4
    # 3 hits + 1 new: fits exactly; the hits are not double counted as free
    assert bm.can_allocate(p + [2])
    assert not bm.can_allocate(p + [2], reserve_tokens=BS)
    assert bm.allocate(2, p + [2]) == 3 * BS
    assert bm.num_free == 0
    bm.check_invariants()


@pytest.mark.parametrize("hash_fn", [lambda parent, t: 0, lambda parent, t: len(t) % 2])
def test_forced_hash_collisions_never_reuse_wrong_blocks(hash_fn):
    bm = BlockManager(64, BS, prefix_caching=True, hash_fn=hash_fn)
    a = toks(3 * BS, 100) + [1]
    b = toks(3 * BS, 500) + [1]              # same length, different tokens: every key collides
    c = toks(BS, 500) + toks(2 * BS, 100) + [1]  # later blocks equal a's, but behind a different parent
    assert run_prompt(bm, 1, a) == 0
    assert run_prompt(bm, 2, b) == 0
    assert set(bm.table(1)).isdisjoint(bm.table(2))
    assert run_prompt(bm, 3, c) == BS  # only c's first block (== b's first) matches
    assert bm.table(3)[0] == bm.table(2)[0] and set(bm.table(3)[1:]).isdisjoint(bm.table(1))
    assert run_prompt(bm, 4, a) == 3 * BS and bm.table(4)[:3] == bm.table(1)[:3]
    assert run_prompt(bm, 5, b) == 3 * BS and bm.table(5)[:3] == bm.table(2)[:3]
    bm.check_invariants()


def test_parent_reuse_after_eviction_is_not_a_match():
    """Constant hash: keys never separate chains, only tokens + the parent's registration do. A parent
    block evicted and re-registered with the same tokens at another position must not revive a child
    that was computed behind its old content."""
    sim = Sim(8, BS, True, "const")  # 7 allocatable
    bm = sim.bm
    w, x, y = toks(BS, 100), toks(BS, 200), toks(BS, 300)
    for prompt in (w, x, x + y + [1], toks(2 * BS, 900)):  # seqs 0..3; seq 3 is a 2-block filler
        sim.allocate(prompt)
    for sid in range(4):
        sim.compute(sid, 100)  # W, A(x) registered; seq 2's copy of x is a private duplicate,
    W, A = bm.table(0)[0], bm.table(1)[0]  # its y block B registered behind A
    B = bm.table(2)[1]
    assert bm.refcount(B) == 1 and bm.table(2)[0] != A
    sim.free(0)
    sim.free(1)                       # LRU [W, A]; nothing on the plain free list
    sim.allocate(w + x)               # seq 4: hits W, evicts A for its private x block
    assert sim.seqs[4]["cached"] == BS and bm.table(4) == [W, A]
    sim.compute(4, 100)               # A re-registered: x behind w
    sim.free(4)
    sim.free(3)                       # room for the probe
    sim.allocate(w + x + y + [1])     # seq 5: W, A match; B (y computed behind x at position 0) must not
    assert sim.seqs[5]["cached"] == 2 * BS and bm.table(5)[:2] == [W, A] and B not in bm.table(5)
    sim.check()
    sim.drain()


def test_sha256_default_is_stable_and_chained():
    k1 = sha256_block_hash(b"", (1, 2, 3, 4))
    assert k1 == sha256_block_hash(b"", (1, 2, 3, 4)) and len(k1) == 32
    assert sha256_block_hash(k1, (5, 6, 7, 8)) != sha256_block_hash(b"", (5, 6, 7, 8))
    assert sha256_block_hash(b"", (1, 2)) != sha256_block_hash(b"", (2, 1))


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(32, BS)
    p = toks(3 * BS + 1)
    run_prompt(bm, 1, p)
    assert bm.allocate(2, p) == 0
    assert set(bm.table(1)).isdisjoint(bm.table(2))
    bm.free(1)
    bm.free(2)
    assert bm.stats()["cached_free"] == 0 and bm.num_free == 31
    bm.check_invariants()


# ---------------------------------------------------------------------------- pinned prefix
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_pin_prefix(prefix_caching):
    bm = BlockManager(12, BS, prefix_caching=prefix_caching)  # 11 allocatable
    sys_prompt = toks(2 * BS + 2)
    pinned = bm.pin_prefix(sys_prompt)
    assert len(pinned) == 2 and 0 not in pinned
    assert bm.pin_prefix(toks(2 * BS + 2)) == pinned  # idempotent
    assert all(bm.refcount(b) == 1 for b in pinned) and bm.num_used == 2
    assert bm.pin_prefix(toks(2 * BS)) == pinned[:1]  # aligned: the last block is not pinned
    for sid in range(3):
        assert bm.allocate(sid, sys_prompt + [sid]) == 2 * BS
        assert bm.table(sid)[:2] == pinned
    assert all(bm.refcount(b) == 4 for b in pinned)
    assert bm.allocate(9, toks(BS, 5000) + sys_prompt) == 0  # not a prefix: no sharing
    bm.check_invariants()
    for sid in (0, 1, 2, 9):
        bm.free(sid)
    assert all(bm.refcount(b) == 1 for b in pinned)
    assert bm.num_free == 9 and bm.stats()["cached_free"] == 0
    # pressure never evicts pinned blocks
    big = toks(9 * BS, 7000)
    bm.allocate(10, big)
    assert set(bm.table(10)).isdisjoint(pinned)
    assert not bm.can_allocate(toks(1, 8000))
    bm.free(10)
    assert bm.allocate(11, sys_prompt) == 2 * BS  # still shared after the pressure
    bm.check_invariants()


def test_whole_pinned_shares_the_pinned_prefix_whole_or_not_at_all():
    """A hybrid model's recurrent state is snapshotted only at the pinned prefix's end, so a sequence that matches
    only some of its blocks must share none (its own blocks, computed from position 0)."""
    with pytest.raises(ValueError, match="cannot go with prefix_caching"):
        BlockManager(12, BS, prefix_caching=True, whole_pinned=True)
    bm = BlockManager(12, BS, whole_pinned=True)
    sys_prompt = toks(2 * BS + 2)
    pinned = bm.pin_prefix(sys_prompt)
    assert bm.pin_prefix(sys_prompt) == pinned   # the same prefix again: a no-op, as without whole_pinned
    with pytest.raises(ValueError, match="one pinned prefix"):
        bm.pin_prefix(toks(2 * BS))   # its first block alone: a second snapshot point
    assert bm.allocate(0, sys_prompt + [7]) == 2 * BS and bm.table(0)[:2] == pinned
    part = toks(BS) + toks(2 * BS, 9000)   # the first pinned block, then other tokens
    assert bm.can_allocate(part)
    assert bm.allocate(1, part) == 0 and set(bm.table(1)).isdisjoint(pinned)
    plain = BlockManager(12, BS)
    plain.pin_prefix(sys_prompt)
    assert plain.allocate(1, part) == BS   # without whole_pinned the first block is shared
    bm.check_invariants()


def test_pin_prefix_exhausted():
    bm = BlockManager(3, BS)
    with pytest.raises(PoolExhausted, match="needs 3 new KV blocks, only 2 free"):
        bm.pin_prefix(toks(3 * BS + 1))
    assert bm.pin_prefix(toks(3)) == []
    bm.check_invariants()


# ---------------------------------------------------------------------------- random interleavings
def const_hash(parent, t):
    return 0


def mod_hash(parent, t):
    return hash((parent, t)) % 3


HASHES = {"sha": None, "const": const_hash, "mod3": mod_hash}


class Sim:
    """A BlockManager driven like the scheduler, beside a simulated KV store that records what each
    block holds; every access is checked against it."""

    def __init__(self, nb, bs, pc, hash_name):
        self.bm = BlockManager(nb, bs, prefix_caching=pc, hash_fn=HASHES[hash_name])
        self.bs = bs
        self.kv = {}        # block -> {offset: token}
        self.seqs = {}      # sid -> dict(tokens, computed, cached)
        self.pinned = set()
        self.next_sid = 0

    def write(self, sid, pos):
        s = self.seqs[sid]
        b = self.bm.table(sid)[pos // self.bs]
        assert b != 0
        assert self.bm.refcount(b) == 1 and b not in self.pinned, f"write into shared block {b}"
        assert pos >= s["cached"]
        self.kv.setdefault(b, {})[pos % self.bs] = s["tokens"][pos]

    def allocate(self, prompt):
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        bm = self.bm
        if not bm.can_allocate(prompt):
            with pytest.raises(PoolExhausted):
                bm.allocate(sid, prompt)
            return
        cached = bm.allocate(sid, prompt)
        assert cached % self.bs == 0 and 0 <= cached < len(prompt)
        table = bm.table(sid)
        assert len(table) == bm.blocks_for(len(prompt)) and 0 not in table
        for p in range(cached):  # reused KV must hold exactly this prompt's tokens
            assert self.kv.get(table[p // self.bs], {}).get(p % self.bs) == prompt[p], "wrong reuse"
        self.seqs[sid] = dict(tokens=list(prompt), computed=cached, cached=cached)

    def compute(self, sid, k):
        s = self.seqs[sid]
        end = min(s["computed"] + k, len(s["tokens"]))
        for p in range(s["computed"], end):
            self.write(sid, p)
        s["computed"] = end
        self.bm.commit(sid, s["tokens"][:end])

    def grow(self, sid, tok):
        s = self.seqs[sid]
        n = len(s["tokens"]) + 1
        if not self.bm.can_append(sid, n):
            with pytest.raises(PoolExhausted):
                self.bm.append(sid, n)
            return
        self.bm.append(sid, n)
        s["tokens"].append(tok)

    def free(self, sid):
        self.bm.free(sid)
        del self.seqs[sid]

    def pin(self, tokens):
        before = self.bm.stats()
        try:
            blocks = self.bm.pin_prefix(tokens)
        except PoolExhausted:
            assert self.bm.stats() == before  # a failed pin changes nothing
            return
        for i, b in enumerate(blocks):  # the caller fills their KV
            for o in range(self.bs):
                self.kv.setdefault(b, {})[o] = tokens[i * self.bs + o]
        self.pinned.update(blocks)

    def check(self):
        bm = self.bm
        bm.check_invariants()
        st_ = bm.stats()
        assert bm.num_free + st_["used"] == bm.num_blocks - 1
        assert st_["free"] + st_["used"] + st_["cached_free"] == bm.num_blocks - 1
        owners = {}
        for sid, s in self.seqs.items():
            table = bm.table(sid)
            assert 0 not in table
            assert len(table) >= bm.blocks_for(len(s["tokens"]))
            for j, b in enumerate(table):
                owners.setdefault(b, []).append((sid, j))
        for b in range(1, bm.num_blocks):
            own = owners.get(b, [])
            assert bm.refcount(b) == len(own) + (b in self.pinned)
            if len(own) > 1 or b in self.pinned:
                for sid, j in own:  # shared: never in a position the owner may still write
                    s = self.seqs[sid]
                    assert (j + 1) * self.bs <= max(s["cached"], s["computed"])
        assert set(bm.pinned) == self.pinned
        assert st_["used"] <= st_["peak_used"]

    def drain(self):
        for sid in list(self.seqs):
            self.free(sid)
        self.check()
        bm = self.bm
        assert bm.num_used == len(self.pinned)
        assert bm.num_free == bm.num_blocks - 1 - len(self.pinned)
        # every non-pinned block really is allocatable again
        n = bm.num_free * self.bs
        if n:
            cached = bm.allocate("all", [10_000 + i for i in range(n)])
            assert cached == 0 and set(bm.table("all")).isdisjoint(self.pinned)
            bm.free("all")
        bm.check_invariants()


FAMILIES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7, 8], [7, 7, 7, 7, 7, 7, 7, 7]]


def prompts(max_len=14):
    """Prompts built from a few shared families plus a random tail, so prefixes collide often."""
    return st.builds(lambda fam, cut, tail: FAMILIES[fam][:cut] + tail,
                     st.integers(0, len(FAMILIES) - 1), st.integers(0, 12),
                     st.lists(st.integers(1, 4), max_size=4)).filter(lambda p: 0 < len(p) <= max_len)


class BlockMachine(RuleBasedStateMachine):
    @initialize(nb=st.integers(2, 16), bs=st.sampled_from([1, 2, 4]), pc=st.booleans(),
                hash_name=st.sampled_from(list(HASHES)))
    def setup(self, nb, bs, pc, hash_name):
        self.sim = Sim(nb, bs, pc, hash_name)

    def has_seqs(self):
        return bool(self.sim.seqs)

    @rule(prompt=prompts())
    def allocate(self, prompt):
        self.sim.allocate(prompt)

    @precondition(has_seqs)
    @rule(data=st.data(), k=st.integers(1, 8))
    def compute(self, data, k):
        sid = data.draw(st.sampled_from(sorted(self.sim.seqs)))
        self.sim.compute(sid, k)

    @precondition(has_seqs)
    @rule(data=st.data(), tok=st.integers(1, 4))
    def grow(self, data, tok):
        sid = data.draw(st.sampled_from(sorted(self.sim.seqs)))
        s = self.sim.seqs[sid]
        if s["computed"] == len(s["tokens"]):  # decode: append only after the KV so far is written
            self.sim.grow(sid, tok)

    @precondition(has_seqs)
    @rule(data=st.data())
    def free(self, data):
        self.sim.free(data.draw(st.sampled_from(sorted(self.sim.seqs))))

    @rule(fam=st.integers(0, len(FAMILIES) - 1), cut=st.integers(1, 12))
    def pin(self, fam, cut):
        self.sim.pin(FAMILIES[fam][:cut])

    @invariant()
    def invariants(self):
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.drain()


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


@pytest.mark.parametrize("seed", range(6))
def test_random_long_runs(seed):
    """Longer seeded runs on a mid-size pool: lots of eviction, hits and collisions."""
    rng = random.Random(seed)
    hash_name = ["sha", "const", "mod3"][seed % 3]
    sim = Sim(rng.randint(8, 40), rng.choice([1, 2, 4, 8]), seed % 2 == 0 or seed == 5, hash_name)
    if seed >= 4:
        sim.pin(FAMILIES[0][:rng.randint(1, 12)])
    for _ in range(1500):
        r = rng.random()
        if r < 0.25 or not sim.seqs:
            fam = rng.choice(FAMILIES)
            p = fam[:rng.randint(0, len(fam))] + [rng.randint(1, 3) for _ in range(rng.randint(0, 6))]
            if p:
                sim.allocate(p)
        elif r < 0.55:
            sim.compute(rng.choice(list(sim.seqs)), rng.randint(1, 10))
        elif r < 0.85:
            sid = rng.choice(list(sim.seqs))
            s = sim.seqs[sid]
            if s["computed"] == len(s["tokens"]):
                sim.grow(sid, rng.randint(1, 3))
            else:
                sim.compute(sid, 1)
        else:
            sim.free(rng.choice(list(sim.seqs)))
        sim.check()
    st_ = sim.bm.stats()
    if sim.bm.prefix_caching:
        assert st_["prefix_hits_tokens"] > 0
    sim.drain()
