"""Which rows each step computes, over a fixed set of slots.

A request feeds its tokens (prompt, then each sampled token) into its slot's KV positions in order.
`computed` counts positions already written; a step feeds the next rows of some requests, and a
request samples when its last fed row is its newest token, so prefill and decode are one thing.
- mode "static": a wave of requests fills the slots; the next wave waits until every slot is free.
- mode "continuous": a slot freed by a finished request is refilled from the queue the next step.
- prefill "token": one row per running request per step (the seed's way: prompt tokens through the
  decode step); "chunked": decode rows first, then prompt chunks of waiting prefills under a per-step
  token budget.
- shared-prefix burst (token prefill with automatic prefix caching, `prefix_burst` > 0): when the next
  waiting request shares an uncached block-aligned prompt prefix with the one just admitted, that one
  feeds the prefix as one chunk and admission pauses for the step; the next step's requests find the
  prefix's blocks in the cache. The seed's pinned prefix, found from the queue instead of configured.
With a block manager (paged KV) a request is admitted only when blocks for its uncached prompt can be
had; when growth finds the pool empty the youngest other request is preempted (its blocks freed, its
tokens recomputed later; greedy output is unchanged because every row's arithmetic is batch-invariant).

A step's bookkeeping is split in two so the serving loop can prepare step t+1 while step t runs:
`advance(plan)` right after the step is launched (positions written, one sampled token now in flight,
requests that reach their max-gen retired, their slots and blocks freed), and `receive(plan, ids)` once
the sampled ids arrive (appended; a stop token retires its request, and a token computed after that
stop is dropped). A row whose token is still in flight reads it on the device (`Scheduled.feed_device`).
`finish_step` does both at once (the synchronous loop).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from onepass.engine.block_manager import BlockManager
from onepass.kernels.errors import ConfigError

MODES = ("static", "continuous")
PREFILLS = ("token", "chunked")


def check_token_budget(prefill: str, token_budget: int, num_slots: int) -> None:
    """A chunked-prefill step must hold a decode row for every slot."""
    if prefill == "chunked" and token_budget < num_slots:
        raise ConfigError(f"scheduler.token_budget={token_budget} is below the {num_slots} decode rows a step may need "
                          f"(batch.size={num_slots}); set scheduler.token_budget >= {num_slots}")


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    slot: int = -1
    computed: int = 0  # KV positions written
    cached: int = 0  # prompt positions served by shared prefix blocks
    admitted_step: int = -1
    finished_step: int = -1
    preemptions: int = 0
    inflight: int = 0  # sampled tokens launched whose ids the host has not received yet
    retired: bool = False  # slot and blocks given back (max-gen reached or stop token seen)
    burst: int = 0  # prompt positions fed as one chunk on its first step (a shared prefix; see the module doc)
    stopped: bool = False  # a stop token arrived: later in-flight tokens are dropped
    # rows of its last verify step the target kept, which a hybrid model's recurrent state takes in at the request's
    # next step (kernels/gdn.py: speculative verify); handed to that step, then 0
    kept_rows: int = 0
    # open-loop serving (engine/arrivals.py): when it arrived and when each output token reached the host
    # (time.perf_counter seconds); a cancelled request's client went away
    arrival_s: float = 0.0
    token_s: list[float] = field(default_factory=list)
    cancelled: bool = False
    rejection: str = ""   # why the scheduler refused it ("" when it did not)
    ignore_eos: bool = False   # runs to max_new_tokens: the scheduler's stop ids do not end it (a benchmark's request)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        """Tokens of the sequence so far, in-flight ones included."""
        return len(self.prompt) + len(self.output) + self.inflight

    @property
    def pending(self) -> int:
        return self.length - self.computed

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass
class Scheduled:
    request: Request
    rows: int  # tokens fed this step: positions computed .. computed + rows - 1
    samples: bool  # its last row is the newest token: sample the next one
    feed_device: bool = False  # its last row's token is still in flight: read it on the device
    drafts: list[int] = field(default_factory=list)  # fed after the newest token; every row samples (speculation)


@dataclass
class Plan:
    items: list[Scheduled]
    admitted: list[Request]
    repeat: int = 1  # > 1: a lockstep run, every item one decode row a step for this many steps

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.items)


class Scheduler:
    def __init__(self, num_slots: int, mode: str = "continuous", prefill: str = "token", token_budget: int = 512,
                 block_manager: BlockManager | None = None, ctx: int = 512, stop_ids: tuple[int, ...] = (),
                 prefix_burst: int = 0, drafts=None, spec_k: int = 0):
        """prefix_burst: the most prompt rows one shared-prefix burst may feed in a step (token prefill with
        automatic prefix caching only; 0 = off). drafts, spec_k: speculative decoding, a draft source
        (engine/drafts.py) asked for up to spec_k tokens after each decoding request's newest token."""
        if mode not in MODES:
            raise ConfigError(f"scheduler.mode={mode!r}; choose one of {MODES}")
        if prefill not in PREFILLS:
            raise ConfigError(f"scheduler.prefill={prefill!r} for serving; choose one of {PREFILLS}")
        check_token_budget(prefill, token_budget, num_slots)
        if (drafts is None) != (spec_k == 0):
            raise ConfigError(f"speculative decoding needs a draft source and spec_k >= 1 (got spec_k={spec_k} "
                              f"and {'no' if drafts is None else 'a'} draft source); set speculative.k >= 1 with a "
                              "method, or speculative=off")
        if spec_k < 0 or spec_k >= ctx:
            raise ConfigError(f"speculative decoding with spec_k={spec_k} drafts a step: between 1 and the context "
                              f"({ctx}) less one; lower speculative.k")
        self.drafts, self.spec_k = drafts, spec_k
        self.drafted = self.accepted = 0   # draft tokens proposed and kept, over the run
        self.num_slots, self.mode, self.prefill, self.budget = num_slots, mode, prefill, token_budget
        self.bm, self.ctx, self.stop_ids = block_manager, ctx, set(stop_ids)
        bursts = prefill == "token" and block_manager is not None and block_manager.prefix_caching
        self.max_burst = prefix_burst // block_manager.block_size * block_manager.block_size if bursts else 0
        self._wave_forming = False
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.finished: list[Request] = []
        self.rejected: list[tuple[Request, str]] = []
        self.step = 0
        self.dirty_tables: dict[int, list[int]] = {}  # slot -> block table to upload before the step

    # -- requests in ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        need = len(req.prompt) + req.max_new_tokens - 1  # the last sampled token is never fed
        if need > self.ctx:
            self._reject(req, f"needs {need} KV positions, the per-slot context is {self.ctx}")
        elif self.bm is not None and self.bm.blocks_for(need) > self.bm.num_blocks - 1:
            self._reject(req, f"needs {self.bm.blocks_for(need)} KV blocks of {self.bm.block_size} positions, "
                              f"the pool has {self.bm.num_blocks - 1}; raise kv_cache.num_blocks")
        else:
            self.waiting.append(req)

    def cancel(self, req: Request) -> None:
        """The request's client went away: its slot and blocks are given back now, as a stop token would (a token
        still in flight for it is dropped when it arrives, and then it counts as finished)."""
        if req.retired or req.finished_step >= 0 or any(r is req for r, _ in self.rejected):
            return
        req.cancelled = req.stopped = True
        self._retire(req)
        if not req.inflight:
            req.finished_step = self.step
            self.finished.append(req)

    def _reject(self, req: Request, why: str) -> None:
        req.rejection = f"request {req.rid} rejected: {why}"
        self.rejected.append((req, req.rejection))

    @property
    def max_rows(self) -> int:
        """The most rows one step may hold."""
        return self.num_slots * (1 + self.spec_k) + self.max_burst if self.prefill == "token" else self.budget

    @property
    def max_samples(self) -> int:
        """The most rows one step may sample: one a slot, or with speculation one per fed token of a slot."""
        return self.num_slots * (1 + self.spec_k)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self, lockstep: int = 1) -> Plan:
        """The next step's rows; with lockstep > 1, up to that many steps at once where every running request just
        decodes and nothing can change between them (no request to admit, no KV block to find)."""
        admitted = self._admit()
        items: list[Scheduled] = []
        budget = self.budget if self.prefill == "chunked" else None
        order = sorted(self.running.values(), key=lambda r: (r.in_prefill, r.admitted_step, r.rid))
        for req in order:
            if req.slot < 0:  # preempted earlier in this loop
                continue
            if self.prefill == "token":
                rows = req.burst - req.computed if req.burst > req.computed else 1
            else:
                rows = min(req.pending, budget)
            if rows <= 0:
                continue
            drafts = self._drafts(req, rows, budget)
            if not self._grow(req, req.computed + rows + len(drafts)):
                continue
            if budget is not None:
                budget -= rows + len(drafts)
            last = req.computed + rows
            items.append(Scheduled(req, rows + len(drafts), last == req.length,
                                   last > len(req.prompt) + len(req.output), drafts))
        items = [s for s in items if s.request.slot >= 0]  # drop any preempted while growing others
        return Plan(items, admitted, self._repeat(items, admitted, lockstep))

    def _drafts(self, req: Request, rows: int, budget: int | None) -> list[int]:
        """Draft tokens to feed after a decoding request's newest token (it is on the host: speculation runs the
        loop in step with the host), at most as many as it may still generate past that token's successor."""
        if not self.spec_k or rows != 1 or req.in_prefill or req.inflight or req.pending != 1:
            return []
        room = budget - 1 if budget is not None else self.spec_k    # chunked prefill: the step's rows left
        k = min(self.spec_k, req.max_new_tokens - len(req.output) - 1, room)
        return list(self.drafts(req, k))[:k] if k > 0 else []

    def _repeat(self, items: list[Scheduled], admitted: list[Request], most: int) -> int:
        """Steps the plan's decode rows can run in lockstep: every running request decodes one row, its token on
        the device, and none could be joined by an admitted one or need a block before the run ends."""
        if most <= 1 or admitted or self.bm is not None or (self.waiting and self.mode != "static"):
            return 1
        if len(items) != len(self.running):
            return 1
        n = most
        for s in items:
            req = s.request
            if s.rows != 1 or not s.samples or req.in_prefill:
                return 1
            n = min(n, req.max_new_tokens - len(req.output) - req.inflight)
        return max(n, 1)

    def _admit(self) -> list[Request]:
        wave_forming, self._wave_forming = self._wave_forming, False
        if self.mode == "static" and self.running and not wave_forming:
            return []
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.inflight:  # preempted with a token in flight: readmit once it has arrived
                break
            if self.bm is not None:
                if not self.bm.can_allocate(req.tokens):
                    break  # admission control: wait for blocks
                req.cached = self.bm.allocate(req.rid, req.tokens)
                req.computed = req.cached
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.admitted_step = self.step
            self.running[req.slot] = req
            if self.bm is not None:
                self.dirty_tables[req.slot] = self.bm.table(req.rid)
            admitted.append(req)
            if self._start_burst(req):
                self._wave_forming = True  # a static wave keeps filling at the next step
                break  # the others wait a step for the prefix's blocks
        return admitted

    def _start_burst(self, req: Request) -> bool:
        """Make req feed its uncached block-aligned prompt prefix in one chunk when the next waiting
        request shares it (the last prompt token is always left to the normal path)."""
        req.burst = 0
        if not self.max_burst or not self.waiting or req.output:
            return False
        bs = self.bm.block_size
        end = min((len(req.prompt) - 1) // bs * bs, req.cached + self.max_burst)
        if end <= req.cached or self.waiting[0].prompt[:end] != req.prompt[:end]:
            return False
        req.burst = end
        return True

    def _grow(self, req: Request, new_len: int) -> bool:
        """Make the request's blocks cover new_len positions, preempting the youngest others if needed."""
        if self.bm is None:
            return True
        while (added := self.bm.grow(req.rid, new_len)) < 0:
            victims = [r for r in self.running.values() if r is not req]
            if not victims:
                raise ConfigError(f"request {req.rid} cannot grow to {new_len} positions even alone: "
                                  f"the KV pool of {self.bm.num_blocks - 1} blocks is too small")
            self._preempt(max(victims, key=lambda r: (r.admitted_step, r.rid)))
        if added:  # the slot's table row changes
            self.dirty_tables[req.slot] = self.bm.table(req.rid)
        return True

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.rid)
        del self.running[req.slot]
        self.free_slots.append(req.slot)
        req.slot, req.computed, req.cached, req.kept_rows = -1, 0, 0, 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def advance(self, plan: Plan) -> None:
        """The step is launched: its rows' positions are written; each sampling row puts one token in
        flight. A request whose max-gen is now reached is retired at once (its last token still in flight),
        so the next step can reuse its slot."""
        n = plan.repeat
        for s in plan.items:
            req = s.request
            req.kept_rows = 0    # the step launched with them
            if req.retired:  # a stop token arrived after this step was launched
                continue
            if s.drafts:   # speculation: how far the positions count as written is known when the tokens arrive
                req.inflight += 1
                continue
            req.computed += s.rows * n
            self._written(req)
            if s.samples:
                req.inflight += n
                if len(req.output) + req.inflight >= req.max_new_tokens:
                    self._retire(req)
        self.step += n

    def _written(self, req: Request) -> None:
        """Tell the block manager how far the request's KV is written (a block it fills is committed to the cache)."""
        if self.bm is not None:
            if self.bm.commit_needs_tokens(req.rid, req.computed):
                self.bm.commit(req.rid, req.tokens, req.computed)
            else:  # no block filled: skip building the token list (the common step)
                self.bm.mark_written(req.rid, req.computed)

    def receive(self, plan: Plan, sampled: list[int]) -> list[Request]:
        """The sampled ids of `plan`, in plan order (step by step for a lockstep run; every row of a request with
        drafts); returns the requests that completed."""
        it = iter(sampled)
        done = []
        for s in plan.items * plan.repeat:
            if not s.samples:
                continue
            req = s.request
            if s.drafts:
                self._settle(req, s.drafts, [next(it) for _ in range(len(s.drafts) + 1)])
            else:
                req.inflight -= 1
                self._append(req, next(it))
            if req.retired and not req.inflight and req.finished_step < 0:
                req.finished_step = self.step - 1
                self.finished.append(req)
                done.append(req)
        return done

    def _append(self, req: Request, tok: int) -> None:
        if req.stopped:   # a token computed after the stop token: dropped
            return
        req.output.append(tok)
        if tok in self.stop_ids and not req.ignore_eos:
            req.stopped = True
            if not req.retired:
                self._retire(req)

    def _settle(self, req: Request, drafts: list[int], target: list[int]) -> None:
        """A speculative row set's outcome: target[i] is the token the target sampled after the newest token and
        drafts[:i]; the drafts are kept while they equal it, then the target's own token follows. Only the fed
        positions of kept tokens count as written."""
        if req.retired:   # as in advance, which put nothing in flight for it
            return
        req.inflight -= 1
        kept = next((i for i, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
        self.drafted += len(drafts)
        self.accepted += kept
        req.computed += 1 + kept       # the newest token and the kept drafts are in the KV now
        req.kept_rows = 1 + kept       # and in a hybrid model's recurrent state once its next step folds them in
        for tok in target[:kept + 1]:
            self._append(req, tok)
            if req.stopped:            # retired: its blocks are free already
                return
        if len(req.output) >= req.max_new_tokens:
            self._retire(req)
        else:
            self._written(req)         # after the tokens: a block it fills is hashed from them

    def finish_step(self, plan: Plan, sampled: list[int]) -> list[Request]:
        """Both halves of a step at once: advance every scheduled request, then take its sampled ids."""
        self.advance(plan)
        return self.receive(plan, sampled)

    def _retire(self, req: Request) -> None:
        req.retired = True
        if self.drafts is not None:
            self.drafts.forget(req.rid)
        if req.slot < 0:  # preempted and waiting when its stop token arrived
            self.waiting.remove(req)
            return
        if self.bm is not None:
            self.bm.free(req.rid)
        del self.running[req.slot]
        self.free_slots.append(req.slot)
