"""Per-slot recurrent state of hybrid models (qwen35's Gated DeltaNet layers), beside the KV cache.

A GDN layer keeps, per slot, no KV but two fixed-size tensors:
  ssm[j]  [slots, Hv, Dk, Dv]        the delta-rule state S (fp32 by default; bf16 optional), HF/FLA layout
                                     (V fastest), value heads in HF grouped order (v head h reads k head
                                     h // (Hv/Hk); the loader un-permutes llama.cpp's tiled order)
  conv[j] [slots, conv_dim, K-1]     the last K-1 *pre-conv* qkv rows, oldest first (a shift ring), in the
                                     dtype the projection writes them in (HybridCache.create: the activations'), so
                                     keeping them is exact; an fp32 ring beside bf16 activations held the same
                                     values in twice the bytes (why: harness/PROBES.md, engine/state_pool.py:
                                     conv ring dtype)
where j indexes the GDN layers in order (`layers[j]` is the trunk layer index).
  log[j]  UpdateLog or None          with a write-back period M > 1 (`writeback`), ssm[j] holds each slot's base
                                     state and log[j] the (e, k, delta) of the tokens since (kernels/gdn.py's module
                                     doc): the GDN step then writes the whole state on one token in M, the same bits.
                                     The fused decoder reads it; the reference model keeps M = 1.
  draft[j] DraftLog or None          speculative decoding (`reserve_drafts`): each slot's last verify rows (their
                                     rank-1 updates and conv inputs), of which the slot's next run folds in those the
                                     target kept (kernels/gdn.py: speculative verify). Rolling back is that count.

The pool also counts the tokens each slot has absorbed, because a recurrence cannot skip or rewind:
a forward whose row starts at position 0 begins a new sequence (the slot's state is zeroed first, the
same way a KV slot is simply overwritten from position 0), and any other row must continue exactly
where its slot stopped. `reset(slots)` zeroes slots explicitly (e.g. when a scheduler frees them).

`HybridCache` bundles a KV cache (for the attention layers) with a StatePool and stands wherever a
model takes `kv`, so the reference loop and the engine's step drive qwen35 unchanged.
"""
from __future__ import annotations

import torch

from onepass.engine.config import ModelConfig
from onepass.kernels.errors import ConfigError

# Tokens per state write-back of the fused decoder's pools, per state dtype, when the config leaves it to the engine
# (kv_cache.state_writeback=0). An fp32 pool writes its state back every 4 tokens, the fastest period with the
# written-back kernel capped at 128 registers (kernels/gdn.py GDN_MAXNREG); a bf16 pool keeps writing every token,
# since longer periods made its steps slower (why: harness/PROBES.md, engine/state_pool.py: WRITEBACK;
# experiments/hybrid_27b/README.md has the history).
WRITEBACK = {"float32": 4, "bfloat16": 1}


def resolve_writeback(value: int, state_dtype: torch.dtype = torch.float32) -> int:
    """kv_cache.state_writeback as the period a pool is built with: 0 = the engine's WRITEBACK for the state dtype,
    else itself."""
    if value < 0:
        raise ConfigError(f"kv_cache.state_writeback={value}: give the tokens per state write-back (1 = every token, "
                          "as the reference does) or 0 for the engine's default")
    return int(value) or WRITEBACK[str(state_dtype).removeprefix("torch.")]


def snapshot_slots(first: int, writeback: int, num_slots: int) -> list[int]:
    """The spare state slots, from `first` on, that hold a pinned prefix's state for a scheduler of num_slots slots:
    entry c, for each write-back phase class c its slots fall in (StatePool.phase_class), is a slot of class c, since
    a state is copied only within its class. A pool needs max(...) + 1 slots."""
    return [first + (c - first) % writeback for c in range(min(writeback, num_slots))]


def _slot_list(slots) -> list[int]:
    if isinstance(slots, torch.Tensor):
        return [int(s) for s in slots.reshape(-1).tolist()]
    if isinstance(slots, int):
        return [slots]
    return [int(s) for s in slots]


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str = "cpu",
                 state_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.float32, writeback: int = 1):
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"recurrent state dtype {state_dtype} not supported (float32 or bfloat16)")
        if writeback < 1:
            raise ConfigError(f"state write-back period {writeback}: it counts tokens per write, 1 or more")
        self.cfg, self.num_slots, self.writeback = cfg, num_slots, writeback
        self.layers = cfg.gdn_layers
        self.index = {layer: j for j, layer in enumerate(self.layers)}
        ring = max(cfg.gdn_conv_kernel - 1, 0)
        self.ssm = [torch.zeros(num_slots, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, dtype=state_dtype,
                                device=device)
                    for _ in self.layers]
        self.conv = [torch.zeros(num_slots, cfg.gdn_conv_dim, ring, dtype=conv_dtype, device=device)
                     for _ in self.layers]
        if writeback > 1:
            from onepass.kernels.gdn import UpdateLog

            self.log = [UpdateLog.empty(num_slots, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, writeback, device)
                        for _ in self.layers]
        else:
            self.log = [None] * len(self.layers)
        self.draft = [None] * len(self.layers)
        self.seen = [0] * num_slots  # tokens absorbed per slot (host side: checked once per forward)

    def reserve_drafts(self, rows: int) -> None:
        """Room for a verify run of `rows` rows a slot (k drafts + the newest token) in every GDN layer's draft log;
        a log that holds as many already is kept."""
        if rows < 1:
            raise ConfigError(f"a verify run feeds at least one row a slot (got {rows})")
        if self.draft and self.draft[0] is not None and self.draft[0].rows >= rows:
            return
        from onepass.kernels.gdn import DraftLog

        cfg, dev = self.cfg, self.ssm[0].device if self.ssm else "cpu"
        conv_dtype = self.conv[0].dtype if self.conv else torch.float32
        self.draft = [DraftLog.empty(self.num_slots, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, cfg.gdn_conv_dim,
                                     rows, dev, conv_dtype) for _ in self.layers]

    def verify_bytes_per_slot(self, rows: int, kept: int) -> int:
        """Bytes speculation adds to a step of one slot beyond its decode step's (kernels/gdn.py: speculative verify):
        `rows` verify rows' updates and conv inputs written to the draft logs, and `kept` of them read back by the
        slot's next run. The state itself is read and written once a step either way."""
        from onepass.kernels.gdn import DraftLog

        cfg = self.cfg
        one = DraftLog.empty(1, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, cfg.gdn_conv_dim, 1, "meta",
                             self.conv[0].dtype if self.conv else torch.float32)
        return len(self.layers) * one.row_bytes() * (rows + kept)

    @property
    def state_dtype(self) -> torch.dtype:
        return self.ssm[0].dtype if self.ssm else torch.float32

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.ssm + self.conv) + sum(g.nbytes for g in self.log if g)
                + sum(d.nbytes for d in self.draft if d))

    def step_bytes_per_slot(self) -> float:
        """Bytes one decode token of one slot moves through the pool, averaged over the write-back period: the
        state read once and written on one token in M, the conv rings read and written, and (M > 1) a log entry
        written on the other M - 1 tokens and on average (M - 1) / 2 entries read."""
        state = sum(t[0].numel() * t.element_size() for t in self.ssm)
        conv = sum(t[0].numel() * t.element_size() for t in self.conv)
        M = self.writeback
        entry = sum(g.nbytes for g in self.log if g) / self.num_slots / max(M - 1, 1)
        return state * (1 + 1 / M) + 2 * conv + (entry * ((M - 1) / M + (M - 1) / 2) if M > 1 else 0.0)

    def reset(self, slots) -> None:
        """Zero the state and conv ring of the given slots (ids: tensor, list or int)."""
        ids = _slot_list(slots)
        if not ids:
            return
        self._check_ids(ids)
        idx = torch.tensor(ids, dtype=torch.long, device=self.ssm[0].device if self.ssm else "cpu")
        for s, c in zip(self.ssm, self.conv):
            s[idx] = 0
            c[idx] = 0
        for i in ids:
            self.seen[i] = 0

    def phase_class(self, slot: int) -> int:
        """The slots a state may be copied between share this class. With a write-back period M > 1 the fused GDN
        step writes slot s's whole state at the tokens p with (p + s) % M == M - 1 (kernels/gdn.py), so what the pool
        holds for a slot (a base state and the log since) is laid out for s % M; in a slot of another class the step
        would replay the wrong log entries onto the wrong base."""
        return slot % self.writeback

    def copy_slot(self, src: int, dst: int) -> None:
        """Make slot dst hold exactly what slot src holds: state, conv ring, update log and token count (a pinned
        prefix's snapshot kept in a spare slot, given to each request that starts with that prefix). Queued on the
        device's stream like the steps around it, so it lands after the last step that wrote dst."""
        self._check_ids([src, dst])
        if self.phase_class(src) != self.phase_class(dst):
            raise ConfigError(f"state slots {src} and {dst} differ modulo the write-back period {self.writeback}: a "
                              "slot's state is laid out for its own write-back phase (phase_class), so it is copied "
                              "only between slots of one class")
        for t in self.ssm + self.conv + [x for g in self.log if g for x in g]:
            t[dst].copy_(t[src])
        self.seen[dst] = self.seen[src]

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.num_slots]
        if bad:
            raise ConfigError(f"slot ids {bad} outside the state pool's {self.num_slots} slots")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"a forward names slot(s) {sorted({i for i in ids if ids.count(i) > 1})} twice; "
                              "a recurrent slot takes one row per step")

    def begin(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Before a forward over positions [B, T] of slots [B]: zero the slots that start at position 0,
        and check every other row continues its slot's sequence with consecutive positions."""
        ids = _slot_list(slots)
        self._check_ids(ids)
        T = positions.shape[1]
        steps = torch.arange(T, device=positions.device)
        if not bool((positions - positions[:, :1] == steps).all()):
            raise ConfigError("recurrent layers need consecutive positions within each row of a forward")
        starts = [int(p) for p in positions[:, 0].tolist()]
        wrong = [(s, p, self.seen[s]) for s, p in zip(ids, starts) if p != 0 and p != self.seen[s]]
        if wrong:
            s, p, n = wrong[0]
            raise ConfigError(f"slot {s}: a forward starts at position {p} but the slot's recurrent state holds "
                              f"{n} tokens; GDN state cannot skip or rewind (start a sequence at position 0 or "
                              "continue at the next position)")
        self.reset([s for s, p in zip(ids, starts) if p == 0])

    def advance(self, slots: torch.Tensor, tokens: int) -> None:
        for s in _slot_list(slots):
            self.seen[s] += tokens


class HybridCache:
    """KV cache of the attention layers + StatePool of the GDN layers, passed as a model's `kv`.
    Reads and writes go to the KV cache (indexed by trunk layer); `state` holds the recurrent part."""

    def __init__(self, kv, state: StatePool):
        if state.num_slots < kv.num_slots:
            raise ConfigError(f"state pool has {state.num_slots} slots but the KV cache has {kv.num_slots}")
        self.kv, self.state = kv, state

    @classmethod
    def create(cls, cfg: ModelConfig, num_slots: int, ctx: int, dtype: torch.dtype, device: torch.device | str,
               state_dtype: torch.dtype = torch.float32, writeback: int = 1) -> HybridCache:
        """Contiguous KV and a state pool for `num_slots` slots; KV and the conv rings in the activations' dtype."""
        from onepass.engine.kv_cache import ContiguousKVCache

        kv = drop_recurrent_kv(ContiguousKVCache(cfg, num_slots, ctx, dtype, device), cfg)
        return cls(kv, StatePool(cfg, num_slots, device, state_dtype, conv_dtype=dtype, writeback=writeback))

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def ctx(self) -> int:
        return self.kv.ctx

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.state.nbytes

    @property
    def block_table(self) -> torch.Tensor:
        """The paged KV's block table (AttributeError with contiguous KV, as for a plain cache)."""
        return self.kv.block_table

    def write(self, layer, slots, positions, k, v) -> None:
        self.kv.write(layer, slots, positions, k, v)

    def read(self, layer, slots, length):
        return self.kv.read(layer, slots, length)

    def reset(self, slots) -> None:
        self.state.reset(slots)


def drop_recurrent_kv(kv, cfg: ModelConfig):
    """Free the KV tensors of the GDN layers (they keep no KV): a KV cache built for every trunk layer keeps
    its per-layer indexing, with empty tensors where a GDN layer sits. Returns kv."""
    for i in cfg.gdn_layers:
        kv.k[i] = kv.k[i].new_empty(0)
        kv.v[i] = kv.v[i].new_empty(0)
    return kv


def check_hybrid_serving(cfg: ModelConfig, prefix: str = "off") -> None:
    """What a serving loop may not do with a hybrid model, refused with a ConfigError before anything runs:
    automatic prefix caching (`prefix` == "auto"): a cached KV block says nothing about the recurrent state after
    it, and the state pool keeps a snapshot only at the end of a pinned prefix, so a hit anywhere else would
    continue from the wrong state; refused rather than ever giving a wrong output. A pinned prefix works: its state
    is snapshotted once and copied into each slot whose request starts with it (Runner.pin_prefix). Token
    and chunked prefill both work (a chunk is a ragged run the GDN kernels walk in order), as does continuous
    refill: a slot restarting at position 0 starts from zero state inside the kernels."""
    if not cfg.gdn_layers:
        return
    if prefix == "auto":
        raise ConfigError(f"kv_cache.prefix={prefix}: automatic prefix caching is not supported for the hybrid "
                          f"{cfg.arch} model (its Gated DeltaNet layers keep per-slot recurrent state that cached KV "
                          "blocks do not capture; the state is snapshotted only at a pinned prefix's end): use "
                          "kv_cache.prefix=pinned or off")
