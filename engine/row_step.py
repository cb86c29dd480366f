"""One serving step on the device: any rows (token, slot, position), launched without waiting for the host.

The serving loop hands `launch` a plan's rows as host arrays. They travel in one copy from a pinned
staging buffer (two of them, alternating, so the host can fill step t+1's while step t's copy is still
queued), together with the block-table rows that changed; the step's graph writes those rows into the
table before its layers (unused entries rewrite the scratch slot's all-zero row), so a step costs the
host one copy and one graph launch whatever changed. A row whose token is still being sampled
by the previous step reads it on the device from `slot_next`, which every step's head updates, so the
host never waits for a step before launching the next. Rows are padded to a bucket (1, 2, 4, ... 512);
each bucket's layers run as one CUDA graph and each bucket of sampling rows has its LM-head graph, all
captured up front. Padded rows compute on the scratch slot at position 0.

`launch` returns a `Launched` handle; `ids(handle)` waits for that step alone and returns its sampled
ids (or, in the seed's host-sampling mode, argmaxes its logits on the host).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from onepass.engine.runner import BUCKETS, bucket_for
from onepass.engine.sampler import SamplingParams

# rows of the staged input block: per step row r (the first five) and per sampling row i (the last four)
TOKEN, POS, SLOT, FEED, SAMPLE_ROW, SAMPLE_SLOT, SEED, STEP = range(8)


@dataclass
class Launched:
    n_samples: int
    flip: int
    event: torch.cuda.Event | None  # recorded after the step's last copy


class RowStep:
    def __init__(self, model, kv, num_slots: int, max_rows: int, scratch: int, paged: bool,
                 sampling: SamplingParams, use_graphs: bool, sample_on_device: bool = True,
                 attn_workspace: dict | None = None, max_len: int | None = None, time_steps: bool = False,
                 ragged: bool = False):
        """ragged: a hybrid model's steps may hold several rows of one slot (chunked prefill): each step also
        stages its ragged runs (one per slot's rows, one per padding row; engine/fused_qwen35.py)."""
        dev, self.model, self.kv, self.sampling = model.device, model, kv, sampling
        self.ragged = ragged
        self.cuda = dev.type == "cuda"
        self.rows = bucket_for(max_rows)
        self.sample_rows = bucket_for(num_slots)
        self.scratch, self.paged, self.on_device = scratch, paged, sample_on_device
        self.attn_ws, self.max_len, self.time_steps = attn_workspace, max_len, time_steps and self.cuda
        R = self.rows
        # staged per step: 8 rows of R ids (below), the ragged runs' R + 1 row offsets (ragged only), then with
        # paged KV the changed block-table rows as (slot, blocks...) records, one per slot at most
        self.table_rows = kv.block_table.shape[0] if paged else 0
        width = kv.block_table.shape[1] + 1 if paged else 0
        nr = R + 1 if ragged else 0
        n = 8 * R + nr + self.table_rows * width
        flat = torch.zeros(n, dtype=torch.long, device=dev)
        self.inp, self.tab = flat[:8 * R].view(8, R), flat[8 * R + nr:].view(self.table_rows, width)
        self.run_off = flat[8 * R:8 * R + nr]
        self.runs = torch.zeros(nr, dtype=torch.int32, device=dev)   # what the GDN kernels read
        self.flat = flat
        pin = self.cuda
        self.stage = [torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.stage_np = [(s[:8 * R].numpy().reshape(8, R), s[8 * R + nr:].numpy().reshape(self.table_rows, width),
                          s[8 * R:8 * R + nr].numpy()) for s in self.stage]
        if paged:
            for _, t, _ in self.stage_np:
                t[:, 0] = self.table_rows - 1  # unused records rewrite the scratch slot's row with zeros
        self.tokens = torch.zeros(R, dtype=torch.long, device=dev)
        self.slot_next = torch.zeros(kv.num_slots, dtype=torch.long, device=dev)
        self.next = torch.zeros(self.sample_rows, dtype=torch.long, device=dev)
        self.temperature = torch.full((self.sample_rows,), max(sampling.temperature, 1e-6), device=dev)
        self.top_k = torch.full((self.sample_rows,), sampling.top_k, dtype=torch.long, device=dev)
        self.top_p = torch.full((self.sample_rows,), sampling.top_p, device=dev)
        self.buf = model.buffers(R)
        self.gathered = torch.empty(self.sample_rows, model.cfg.dim, device=dev, dtype=model.dtype)
        self.normed = torch.empty_like(self.gathered)
        self.logits = torch.empty(self.sample_rows, model.cfg.vocab_size, device=dev, dtype=model.dtype)
        self.ids_host = [torch.zeros(self.sample_rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.logits_host = None
        if not sample_on_device:  # the seed's baseline: the sampling rows' logits cross as fp32
            self.logits_host = [torch.zeros(self.sample_rows, model.cfg.vocab_size, pin_memory=pin) for _ in range(2)]
        self.flip = 0
        # one completion event per staging buffer: a buffer is refilled only after its step was waited for
        self.done = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.layer_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self._capture()

    # -- what runs on the device ----------------------------------------------------------------------
    def _layers(self, r: int) -> None:
        inp = self.inp
        if self.paged:
            self.kv.block_table.index_copy_(0, self.tab[:, 0], self.tab[:, 1:].to(torch.int32))
        # decode rows take the token the previous step sampled for their slot, still on the device
        torch.where(inp[FEED, :r].bool(), self.slot_next[inp[SLOT, :r]], inp[TOKEN, :r], out=self.tokens[:r])
        buf = {k: v[:r] for k, v in self.buf.items()}
        runs = {}
        if self.ragged:
            self.runs[:r + 1].copy_(self.run_off[:r + 1])
            runs = {"runs": self.runs[:r + 1]}
        self.model.hidden(self.tokens[:r], inp[POS, :r], inp[SLOT, :r], self.kv, buf, self.attn_ws,
                          block_table=self.kv.block_table if self.paged else None, max_len=self.max_len, **runs)

    def _head(self, n: int) -> None:
        m, k, inp = self.model, self.model.k, self.inp
        torch.index_select(self.buf["residual"], 0, inp[SAMPLE_ROW, :n], out=self.gathered[:n])
        m.logits(self.gathered[:n], out=self.logits[:n], normed=self.normed[:n])
        if not self.on_device:
            return
        if self.sampling.greedy:
            k.argmax(self.logits[:n], out=self.next[:n])
        else:
            k.sample(self.logits[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n], inp[SEED, :n],
                     inp[STEP, :n], out=self.next[:n])
        # padded sampling rows repeat the last real one: the same slot gets the same id twice
        self.slot_next.index_copy_(0, inp[SAMPLE_SLOT, :n], self.next[:n])

    def _capture(self) -> None:
        self.flat.zero_()
        if self.paged:
            self.tab[:, 0] = self.table_rows - 1
        self.inp[SLOT].fill_(self.scratch)  # warm-up and capture write only the scratch slot
        self.inp[SAMPLE_SLOT].fill_(self.scratch)
        layer_buckets = BUCKETS[:BUCKETS.index(self.rows) + 1]
        head_buckets = BUCKETS[:BUCKETS.index(self.sample_rows) + 1]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile every kernel at every shape before capture
            for r in layer_buckets:
                self._layers(r)
            for n in head_buckets:
                self._head(n)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for r in reversed(layer_buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._layers(r)
            pool = pool or g.pool()
            self.layer_graphs[r] = g
        for n in head_buckets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._head(n)
            self.head_graphs[n] = g

    # -- host side ------------------------------------------------------------------------------------
    def _stage_tables(self, tables: dict[int, list[int]], t: np.ndarray) -> None:
        n = len(tables)
        for i, (slot, blocks) in enumerate(tables.items()):
            t[i, 0] = slot
            t[i, 1:1 + len(blocks)] = blocks
            t[i, 1 + len(blocks):] = 0
        t[n:, 0] = self.table_rows - 1
        t[n:, 1:] = 0

    @staticmethod
    def _stage_runs(slots: np.ndarray, nrows: int, r: int, ro: np.ndarray) -> None:
        """The step's ragged runs as r + 1 row offsets: a run wherever the slot changes (each slot's rows are
        together: decode rows, then prompt chunks), each padding row its own run, then empty runs up to r."""
        starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]]) if nrows else np.zeros(0, dtype=np.int64)
        if len(np.unique(slots[starts])) != len(starts):   # two runs of one slot would race on its state
            raise ValueError(f"a step's rows of one slot must be consecutive (slots by row: {slots.tolist()})")
        k = len(starts) + (r - nrows)
        ro[:len(starts)] = starts
        ro[len(starts):k] = np.arange(nrows, r)
        ro[k:r + 1] = r

    def launch(self, tokens, positions, slots, feed, sample_rows, sample_slots, seeds=None, steps=None,
               tables: dict[int, list[int]] | None = None) -> Launched:
        """Queue one step: rows (tokens[r] is ignored where feed[r]) and the rows that sample. Returns at once."""
        nrows, n = len(tokens), len(sample_rows)
        r = bucket_for(max(nrows, 1))
        flip = self.flip
        self.flip ^= 1
        start = end = None
        if self.time_steps:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        a, t, ro = self.stage_np[flip]
        if self.paged:
            self._stage_tables(tables or {}, t)
        a[TOKEN, :nrows], a[POS, :nrows], a[SLOT, :nrows], a[FEED, :nrows] = tokens, positions, slots, feed
        a[TOKEN:FEED + 1, nrows:r] = 0
        a[SLOT, nrows:r] = self.scratch
        if self.ragged:
            self._stage_runs(a[SLOT, :nrows], nrows, r, ro)
        nb = bucket_for(n) if n else 0
        if n:
            a[SAMPLE_ROW, :n], a[SAMPLE_SLOT, :n] = sample_rows, sample_slots
            a[SAMPLE_ROW, n:nb], a[SAMPLE_SLOT, n:nb] = sample_rows[-1], sample_slots[-1]
            if seeds is not None:
                a[SEED, :n], a[STEP, :n] = seeds, steps
        self.flat.copy_(self.stage[flip], non_blocking=True)
        if r in self.layer_graphs:
            self.layer_graphs[r].replay()
        else:
            self._layers(r)
        if n:
            if nb in self.head_graphs:
                self.head_graphs[nb].replay()
            else:
                self._head(nb)
            if self.on_device:
                self.ids_host[flip][:n].copy_(self.next[:n], non_blocking=True)
            else:
                self.logits_host[flip][:n].copy_(self.logits[:n], non_blocking=True)
        event = end if end is not None else self.done[flip]
        if event is not None:
            event.record()
        if start is not None:
            self.step_events.append((start, end))
        return Launched(n, flip, event)

    def ids(self, h: Launched) -> list[int]:
        """Wait for that step and return its sampled ids (host argmax of its logits in host mode)."""
        if h.event is not None:
            h.event.synchronize()
        if not h.n_samples:
            return []
        if self.on_device:
            return self.ids_host[h.flip][:h.n_samples].tolist()
        return self.logits_host[h.flip][:h.n_samples].argmax(-1).tolist()

    def d2h_bytes(self, n_samples: int) -> int:
        return n_samples * (8 if self.on_device else 4 * self.model.cfg.vocab_size)

    def gpu_step_ms(self) -> list[float]:
        """Device time of each launched step (first event to last), after the run has synchronized."""
        return [s.elapsed_time(e) for s, e in self.step_events]
