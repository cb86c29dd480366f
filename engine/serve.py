"""Serving loop: requests in, completed outputs out, one fused decode step per scheduler step.

Each step the scheduler picks rows (token, slot, position); the fused decoder runs them over the
contiguous or paged KV; logits are computed only for rows that sample; only the sampled ids (or, in
the seed's host-sampling mode, the sampling rows' logits) cross to the host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from engine.errors import ConfigError
from engine.fused_model import FusedDecoder
from engine.sampler import SamplingParams
from engine.scheduler import Plan, Request, Scheduler

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
    host_s: list[float] = field(default_factory=list)  # host time per step (scheduling, tables, bookkeeping)
    d2h_bytes: int = 0
    pinned_prefix: int = 0

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.finished)


class ServingEngine:
    def __init__(self, model: FusedDecoder, kv, scheduler: Scheduler, sampling: SamplingParams,
                 sample_on_device: bool = True):
        self.model, self.kv, self.sched, self.sampling = model, kv, scheduler, sampling
        self.sample_on_device = sample_on_device
        self.paged = hasattr(kv, "block_table")
        self.device = model.device
        self.scratch = kv.num_slots - 1
        if scheduler.num_slots > self.scratch:
            raise ConfigError(f"{scheduler.num_slots} slots but the KV cache holds {self.scratch} (+ scratch)")

    def _forward(self, tokens: list[int], positions: list[int], slots: list[int], sample_idx: list[int],
                 seeds: list[int], steps: list[int]) -> tuple[list[int], int]:
        dev, m = self.device, self.model
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        hidden = m.hidden(t(tokens), t(positions), t(slots), self.kv, m.buffers(len(tokens)),
                          block_table=self.kv.block_table if self.paged else None)
        if not sample_idx:
            return [], 0
        logits = m.logits(hidden[t(sample_idx)].contiguous())
        k, n = m.k, len(sample_idx)
        if not self.sample_on_device:  # the seed's baseline: every sampling row's logits to the host
            host = logits.float().cpu()
            return host.argmax(-1).tolist(), host.numel() * 4
        if self.sampling.greedy:
            ids = k.argmax(logits)
        else:
            p = self.sampling
            ids = k.sample(logits, torch.full((n,), p.temperature, device=dev), torch.full((n,), p.top_k, device=dev),
                           torch.full((n,), p.top_p, device=dev), t(seeds), t(steps))
        return ids.tolist(), n * 8

    def pin_prefix(self, tokens: list[int]) -> int:
        """The seed's prefix mode: fill the block-aligned shared prefix's KV once into pinned blocks."""
        bm = self.sched.bm
        if bm is None:
            raise ConfigError("prefix caching needs the paged KV cache (kv_cache.layout=paged)")
        blocks = bm.pin_prefix(tokens)
        n = len(blocks) * bm.block_size
        if n == 0:
            return 0
        self.kv.set_tables({self.scratch: blocks})
        self._forward(tokens[:n], list(range(n)), [self.scratch] * n, [], [], [])
        self.kv.set_tables({self.scratch: []})
        return n

    def run(self, requests: list[Request], progress: bool = False) -> ServeResult:
        sched = self.sched
        for r in requests:
            sched.add(r)
        res = ServeResult(sched.finished, sched.rejected)
        bar = tqdm(total=len(requests), desc="requests", disable=not progress, leave=False)
        t_start = time.perf_counter()
        while not sched.done:
            t0 = time.perf_counter()
            plan = sched.schedule()
            if not plan.items:
                raise ConfigError(f"no request can run: {len(sched.waiting)} waiting, none admitted; "
                                  f"the KV pool is too small for the next request's prompt")
            rows = self._rows(plan)
            prompt_rows = sum(max(0, min(s.request.computed + s.rows, len(s.request.prompt)) - s.request.computed)
                              for s in plan.items)
            if self.paged:
                self.kv.set_tables(sched.dirty_tables)
            sched.dirty_tables = {}
            res.host_s.append(time.perf_counter() - t0)
            sampled, d2h = self._forward(*rows)
            t1 = time.perf_counter()
            done = sched.finish_step(plan, sampled)
            res.host_s[-1] += time.perf_counter() - t1
            res.steps += 1
            res.rows += plan.num_rows
            res.prefill_rows += prompt_rows
            res.active_slot_steps += len(sched.running) + len(done)
            res.d2h_bytes += d2h
            bar.update(len(done))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        res.wall_s = time.perf_counter() - t_start
        bar.close()
        return res

    def _rows(self, plan: Plan):
        tokens, positions, slots, sample_idx, seeds, steps = [], [], [], [], [], []
        for s in plan.items:
            req = s.request
            seq = req.tokens
            start = req.computed
            tokens += seq[start:start + s.rows]
            positions += range(start, start + s.rows)
            slots += [req.slot] * s.rows
            if s.samples:
                sample_idx.append(len(tokens) - 1)
                seeds.append(self.sampling.seed * 1_000_003 + req.rid)
                steps.append(len(req.output))
        return tokens, positions, slots, sample_idx, seeds, steps
