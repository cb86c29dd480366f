"""Serving loop: requests in, completed outputs out, one fused decode step per scheduler step.

Each step the scheduler picks rows (token, slot, position); the fused decoder runs them over the
contiguous or paged KV (engine/row_step.py); logits are computed only for rows that sample; only the
sampled ids (or, in the seed's host-sampling mode, the sampling rows' logits) cross to the host.

With on-device sampling the loop runs one step ahead of the host: step t+1 is scheduled and launched
before step t's ids are read, its decode rows reading step t's tokens on the device, so the host's
bookkeeping (scheduling, block tables, appending outputs) overlaps the GPU's work instead of stalling it.
Host sampling needs every token on the host before the next step, so that mode runs in lockstep.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from onepass.kernels.errors import ConfigError
from onepass.engine.row_step import RowStep
from onepass.engine.sampler import SamplingParams
from onepass.engine.scheduler import Plan, Request, Scheduler
from onepass.engine.state_pool import check_hybrid_serving, snapshot_slots

PREFIX_MODES = ("off", "pinned", "auto")


@dataclass
class ServeResult:
    finished: list[Request]
    rejected: list[tuple[Request, str]]
    steps: int = 0
    wall_s: float = 0.0
    rows: int = 0  # token rows computed (prompt + fed outputs)
    prefill_rows: int = 0  # of which prompt positions
    active_slot_steps: int = 0
    host_s: list[float] = field(default_factory=list)  # host time per step: all but waiting for the device
    gpu_ms: list[float] = field(default_factory=list)  # device time per step (CUDA events), when timed
    d2h_bytes: int = 0
    pinned_prefix: int = 0

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.finished)


class ServingEngine:
    def __init__(self, model, kv, scheduler: Scheduler, sampling: SamplingParams, sample_on_device: bool = True,
                 use_graphs: bool | None = None, attn_workspace: dict | None = None, max_len: int | None = None,
                 time_steps: bool = False):
        """Steps run as CUDA graphs on a GPU unless use_graphs=False. `max_len` bounds every position
        (default: the cache's ctx); `time_steps` records each step's device time with CUDA events."""
        self.model, self.kv, self.sched, self.sampling = model, kv, scheduler, sampling
        self.sample_on_device = sample_on_device
        self.paged = hasattr(kv, "block_table")
        self.device = model.device
        self.scratch = kv.num_slots - 1
        if scheduler.num_slots > self.scratch:
            raise ConfigError(f"{scheduler.num_slots} slots but the KV cache holds {self.scratch} (+ scratch)")
        if not sample_on_device and not sampling.greedy:
            raise ConfigError("host sampling (sampling.on_device=false) is the seed's greedy baseline: it argmaxes "
                              "the logits on the host; use sampling.on_device=true for temperature sampling")
        self.hybrid = bool(getattr(model, "hybrid", False))
        # a cached KV block carries no recurrent state: refused here too, for callers past the harness
        if self.hybrid:
            check_hybrid_serving(model.cfg,
                                 "auto" if scheduler.bm is not None and scheduler.bm.prefix_caching else "off")
        # hybrid pinned prefix: (the spare state slot holding its snapshot for each write-back phase class, positions)
        self.snapshot: tuple[list[int], int] | None = None
        graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # a hybrid model's chunked prefill puts several rows of one slot in a step: its GDN layers take them as runs
        ragged = self.hybrid and scheduler.prefill == "chunked"
        self.step = RowStep(model, kv, scheduler.num_slots, scheduler.max_rows, self.scratch, self.paged, sampling,
                            graphs, sample_on_device, attn_workspace, max_len, time_steps, ragged=ragged)

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
            for p in range(n):
                st.ids(st.launch([tokens[p]] * len(slots), [p] * len(slots), slots, [0] * len(slots), [], [],
                                 tables={s: blocks for s in slots}))
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

    def run(self, requests: list[Request], progress: bool = False) -> ServeResult:
        # the cyclic garbage collector stalls the loop for milliseconds at random steps, long against a decode
        # step (why: harness/PROBES.md, engine/serve.py: gc); the run allocates no long-lived cycles, so it is off
        gc.collect()
        gc.disable()
        try:
            return self._run(requests, progress)
        finally:
            gc.enable()

    def _run(self, requests: list[Request], progress: bool) -> ServeResult:
        sched, st = self.sched, self.step
        for r in requests:
            sched.add(r)
        res = ServeResult(sched.finished, sched.rejected)
        bar = tqdm(total=len(requests), desc="requests", disable=not progress, leave=False)
        lockstep = not self.sample_on_device
        prev = None  # (plan, handle) of the step whose ids are not read yet
        t_start = time.perf_counter()
        while not sched.done or prev is not None:
            t0, wait = time.perf_counter(), 0.0
            plan = handle = None
            if not sched.done:
                plan = sched.schedule()
                if self.snapshot is not None:
                    self._restore(plan.admitted)
                if not plan.items:
                    if prev is None:
                        raise ConfigError(f"no request can run: {len(sched.waiting)} waiting, none admitted; "
                                          f"the KV pool is too small for the next request's prompt")
                    plan = None  # waiting for the previous step's ids (a preempted request's token)
                else:
                    handle, prompt_rows = self._launch(plan)
                    res.steps += 1
                    res.rows += plan.num_rows
                    res.active_slot_steps += len(plan.items)
                    res.prefill_rows += prompt_rows
                    res.d2h_bytes += st.d2h_bytes(handle.n_samples)
            if lockstep and plan is not None:
                sched.advance(plan)
                prev, plan = (plan, handle), None
            if prev is not None:
                t_wait = time.perf_counter()
                ids = st.ids(prev[1])
                wait = time.perf_counter() - t_wait
                done = sched.receive(prev[0], ids)
                bar.update(len(done))
            if plan is not None:
                sched.advance(plan)
            prev = (plan, handle) if plan is not None else None
            res.host_s.append(time.perf_counter() - t0 - wait)  # everything but waiting for the device
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        res.wall_s = time.perf_counter() - t_start
        res.gpu_ms = st.gpu_step_ms()
        bar.close()
        return res

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

    def _launch(self, plan: Plan):
        """Queue the plan's step; returns its handle and the number of prompt positions among its rows."""
        tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps = [], [], [], [], [], [], [], []
        seed0 = self.sampling.seed * 1_000_003
        prompt_rows = 0
        for s in plan.items:
            req = s.request
            start, n_prompt = req.computed, len(req.prompt)
            prompt_rows += max(0, min(start + s.rows, n_prompt) - start)
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
                seeds.append(seed0 + req.rid)
                steps.append(len(req.output) + req.inflight)
        tables = None
        if self.paged:
            tables, self.sched.dirty_tables = self.sched.dirty_tables, {}
        greedy = self.sampling.greedy
        handle = self.step.launch(tokens, positions, slots, feed, sample_rows, sample_slots,
                                  None if greedy else seeds, None if greedy else steps, tables)
        return handle, prompt_rows
