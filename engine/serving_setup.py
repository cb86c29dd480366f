"""What a serving run is made of, for an engine: the KV cache (contiguous, or a paged pool and its block manager),
a hybrid model's recurrent-state pool, the scheduler and the attention workspace, put together for one queue."""
from __future__ import annotations

import math
from dataclasses import dataclass

from onepass.engine.block_manager import BlockManager
from onepass.engine.kv_cache import ContiguousKVCache, PagedKVCache
from onepass.engine.runner import PREFIX_MODES, Runner
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Request, Scheduler, check_token_budget
from onepass.engine.step import BUCKETS
from onepass.kernels.errors import ConfigError

MODES = {"wave": "static", "continuous": "continuous"}   # the job's name -> the scheduler's


def pool_blocks(num_blocks: int, block_size: int, slots: int, ctx: int) -> int:
    """Blocks of a paged pool, the scratch block included: num_blocks as given, or (0) enough for every slot to reach
    ctx at once."""
    return num_blocks or slots * math.ceil(ctx / block_size) + 1


@dataclass
class ServingSetup:
    engine: object                  # onepass.engine.engine.Engine
    mode: str = "continuous"        # continuous | wave
    prefill: str = "token"          # token | chunked
    layout: str = "paged"           # paged | contiguous
    block_size: int = 16
    num_blocks: int = 0             # the paged pool incl. the scratch block; 0: every slot can reach ctx at once
    prefix: str = "off"             # off | pinned | auto
    token_budget: int = 512         # rows per step with chunked prefill
    prefix_burst: bool = True       # token prefill + prefix=auto: a prefix shared by queued requests fed as one chunk
    pool_vs_peak: float = 0.0       # > 0: the pool at this multiple of the peak block demand (a host dry run)
    drafts: object = None           # speculative decoding: a draft source (engine/drafts.py) and its tokens a step
    spec_k: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"scheduler.mode={self.mode!r} for serving; choose wave or continuous")
        if self.layout not in ("contiguous", "paged"):
            raise ConfigError(f"kv_cache.layout={self.layout!r}; choose contiguous or paged")
        if self.prefix not in PREFIX_MODES:
            raise ConfigError(f"kv_cache.prefix={self.prefix!r}; choose one of {', '.join(PREFIX_MODES)}")
        if self.prefix != "off" and self.layout != "paged":
            raise ConfigError(f"kv_cache.prefix={self.prefix} shares prefixes as shared KV blocks: it needs "
                              "kv_cache.layout=paged (kv_cache=paged)")
        check_token_budget(self.prefill, self.token_budget, self.slots)

    @property
    def slots(self) -> int:
        return self.engine.spec.batch

    @property
    def ctx(self) -> int:
        return self.engine.spec.ctx

    @property
    def hybrid(self) -> bool:
        return self.engine.cfg.arch == "qwen35"

    def burst(self) -> int:
        """Rows a shared-prefix burst may add to a token-mode step: up to the largest CUDA-graph bucket."""
        return max(0, BUCKETS[-1] - self.slots) if self.prefix_burst else 0

    def pool_blocks(self) -> int:
        return pool_blocks(self.num_blocks, self.block_size, self.slots, self.ctx)

    def block_manager(self, blocks: int) -> BlockManager:
        """The paged pool's bookkeeping: a hybrid model shares a pinned prefix only whole (its state snapshot)."""
        return BlockManager(blocks, self.block_size, prefix_caching=self.prefix == "auto",
                            whole_pinned=self.hybrid and self.prefix == "pinned")

    def scheduler(self, bm: BlockManager | None, stop_ids: tuple[int, ...]) -> Scheduler:
        return Scheduler(self.slots, MODES[self.mode], self.prefill, self.token_budget, bm, self.ctx, stop_ids,
                         self.burst(), self.drafts, self.spec_k)

    def peak_blocks(self, requests: list[Request], pin: list[int] | None) -> int:
        """Peak block demand of this schedule, from a host-only dry run of the scheduler over an ample pool.
        Sampled tokens are stand-ins (0), so this is exact for fixed-length outputs."""
        bm = self.block_manager(self.slots * (self.ctx // self.block_size + 1) + 2)
        if pin:
            bm.pin_prefix(pin)
        # without drafts: a request's blocks then cover its positions only (drafts may reach k positions further)
        sched = Scheduler(self.slots, MODES[self.mode], self.prefill, self.token_budget, bm, self.ctx, (), self.burst())
        for r in requests:
            sched.add(Request(r.rid, list(r.prompt), r.max_new_tokens))
        while not sched.done:
            plan = sched.schedule()
            sched.finish_step(plan, [0] * sum(s.samples for s in plan.items))
        return bm.peak_used

    def build(self, requests: list[Request], sampling: SamplingParams, sample_on_device: bool,
              stop_ids: tuple[int, ...]) -> tuple[Runner, int]:
        """Caches, pool, scheduler and step for this queue, and the positions of the pinned prefix (prefix=pinned:
        the first request's prompt, its KV filled once here; 0 otherwise)."""
        e, B = self.engine, self.slots
        bm = None
        if self.layout == "paged":
            blocks = self.pool_blocks()
            pin = list(requests[0].prompt) if self.prefix == "pinned" and requests else None
            if self.pool_vs_peak > 0:
                blocks = math.ceil(self.pool_vs_peak * self.peak_blocks(requests, pin)) + 1  # + the scratch block
            bm = self.block_manager(blocks)
            kv = PagedKVCache(e.cfg, blocks, self.block_size, B, self.ctx, e.dtype, e.device)
        else:
            kv = ContiguousKVCache(e.cfg, B + 1, self.ctx, e.dtype, e.device)
        if self.hybrid:   # + each slot's recurrent state; a slot restarting at position 0 starts from zero
            from onepass.engine.state_pool import HybridCache, StatePool, drop_recurrent_kv, snapshot_slots

            M, slots = e.writeback(), kv.num_slots
            if self.prefix == "pinned":   # + spare slots for the pinned prefix's state snapshots (one per phase class)
                slots = max(snapshot_slots(kv.num_slots, M, B)) + 1
            kv = HybridCache(drop_recurrent_kv(kv, e.cfg),
                             StatePool(e.cfg, slots, e.device, e.state_dtype, conv_dtype=e.dtype, writeback=M))
        sched = self.scheduler(bm, stop_ids)
        # every position stays below the longest request's length: the attention grid is sized for it
        longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=kv.ctx)
        max_len = min(kv.ctx, longest)
        serving = Runner(e.model, kv, sched, sampling, sample_on_device,
                         use_graphs=e.spec.cuda_graphs and e.device.type == "cuda", workspace=e.workspace(),
                         max_len=max_len, launch=e.launch)
        pinned = serving.pin_prefix(list(requests[0].prompt)) if self.prefix == "pinned" and requests else 0
        return serving, pinned
