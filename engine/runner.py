"""The one step driver: requests in, outputs out, one `Step` (engine/step.py) per scheduler step, for every
scheduler mode. A static batch is the scheduler's static mode (`run_static`); a single stream is a static batch of
one.

Each step the scheduler picks rows (token, slot, position) and the step runs them; logits are computed only for
rows that sample, and only the sampled ids (or, in the seed's host-sampling mode, the sampling rows' logits) cross to
the host. Where every running slot just decodes (a static batch after its prefill, or the queue's tail), the
scheduler plans a lockstep run of several steps, which the step replays without the host in between.

With on-device sampling the loop runs one step ahead of the host: step t+1 is scheduled and launched before step
t's ids are read, its decode rows reading step t's tokens on the device, so the host's bookkeeping (scheduling,
block tables, appending outputs) overlaps the GPU's work instead of stalling it. Host sampling needs every token on
the host before the next step, so that mode runs in lockstep with the host.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Plan, Request, Scheduler
from onepass.engine.state_pool import check_hybrid_serving, snapshot_slots
from onepass.engine.step import LOCKSTEP_MAX, Step, bucket_for
from onepass.kernels.errors import ConfigError

PREFIX_MODES = ("off", "pinned", "auto")
PREFILL_MODES = ("token", "batched")   # a static batch's prefill: the seed's token by token, or all prompts at once


@dataclass
class ServeResult:
    finished: list[Request]
    rejected: list[tuple[Request, str]]
    steps: int = 0
    wall_s: float = 0.0
    rows: int = 0  # token rows computed (prompt + fed outputs)
    prefill_rows: int = 0  # of which prompt positions
    active_slot_steps: int = 0
    host_s: list[float] = field(default_factory=list)  # host time per loop turn: all but waiting for the device
    step_s: list[float] = field(default_factory=list)  # each step's span on the device timeline (engine/step.py)
    d2h_bytes: int = 0
    pinned_prefix: int = 0
    drafted: int = 0   # speculation: draft tokens proposed, and kept
    accepted: int = 0
    on_gpu: bool = False

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.finished)

    @property
    def gpu_ms(self) -> list[float]:
        """Device time per step (CUDA events); empty on the CPU."""
        return [s * 1e3 for s in self.step_s] if self.on_gpu else []


class Runner:
    def __init__(self, model, kv, scheduler: Scheduler, sampling: SamplingParams, sample_on_device: bool = True,
                 use_graphs: bool | None = None, workspace=None, max_len: int | None = None,
                 buckets: tuple[int, ...] | None = None, max_rows: int | None = None, launch=None):
        """Steps run as CUDA graphs on a GPU unless use_graphs=False. `workspace(rows, n)` makes the decode
        attention's split buffers; `max_len` bounds every position (default: the cache's ctx); `buckets`: the row
        buckets whose graphs are captured (default: every one a step of this scheduler may use); `max_rows`: the
        rows of the step's own buffers (default: the scheduler's largest step; a larger step runs eagerly on
        buffers of its own); `launch`: the kernels' LaunchPolicy (kernels/pdl.py; default: the one in force)."""
        self.model, self.kv, self.sched, self.sampling = model, kv, scheduler, sampling
        self.sample_on_device = sample_on_device
        self.paged = hasattr(kv, "block_table")
        self.device = model.device
        if not sample_on_device and not sampling.greedy:
            raise ConfigError("host sampling (sampling.on_device=false) is the seed's greedy baseline: it argmaxes "
                              "the logits on the host; use sampling.on_device=true for temperature sampling")
        self.hybrid = bool(getattr(model, "hybrid", False))
        # a cached KV block carries no recurrent state: refused here too, for callers past the harness
        if self.hybrid:
            check_hybrid_serving(model.cfg,
                                 "auto" if scheduler.bm is not None and scheduler.bm.prefix_caching else "off")
            if scheduler.spec_k:   # a verify run's rows wait in the draft logs until the target has kept some
                kv.state.reserve_drafts(scheduler.spec_k + 1)
        # hybrid pinned prefix: (the spare state slot holding its snapshot for each write-back phase class, positions)
        self.snapshot: tuple[list[int], int] | None = None
        graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # a hybrid model's chunked prefill and verify runs put several rows of one slot in a step: its GDN layers take
        # them as runs
        spec = self.hybrid and scheduler.spec_k > 0
        ragged = self.hybrid and (scheduler.prefill == "chunked" or spec)
        self.step = Step(model, kv, scheduler.num_slots, max_rows or scheduler.max_rows, sampling, paged=self.paged,
                         use_graphs=graphs, sample_on_device=sample_on_device, workspace=workspace, max_len=max_len,
                         ragged=ragged, buckets=buckets, launch=launch, max_samples=scheduler.max_samples,
                         speculative=spec)
        # a draft source that reads the target's hidden states (the MTP head, engine/mtp_drafts.py) is bound to this
        # model and these slots, and shown every step's rows once their tokens are known
        self.watcher = scheduler.drafts if hasattr(scheduler.drafts, "observe") else None
        if self.watcher is not None:
            self.watcher.bind(model, kv.num_slots, kv.ctx, scheduler.spec_k, max_len=self.step.max_len,
                              hidden=self.step.buf["residual"] if graphs else None, policy=self.step.policy)
        self.fed: list[tuple[Request, int, int]] = []      # the last launch's (request, first row, first position)
        # host sampling reads every step's logits, and drafts need every step's tokens: both keep step with the host
        self.host_steps = not sample_on_device or scheduler.spec_k > 0
        self.lockstep = 1 if self.host_steps else LOCKSTEP_MAX
        self.marks: list[tuple[str, object]] = []           # the last run's timeline (Step.mark)

    def pin_prefix(self, tokens: list[int]) -> int:
        """The seed's prefix mode: fill the block-aligned shared prefix's KV once into pinned blocks."""
        bm = self.sched.bm
        if bm is None:
            raise ConfigError("prefix caching needs the paged KV cache (kv_cache.layout=paged)")
        if self.sched.running:
            raise ConfigError("pin_prefix must run before requests are served")
        spares: list[int] = []
        if self.hybrid:
            # the prefix's recurrent state is snapshotted into spare state slots, one per write-back phase class
            # the scheduler's slots fall in, and shared only whole (whole_pinned)
            pool = self.kv.state
            spares = snapshot_slots(self.kv.num_slots, pool.writeback, self.sched.num_slots)
            if not bm.whole_pinned:
                raise ConfigError("a hybrid model's pinned prefix needs BlockManager(whole_pinned=True): its state "
                                  "is snapshotted at the prefix's end only, so the prefix is shared whole or not at "
                                  "all")
            if pool.num_slots <= max(spares):
                raise ConfigError(f"a hybrid model's pinned prefix needs a state pool of {max(spares) + 1} slots (the "
                                  f"KV cache's {self.kv.num_slots} + the prefix's state snapshots, one per write-back "
                                  f"phase class: engine.state_pool.snapshot_slots); this one has {pool.num_slots}")
            if self.snapshot is not None:
                raise ConfigError("a hybrid model keeps one pinned prefix (one state snapshot); it is pinned already")
        blocks = bm.pin_prefix(tokens)
        n = len(blocks) * bm.block_size
        if n == 0:
            return 0
        # through the first slots (no request holds a slot yet), their tables pointing at the pinned blocks; the rows
        # that pad a step to its bucket write the scratch slot, never a pinned block. A dense model's prefix goes
        # through slot 0, a step's rows at a time. A hybrid model's recurrence takes one row of a slot a step (outside
        # ragged chunked prefill), so its prefix goes in token by token, through one slot of each phase class at once
        # (they write the same KV into the pinned blocks)
        st = self.step
        if self.hybrid:
            slots = list(range(len(spares)))
            rows = []   # the trunk's hidden rows of the prefix, for a draft head that keeps its own KV of it
            for p in range(n):
                st.ids(st.launch([tokens[p]] * len(slots), [p] * len(slots), slots, [0] * len(slots), [], [],
                                 tables={s: blocks for s in slots}))
                if self.watcher is not None:
                    rows.append(st.last_hidden[0].clone())
            if self.watcher is not None:
                self.watcher.pin(tokens[:n], torch.stack(rows))
        else:
            slots = [0]
            for lo in range(0, n, st.rows):
                hi = min(n, lo + st.rows)
                st.ids(st.launch(tokens[lo:hi], range(lo, hi), [0] * (hi - lo), [0] * (hi - lo), [], [],
                                 tables={0: blocks}))
        st.ids(st.launch([], [], [], [], [], [], tables={s: [] for s in slots}))
        if self.hybrid:
            for slot, spare in zip(slots, spares):
                self.kv.state.copy_slot(slot, spare)
            self.snapshot = (spares, n)
        return n

    def run(self, requests: list[Request], progress: bool = False, arrivals=None,
            pause_gc: bool = True) -> ServeResult:
        """Serve `requests` (queued at the start) and, with an arrival source (engine/arrivals.py), the requests it
        hands over while the loop runs, until the source is exhausted and every request has finished. pause_gc=False
        leaves the garbage collector on: a server's loop runs for hours beside threads that do make cycles."""
        if not pause_gc:
            return self._run(requests, progress, arrivals)
        # the cyclic garbage collector stalls the loop for milliseconds at random steps, long against a decode
        # step (why: harness/PROBES.md, "the serving loop: gc"); the run allocates no long-lived cycles, so it is off
        gc.collect()
        gc.disable()
        try:
            return self._run(requests, progress, arrivals)
        finally:
            gc.enable()

    def _run(self, requests: list[Request], progress: bool, arrivals) -> ServeResult:
        sched, st = self.sched, self.step
        for r in requests:
            sched.add(r)
        res = ServeResult(sched.finished, sched.rejected)
        bar = tqdm(total=len(requests), desc="requests", disable=not progress, leave=False)
        host_lockstep = self.host_steps
        prev = None  # (plan, handle) of the step whose ids are not read yet
        first_mark = len(st.marks)
        st.mark("start")
        t_start = time.perf_counter()
        while not sched.done or prev is not None or (arrivals is not None and not arrivals.exhausted):
            t0, wait = time.perf_counter(), 0.0
            plan = handle = None
            if arrivals is not None:
                self._arrive(arrivals, t0, bar)
                if sched.done and prev is None:   # nothing to run: sleep until a request is due
                    arrivals.wait()
                    continue
            if not sched.done:
                # a lockstep run would keep requests that arrive during it waiting: one step a turn until the last
                lockstep = self.lockstep if arrivals is None or arrivals.exhausted else 1
                plan = sched.schedule(lockstep)
                if self.snapshot is not None:
                    self._restore(plan.admitted)
                if not plan.items:
                    if prev is None:
                        raise ConfigError(f"no request can run: {len(sched.waiting)} waiting, none admitted; "
                                          f"the KV pool is too small for the next request's prompt")
                    plan = None  # waiting for the previous step's ids (a preempted request's token)
                else:
                    handle, prompt_rows = self._lockstep(plan) if plan.repeat > 1 else self._launch(plan)
                    res.steps += plan.repeat
                    res.rows += plan.num_rows * plan.repeat
                    res.active_slot_steps += len(plan.items) * plan.repeat
                    res.prefill_rows += prompt_rows
                    res.d2h_bytes += st.d2h_bytes(handle.n_samples)
            if host_lockstep and plan is not None:
                sched.advance(plan)
                prev, plan = (plan, handle), None
            if prev is not None:
                t_wait = time.perf_counter()
                ids = st.ids(prev[1])
                wait = time.perf_counter() - t_wait
                done = sched.receive(prev[0], ids)
                if self.watcher is not None:   # host steps: prev is the step just launched, its rows still in place
                    self.watcher.observe(self.fed, st.last_hidden)
                if arrivals is not None:
                    arrivals.emit(stamp(prev[0], time.perf_counter()), done)
                bar.update(len(done))
            if plan is not None:
                sched.advance(plan)
            prev = (plan, handle) if plan is not None else None
            res.host_s.append(time.perf_counter() - t0 - wait)  # everything but waiting for the device
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        res.wall_s = time.perf_counter() - t_start
        res.drafted, res.accepted, res.on_gpu = sched.drafted, sched.accepted, self.device.type == "cuda"
        self.marks = st.marks[first_mark:]
        res.step_s = step_spans(st.clock, self.marks)
        bar.close()
        return res

    def _arrive(self, arrivals, now: float, bar) -> None:
        """The requests that arrived since the last turn join the queue (a request that cannot fit is rejected and
        handed back finished); those whose client went away leave it."""
        sched = self.sched
        for req in arrivals.poll(now):
            rejected = len(sched.rejected)
            sched.add(req)
            bar.total += 1
            if len(sched.rejected) > rejected:
                arrivals.emit([], [req])
        gone = [r for r in arrivals.cancelled() if not r.retired]
        for req in gone:
            sched.cancel(req)
        if gone:
            arrivals.emit([], [r for r in gone if r.finished_step >= 0])

    def _restore(self, admitted: list[Request]) -> None:
        """Give each admitted request that shares the pinned prefix the prefix's recurrent state: its rows start
        at the prefix's end, where the snapshot was taken (the block manager shares the prefix whole or not at
        all, so that is the only shared length)."""
        spares, n = self.snapshot
        pool = self.kv.state
        for req in admitted:
            if req.cached:
                if req.cached != n:
                    raise RuntimeError(f"request {req.rid} shares {req.cached} prefix positions; the state snapshot "
                                       f"holds {n}")
                pool.copy_slot(spares[pool.phase_class(req.slot)], req.slot)
                if self.watcher is not None:
                    self.watcher.restore(req)

    def _sampling_of(self, req: Request) -> tuple[int, int]:
        """(seed, step) of the request's next sampled token: its own seed, so a request draws the same numbers
        whichever slot and batch it runs in."""
        return self.sampling.seed * 1_000_003 + req.rid, len(req.output) + req.inflight

    def _lockstep(self, plan: Plan):
        """Queue plan.repeat lockstep steps over the plan's decode rows (staged again only when they changed)."""
        st, items = self.step, plan.items
        key = tuple(s.request.slot for s in items)
        if key != st.locked:
            seeds, steps = zip(*(self._sampling_of(s.request) for s in items))
            greedy = self.sampling.greedy
            st.stage_lockstep(key, [s.request.computed for s in items], None if greedy else seeds,
                              None if greedy else steps)
        return st.lockstep(plan.repeat), 0

    def _launch(self, plan: Plan):
        """Queue the plan's step; returns its handle and the number of prompt positions among its rows."""
        tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps = [], [], [], [], [], [], [], []
        kept, verify = [], []
        spec = self.step.speculative
        prompt_rows = 0
        self.fed = []
        for s in plan.items:
            req = s.request
            start, n_prompt = req.computed, len(req.prompt)
            prompt_rows += max(0, min(start + s.rows, n_prompt) - start)
            self.fed.append((req, len(tokens), start))
            if spec:   # read at the run's first row: the slot's kept verify rows (none at position 0), a verify run
                kept += [req.kept_rows if start else 0] * s.rows
                verify += [int(bool(s.drafts))] * s.rows
            if s.drafts:   # the newest token (on the host), then the drafts; every row samples
                seed, step = self._sampling_of(req)
                for i, tok in enumerate([req.output[start - n_prompt]] + s.drafts):
                    tokens.append(tok)
                    positions.append(start + i)
                    slots.append(req.slot)
                    feed.append(0)
                    sample_rows.append(len(tokens) - 1)
                    sample_slots.append(req.slot)
                    seeds.append(seed)
                    steps.append(step + i)
                continue
            if s.rows == 1:  # token mode and decode rows: the common case, without the inner loop
                p = start
                tokens.append(req.prompt[p] if p < n_prompt else
                              req.output[p - n_prompt] if p - n_prompt < len(req.output) else 0)
                positions.append(start)
                slots.append(req.slot)
                feed.append(int(s.feed_device))
            else:
                for p in range(start, start + s.rows):
                    if p < n_prompt:
                        tokens.append(req.prompt[p])
                    elif p - n_prompt < len(req.output):
                        tokens.append(req.output[p - n_prompt])
                    else:
                        tokens.append(0)  # in flight: read on the device
                positions.extend(range(start, start + s.rows))
                slots.extend([req.slot] * s.rows)
                feed.extend([0] * (s.rows - 1) + [int(s.feed_device)])
            if s.samples:
                sample_rows.append(len(tokens) - 1)
                sample_slots.append(req.slot)
                seed, step = self._sampling_of(req)
                seeds.append(seed)
                steps.append(step)
        tables = None
        if self.paged:
            tables, self.sched.dirty_tables = self.sched.dirty_tables, {}
        greedy = self.sampling.greedy
        handle = self.step.launch(tokens, positions, slots, feed, sample_rows, sample_slots,
                                  None if greedy else seeds, None if greedy else steps, tables,
                                  *((kept, verify) if spec else ()))
        return handle, prompt_rows


def stamp(plan: Plan, now: float) -> list[Request]:
    """Time-stamp the output tokens the plan's requests just received; returns the requests that got some."""
    grown = []
    for s in plan.items:
        req = s.request
        if len(req.token_s) < len(req.output):
            req.token_s += [now] * (len(req.output) - len(req.token_s))
            grown.append(req)
    return grown


def step_spans(clock, marks: list[tuple[str, object]]) -> list[float]:
    """Each step's span on the device timeline: from the mark before it to its own (idle time before it
    included, as a reader of tokens per second would count it)."""
    return [clock.seconds(a, b) for (_, a), (kind, b) in zip(marks, marks[1:]) if kind in ("rows", "lock")]


# -- a static batch ---------------------------------------------------------------------------------------

@dataclass
class StaticBatchResult:
    prompts: list[list[int]]
    outputs: list[list[int]]  # generated ids per slot, stop token included, nothing after it
    prefill_s: float          # until every slot's first token (the prefill's)
    step_s: list[float] = field(default_factory=list)  # span of each decode step (forward + sample)
    decode_s: float = 0.0     # from the prefill's end to the last step's
    cache: object = None      # the KV cache (and recurrent state) the batch ran in
    drafted: int = 0          # speculation: draft tokens proposed, and kept
    accepted: int = 0
    logits_finite: bool = True  # every slot's logits at its last step (a NaN or Inf upstream reaches them)

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps (the first token of each slot comes from prefill)."""
        return sum(max(len(o) - 1, 0) for o in self.outputs)


def check_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: a request generates at least one token (the prefill's); "
                          "set workload.max_new_tokens >= 1")


def check_fits(prompt_len: int, max_new_tokens: int, ctx: int) -> int:
    """The KV positions a request of this length needs, refused when that is more than ctx."""
    if prompt_len < 1:
        raise ConfigError("empty prompt: a request needs at least one prompt token")
    check_new_tokens(max_new_tokens)
    need = prompt_len + max_new_tokens - 1  # the last sampled token is never fed back
    if need > ctx:
        raise ConfigError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens needs {need} KV positions, "
            f"but kv_cache.ctx={ctx}; raise kv_cache.ctx or shorten the prompt / workload.max_new_tokens")
    return need


def run_static(model, kv, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
               stop_ids: tuple[int, ...] = (), prefill: str = "batched", *, use_graphs: bool | None = None,
               workspace=None, max_len: int | None = None, launch=None, drafts=None, spec_k: int = 0,
               progress: bool = False) -> StaticBatchResult:
    """B = len(prompts) requests of one prompt length started together in slots 0..B-1 of `kv` (which holds a
    scratch slot beyond them), run to max_new_tokens or a stop token each: the scheduler's static mode. Prefill
    "token" feeds the prompts through the decode step a token a step (the seed's way); "batched" feeds all of
    them in one step. Request b samples as a request of id b does in any other run. drafts, spec_k: speculative
    decoding (engine/drafts.py): up to spec_k draft tokens a slot, checked in each step."""
    if prefill not in PREFILL_MODES:
        raise ConfigError(f"unknown prefill mode {prefill!r}; choose one of {PREFILL_MODES}")
    B, P = len(prompts), len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ConfigError("static batching needs prompts of equal length; use the continuous scheduler for ragged "
                          "prompts")
    check_fits(P, max_new_tokens, kv.ctx)
    sampling = sampling or SamplingParams()
    batched = prefill == "batched"
    budget = max(B * P, B * (1 + spec_k)) if batched else B
    sched = Scheduler(B, "static", "chunked" if batched else "token", budget, None, kv.ctx, stop_ids, drafts=drafts,
                      spec_k=spec_k)
    # graphs and buffers for the steps this batch takes: the lockstep step, and B rows a step in token prefill (every
    # bucket up to B (1 + k) rows with speculation, whose steps vary); the batched prefill runs once, eagerly
    buckets = None if spec_k else () if batched else (bucket_for(B),)
    runner = Runner(model, kv, sched, sampling, use_graphs=use_graphs, workspace=workspace, max_len=max_len,
                    buckets=buckets, max_rows=B * (1 + spec_k), launch=launch)
    requests = [Request(b, list(p), max_new_tokens) for b, p in enumerate(prompts)]
    res = runner.run(requests, progress)
    if res.rejected:
        raise ConfigError(res.rejected[0][1])
    marks, clock = runner.marks, runner.step.clock
    # the prefill is the first step (batched) or the first P (token); every step after it decodes
    prefill_end = [i for i, (kind, _) in enumerate(marks) if kind == "rows"][(1 if batched else P) - 1]
    steps = step_spans(clock, marks[prefill_end:])
    return StaticBatchResult(
        prompts, [r.output for r in sorted(res.finished, key=lambda r: r.rid)],
        clock.seconds(marks[0][1], marks[prefill_end][1]), steps,
        clock.seconds(marks[prefill_end][1], marks[-1][1]) if len(marks) > prefill_end + 1 else 0.0, kv,
        res.drafted, res.accepted, bool(torch.isfinite(runner.step.logits[:B]).all()))
