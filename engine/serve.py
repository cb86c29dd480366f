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
from engine.runner import BUCKETS, bucket_for
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
    host_s: list[float] = field(default_factory=list)  # host time per step: all but waiting for the device
    d2h_bytes: int = 0
    pinned_prefix: int = 0

    @property
    def generated(self) -> int:
        return sum(len(r.output) for r in self.finished)


class SlotRowStep:
    """Token-by-token steps on fixed rows: row s is slot s (inactive rows point at the scratch slot), so
    every step has the same shapes. The layers run as one CUDA graph; the LM head and the choice of
    token run as a second graph per bucket of sampling rows, over those rows only."""

    def __init__(self, model: FusedDecoder, kv, num_slots: int, scratch: int, paged: bool, sampling: SamplingParams,
                 use_graphs: bool):
        dev, self.model, self.kv, self.sampling = model.device, model, kv, sampling
        self.rows = bucket_for(num_slots)
        self.scratch, self.block_table = scratch, (kv.block_table if paged else None)
        R = self.rows
        z = lambda dtype=torch.long: torch.zeros(R, dtype=dtype, device=dev)  # noqa: E731
        self.tokens, self.positions, self.slots = z(), z(), torch.full((R,), scratch, dtype=torch.long, device=dev)
        self.sample_idx, self.seeds, self.steps, self.next = z(), z(), z(), z()
        self.temperature = torch.full((R,), max(sampling.temperature, 1e-6), device=dev)
        self.top_k = torch.full((R,), sampling.top_k, dtype=torch.long, device=dev)
        self.top_p = torch.full((R,), sampling.top_p, device=dev)
        self.buf = model.buffers(R)
        self.gathered = torch.empty(R, model.cfg.dim, device=dev, dtype=model.dtype)
        self.normed = torch.empty_like(self.gathered)
        self.logits = torch.empty(R, model.cfg.vocab_size, device=dev, dtype=model.dtype)
        self.layers_graph, self.head_graphs = None, {}
        if use_graphs:
            self._capture()

    def _layers(self) -> None:
        self.model.hidden(self.tokens, self.positions, self.slots, self.kv, self.buf, block_table=self.block_table)

    def _head(self, n: int) -> None:
        m, k = self.model, self.model.k
        torch.index_select(self.buf["residual"], 0, self.sample_idx[:n], out=self.gathered[:n])
        m.logits(self.gathered[:n], out=self.logits[:n], normed=self.normed[:n])
        if self.sampling.greedy:
            k.argmax(self.logits[:n], out=self.next[:n])
        else:
            k.sample(self.logits[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seeds[:n],
                     self.steps[:n], out=self.next[:n])

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm every kernel (all rows on the scratch slot) before capture
            for _ in range(2):
                self._layers()
                for n in BUCKETS[:BUCKETS.index(self.rows) + 1]:
                    self._head(n)
        torch.cuda.current_stream().wait_stream(stream)
        self.layers_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.layers_graph):
            self._layers()
        for n in BUCKETS[:BUCKETS.index(self.rows) + 1]:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.layers_graph.pool()):
                self._head(n)
            self.head_graphs[n] = g

    def run(self, tokens, positions, slots, sample_idx, seeds, steps) -> torch.Tensor:
        """Inputs are per-slot host tensors of length rows; returns the ids of the sampling rows (device)."""
        for dst, src in ((self.tokens, tokens), (self.positions, positions), (self.slots, slots)):
            dst.copy_(src, non_blocking=True)
        n = len(sample_idx)
        if n:
            nb = bucket_for(n)
            pad = sample_idx + [sample_idx[-1]] * (nb - n)
            self.sample_idx[:nb].copy_(torch.tensor(pad), non_blocking=True)
            if not self.sampling.greedy:
                self.seeds[:n].copy_(torch.tensor(seeds), non_blocking=True)
                self.steps[:n].copy_(torch.tensor(steps), non_blocking=True)
        if self.layers_graph is not None:
            self.layers_graph.replay()
            if n:
                self.head_graphs[nb].replay()
        else:
            self._layers()
            if n:
                self._head(nb)
        return self.next[:n]


class ServingEngine:
    def __init__(self, model: FusedDecoder, kv, scheduler: Scheduler, sampling: SamplingParams,
                 sample_on_device: bool = True, use_graphs: bool | None = None):
        """Token-by-token prefill runs on fixed slot rows (CUDA graphs on a GPU unless use_graphs=False);
        chunked prefill runs each step's rows eagerly."""
        self.model, self.kv, self.sched, self.sampling = model, kv, scheduler, sampling
        self.sample_on_device = sample_on_device
        self.paged = hasattr(kv, "block_table")
        self.device = model.device
        self.scratch = kv.num_slots - 1
        if scheduler.num_slots > self.scratch:
            raise ConfigError(f"{scheduler.num_slots} slots but the KV cache holds {self.scratch} (+ scratch)")
        self.slot_rows = None
        if scheduler.prefill == "token" and sample_on_device:
            graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
            self.slot_rows = SlotRowStep(model, kv, scheduler.num_slots, self.scratch, self.paged, sampling, graphs)

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
        return ids, n * 8

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
            prompt_rows = sum(max(0, min(s.request.computed + s.rows, len(s.request.prompt)) - s.request.computed)
                              for s in plan.items)
            if self.paged:
                self.kv.set_tables(sched.dirty_tables)
            sched.dirty_tables = {}
            ids, d2h = self._forward_slot_rows(plan) if self.slot_rows else self._forward(*self._rows(plan))
            t_wait = time.perf_counter()
            sampled = ids.tolist() if isinstance(ids, torch.Tensor) else ids  # waits for the device
            wait = time.perf_counter() - t_wait
            done = sched.finish_step(plan, sampled)
            res.host_s.append(time.perf_counter() - t0 - wait)  # everything but waiting for the device
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

    def _forward_slot_rows(self, plan: Plan) -> tuple[list[int], int]:
        R = self.slot_rows.rows
        tokens, positions, slots = [0] * R, [0] * R, [self.scratch] * R
        sample_idx, seeds, steps = [], [], []
        for s in plan.items:  # token mode: one row per scheduled request, at row = its slot
            req = s.request
            n_prompt = len(req.prompt)
            tokens[req.slot] = req.prompt[req.computed] if req.computed < n_prompt else req.output[req.computed - n_prompt]
            positions[req.slot] = req.computed
            slots[req.slot] = req.slot
            if s.samples:
                sample_idx.append(req.slot)
                seeds.append(self.sampling.seed * 1_000_003 + req.rid)
                steps.append(len(req.output))
        ids = self.slot_rows.run(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), sample_idx, seeds, steps)
        return ids, 8 * len(sample_idx)

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
