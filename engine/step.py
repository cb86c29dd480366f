"""The decode step on the device: any rows (token, slot, position), launched without waiting for the host.

`launch` takes a plan's rows as host arrays. They travel in one copy from a pinned staging buffer (two of them,
alternating, so the host fills step t+1's while step t's copy is still queued), with the block-table rows that
changed; the step writes those rows into the table before its layers (unused entries rewrite the scratch slot's
all-zero row). A row whose token the previous step is still sampling reads it on the device from `slot_next`, which
every step's head updates, so the host never waits for a step before launching the next. Rows are padded to a
bucket (1, 2, 4, ... 512); each bucket's layers and each bucket of sampling rows run as CUDA graphs. Padded rows
compute on the scratch slot at position 0. A step of more rows than the largest bucket (a whole batch's prompts)
runs eagerly on buffers made for it.

`lockstep` is the same step for the common case of every running slot decoding one token: its rows are staged
once, and each replay of one graph feeds every slot its own last token and advances positions on the device, so a
run of steps costs the host one graph launch each and nothing else.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from onepass.engine.sampler import SamplingParams
from onepass.kernels import pdl
from onepass.kernels.errors import ConfigError
from onepass.kernels.gdn import SpecRows
from onepass.kernels.persistent_step import MAX_ROWS as PERSISTENT_ROWS

# engine.step=auto takes the persistent form only where its layers' times are at least this much lower: at a 1-4%
# margin at capture, whole steps came out 0.98-1.03x the kernel-per-op step's (experiments/latency)
AUTO_MARGIN = 0.03

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOCKSTEP_MAX = 8   # steps of one lockstep run: the host reads ids (and sees stop tokens) this often
# rows of the staged input block: per step row r (the first four), per sampling row i (the next four), and per step row
# a hybrid model's speculation inputs (kernels/gdn.py SpecRows: kept verify rows to fold in, a verify run's rows)
TOKEN, POS, SLOT, FEED, SAMPLE_ROW, SAMPLE_SLOT, SEED, STEP, KEPT, VERIFY = range(10)
NIN = 10


def bucket_for(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    for b in buckets:
        if b >= rows:
            return b
    raise ConfigError(f"{rows} rows exceed the largest CUDA-graph bucket {buckets[-1]}")


class Clock:
    """Marks on the device's timeline: CUDA events (no sync to record one), perf_counter on the CPU, where every
    operation has finished when it returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


@dataclass
class Launched:
    n_samples: int       # ids the handle returns (a lockstep run's step-major)
    flip: int            # the staging / host buffer pair it used
    event: object        # recorded after its last copy (None on the CPU)


class Step:
    def __init__(self, model, kv, num_slots: int, max_rows: int, sampling: SamplingParams, *, paged: bool,
                 use_graphs: bool, sample_on_device: bool = True,
                 workspace: Callable[[int, int], object] | None = None, max_len: int | None = None,
                 ragged: bool = False, buckets: tuple[int, ...] | None = None, launch: pdl.LaunchPolicy | None = None,
                 max_samples: int | None = None, speculative: bool = False):
        """kv holds the slots 0..num_slots-1 and a scratch slot (the last). `workspace(rows, max_len)` makes the
        decode attention's split buffers; `max_len` bounds every position (default: the cache's ctx). ragged: a
        hybrid model's steps may hold several rows of one slot (chunked prefill): each step also stages its runs
        (engine/fused_qwen35.py). `buckets`: the row buckets whose graphs are captured (default: all up to
        max_rows); the lockstep graph is captured for num_slots' bucket. `launch`: the policy every kernel of this
        step launches under, captured into its graphs (default: the one in force now). `max_samples`: the most rows
        one step samples (default num_slots; more with speculation). speculative: a hybrid model's steps carry verify
        runs (each step passes its KEPT and VERIFY rows to the GDN layers: engine/fused_qwen35.py)."""
        dev, self.model, self.kv, self.sampling = model.device, model, kv, sampling
        self.policy = launch or pdl.current()
        self.device, self.ragged, self.cuda = dev, ragged, dev.type == "cuda"
        if speculative and not ragged:
            raise ConfigError("a speculative hybrid step feeds a slot's verify rows as one run: build it ragged=True")
        self.speculative = speculative
        self.scratch = kv.num_slots - 1
        if num_slots > self.scratch:
            raise ConfigError(f"{num_slots} slots but the KV cache holds {self.scratch} (+ a scratch slot)")
        self.rows = bucket_for(min(max(max_rows, num_slots), BUCKETS[-1]))
        self.lock_rows = bucket_for(num_slots)      # a lockstep step: one row a slot
        self.sample_rows = min(bucket_for(min(max(max_samples or 0, num_slots), BUCKETS[-1])), self.rows)
        self.paged, self.on_device = paged, sample_on_device
        self.max_len = min(max_len or kv.ctx, kv.ctx)
        self.make_ws = workspace or (lambda rows, n: None)
        self.attn_ws = self.make_ws(self.rows, self.max_len)
        self.clock = Clock(dev)
        R = self.rows
        # staged per step: NIN rows of R ids, the ragged runs' R + 1 row offsets (ragged only), then with paged KV the
        # changed block-table rows as (slot, blocks...) records, one per slot at most
        self.table_rows = kv.block_table.shape[0] if paged else 0
        width = kv.block_table.shape[1] + 1 if paged else 0
        nr = R + 1 if ragged else 0
        n = NIN * R + nr + self.table_rows * width
        self.flat = torch.zeros(n, dtype=torch.long, device=dev)
        self.inp, self.tab = self.flat[:NIN * R].view(NIN, R), self.flat[NIN * R + nr:].view(self.table_rows, width)
        self.run_off = self.flat[NIN * R:NIN * R + nr]
        self.runs = torch.zeros(nr, dtype=torch.int32, device=dev)   # what the GDN kernels read
        pin = self.cuda
        self.stage = [torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.stage_np = [(s[:NIN * R].numpy().reshape(NIN, R),
                          s[NIN * R + nr:].numpy().reshape(self.table_rows, width),
                          s[NIN * R:NIN * R + nr].numpy()) for s in self.stage]
        if paged:
            for _, t, _ in self.stage_np:
                t[:, 0] = self.table_rows - 1  # unused records rewrite the scratch slot's row with zeros
        self.tokens = torch.zeros(R, dtype=torch.long, device=dev)
        self.slot_next = torch.zeros(kv.num_slots, dtype=torch.long, device=dev)
        S = self.sample_rows
        self.next = torch.zeros(S, dtype=torch.long, device=dev)
        self.temperature = torch.full((S,), max(sampling.temperature, 1e-6), device=dev)
        self.top_k = torch.full((S,), sampling.top_k, dtype=torch.long, device=dev)
        self.top_p = torch.full((S,), sampling.top_p, device=dev)
        self.buf = model.buffers(R)
        self.last_hidden = self.buf["residual"]   # the last launch's final residual rows (a wide step's own buffer)
        self.gathered = torch.empty(S, model.cfg.dim, device=dev, dtype=model.dtype)
        self.normed = torch.empty_like(self.gathered)
        self.logits = torch.empty(S, model.cfg.vocab_size, device=dev, dtype=model.dtype)
        self.ids_host = [torch.zeros(LOCKSTEP_MAX * S, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.history = torch.zeros(LOCKSTEP_MAX, S, dtype=torch.long, device=dev)   # a lockstep run's ids
        self.logits_host = None
        if not sample_on_device:  # the seed's baseline: the sampling rows' logits cross as fp32
            self.logits_host = [torch.zeros(self.sample_rows, model.cfg.vocab_size, pin_memory=pin) for _ in range(2)]
        self.flip = 0
        self.locked: tuple[int, ...] = ()   # the slots of the lockstep rows staged on the device (none: ())
        # the timeline: (kind, mark) after every step, kind "rows" (launch) or "lock" (a lockstep replay)
        self.marks: list[tuple[str, object]] = []
        self.layer_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lock_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            with pdl.applied(self.policy):
                self._capture(buckets)
        elif self.cuda:
            self.inp[SLOT].fill_(self.scratch)  # as in _capture: the timed steps write only the scratch slot
            with pdl.applied(self.policy):
                self._pick_step_forms(self._pick_buckets(self._layer_buckets(buckets)), graphed=False)

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
        if self.speculative:
            runs["spec"] = SpecRows(inp[KEPT, :r], inp[VERIFY, :r])
        self.model.hidden(self.tokens[:r], inp[POS, :r], inp[SLOT, :r], self.kv, buf, self.attn_ws,
                          block_table=self.kv.block_table if self.paged else None, max_len=self.max_len, **runs)

    def _head(self, n: int, rows: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
        """Logits of the sampling rows (gathered from `rows` by SAMPLE_ROW unless they are rows 0..n-1 already) and
        the next id of each, written to its slot's entry of slot_next."""
        m, k, inp = self.model, self.model.k, self.inp
        if rows is None:
            rows = torch.index_select(self.buf["residual"], 0, inp[SAMPLE_ROW, :n], out=self.gathered[:n])
        m.logits(rows, out=self.logits[:n], normed=self.normed[:n])
        if not self.on_device:
            return
        if self.sampling.greedy:
            k.argmax(self.logits[:n], out=self.next[:n])
        else:
            k.sample(self.logits[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n], inp[SEED, :n],
                     inp[STEP, :n], out=self.next[:n])
        # padded sampling rows repeat the last real one (launch) or sample the scratch slot (lockstep)
        self.slot_next.index_copy_(0, inp[SAMPLE_SLOT, :n] if slots is None else slots, self.next[:n])

    def _lockstep(self, r: int) -> None:
        """Every row one token of its slot, sampled; positions and sampling steps advance on the device."""
        self._layers(r)
        self._head(r, rows=self.buf["residual"][:r], slots=self.inp[SLOT, :r])
        self.inp[POS, :r].add_(self.inp[FEED, :r])   # padded rows (FEED 0) stay at position 0
        self.inp[STEP, :r].add_(1)

    def _layer_buckets(self, buckets: tuple[int, ...] | None) -> list[int]:
        return [b for b in BUCKETS if b <= self.rows and (buckets is None or b in buckets)]

    def _pick_buckets(self, layer_buckets: list[int]) -> list[int]:
        """The row counts whose layers run: the captured buckets and the lockstep's rows (a static batch with batched
        prefill captures no other: without them auto would run its lockstep unmeasured)."""
        return sorted(set(layer_buckets) | {self.lock_rows})

    def _pick_step_forms(self, layer_buckets: list[int], graphed: bool, rounds: int = 3, reps: int = 10) -> None:
        """engine.step=auto: for each bucket the persistent step may take and the model has no times for, both forms
        of the layers (each captured as a graph when `graphed`) run in turn, `rounds` x `reps` times each (their
        medians: the model's pick_us). The first Step to measure decides for the model, once: the persistent form
        for every row count if its times summed over the buckets measured are lower by AUTO_MARGIN or more
        (FusedDecoder.set_step says why one form for all)."""
        m = self.model
        if not getattr(m, "auto", False):
            return
        todo = [r for r in layer_buckets if r not in m.pick_us and r <= PERSISTENT_ROWS]
        why = m.persistent_unsupported(self.kv) if todo else None
        decided = m.choice
        try:
            for r in todo:
                if why:
                    break
                runs = {}
                for form in (False, True):
                    m.choice = form
                    try:
                        self._layers(r)            # compiles the form's kernels
                    except Exception as e:         # a persistent form this GPU cannot build: auto keeps the other
                        if not form:
                            raise
                        why = f"the persistent step did not build ({type(e).__name__}: {str(e)[:200]})"
                        break
                    runs[form] = functools.partial(self._layers, r)
                    if graphed:
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            self._layers(r)
                        runs[form] = g.replay
                if why:
                    break
                us = {False: [], True: []}
                for _ in range(rounds):
                    for form, run in runs.items():
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        for _ in range(reps):
                            run()
                        b.record()
                        b.synchronize()
                        us[form].append(a.elapsed_time(b) * 1e3 / reps)
                m.pick_us[r] = (float(np.median(us[False])), float(np.median(us[True])))
        finally:
            m.choice = decided
        if why:
            m.pick_why = why
            if m.choice is None:
                m.choice = False
        elif m.choice is None and todo:
            m.pick_rows = tuple(todo)
            m.choice = sum(m.pick_us[r][1] for r in todo) < (1 - AUTO_MARGIN) * sum(m.pick_us[r][0] for r in todo)

    def _capture(self, buckets: tuple[int, ...] | None) -> None:
        layer_buckets = self._layer_buckets(buckets)
        head_buckets = [b for b in BUCKETS if b <= self.sample_rows and (buckets is None or b in buckets)]
        lock = self.lock_rows
        self.flat.zero_()
        if self.paged:
            self.tab[:, 0] = self.table_rows - 1
        self.inp[SLOT].fill_(self.scratch)  # warm-up and capture write only the scratch slot
        self.inp[SAMPLE_SLOT].fill_(self.scratch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile every kernel at every shape before capture
            self._pick_step_forms(self._pick_buckets(layer_buckets), graphed=True)
            for r in layer_buckets:
                self._layers(r)
            for n in head_buckets:
                self._head(n)
            self._lockstep(lock)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for kind, graphs, bs, fn in (("lock", self.lock_graphs, [lock], self._lockstep),
                                     ("layers", self.layer_graphs, reversed(layer_buckets), self._layers),
                                     ("head", self.head_graphs, head_buckets, self._head)):
            for b in bs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    fn(b)
                pool = pool or g.pool()
                graphs[b] = g

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

    def mark(self, kind: str) -> None:
        self.marks.append((kind, self.clock.mark()))

    def _run(self, graphs: dict, fn, r: int) -> None:
        if r in graphs:
            graphs[r].replay()
        else:
            fn(r)

    def _fill(self, a, t, ro, tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps, tables,
              pad_to: int = 0, kept=None, verify=None):
        """Write one step's rows into staging buffer (a, t, ro), padded to their bucket or `pad_to` rows; returns
        (rows, padded rows, samples, sample bucket)."""
        nrows, n = len(tokens), len(sample_rows)
        r = max(bucket_for(max(nrows, 1)), pad_to)
        if self.paged:
            self._stage_tables(tables or {}, t)
        a[TOKEN, :nrows], a[POS, :nrows], a[SLOT, :nrows], a[FEED, :nrows] = tokens, positions, slots, feed
        a[TOKEN:FEED + 1, nrows:r] = 0
        a[KEPT, :r] = 0
        a[VERIFY, :r] = 0
        if kept is not None:
            a[KEPT, :nrows], a[VERIFY, :nrows] = kept, verify
        a[SLOT, nrows:r] = self.scratch
        if self.ragged:
            self._stage_runs(a[SLOT, :nrows], nrows, r, ro)
        nb = bucket_for(n) if n else 0
        if n:
            a[SAMPLE_ROW, :n], a[SAMPLE_SLOT, :n] = sample_rows, sample_slots
            a[SAMPLE_ROW, n:nb], a[SAMPLE_SLOT, n:nb] = sample_rows[-1], sample_slots[-1]
            if seeds is not None:
                a[SEED, :n], a[STEP, :n] = seeds, steps
        return nrows, r, n, nb

    def launch(self, tokens, positions, slots, feed, sample_rows, sample_slots, seeds=None, steps=None,
               tables: dict[int, list[int]] | None = None, kept=None, verify=None) -> Launched:
        """Queue one step: rows (tokens[r] is ignored where feed[r]) and the rows that sample. Returns at once.
        kept, verify: per row, a speculative hybrid step's SpecRows (read at each run's first row; default 0)."""
        if kept is not None and not self.speculative:
            raise ValueError("kept / verify rows go to a Step built with speculative=True")
        with pdl.applied(self.policy):   # for what runs eagerly; a graph keeps the policy it was captured under
            return self._launch(tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps, tables,
                                kept, verify)

    def _launch(self, tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps, tables, kept,
                verify) -> Launched:
        self.locked = ()   # the lockstep rows staged on the device are overwritten
        if len(tokens) > self.rows:
            return self._launch_wide(tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps, tables,
                                     kept, verify)
        flip = self.flip
        self.flip ^= 1
        nrows, r, n, nb = self._fill(*self.stage_np[flip], tokens, positions, slots, feed, sample_rows, sample_slots,
                                     seeds, steps, tables, kept=kept, verify=verify)
        self.flat.copy_(self.stage[flip], non_blocking=True)
        self._run(self.layer_graphs, self._layers, r)
        self.last_hidden = self.buf["residual"]
        if n:
            self._run(self.head_graphs, self._head, nb)
        return self._finish(flip, n)

    def _finish(self, flip: int, n: int) -> Launched:
        if n:
            if self.on_device:
                self.ids_host[flip][:n].copy_(self.next[:n], non_blocking=True)
            else:
                self.logits_host[flip][:n].copy_(self.logits[:n], non_blocking=True)
        self.mark("rows")
        return Launched(n, flip, self.marks[-1][1] if self.cuda else None)

    def _launch_wide(self, tokens, positions, slots, feed, sample_rows, sample_slots, seeds, steps, tables, kept=None,
                     verify=None):
        """A step of more rows than the largest bucket, eagerly on buffers of its size (a batch's whole prompts)."""
        dev, m, n = self.device, self.model, len(sample_rows)
        if n > self.sample_rows:
            raise ConfigError(f"{n} sampling rows in one step; this step samples at most {self.sample_rows}")
        flip = self.flip
        self.flip ^= 1
        t = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64), device=dev)   # noqa: E731
        for slot, blocks in (tables or {}).items():
            row = torch.zeros(self.kv.block_table.shape[1], dtype=torch.int32)
            row[:len(blocks)] = torch.as_tensor(blocks, dtype=torch.int32)
            self.kv.block_table[slot].copy_(row)
        slots_t, feed_t = t(slots), t(feed).bool()
        toks = torch.where(feed_t, self.slot_next[slots_t], t(tokens))
        runs = {}
        if getattr(m, "hybrid", False):
            ro = np.zeros(len(tokens) + 1, dtype=np.int64)
            self._stage_runs(np.asarray(slots, dtype=np.int64), len(tokens), len(tokens), ro)
            runs = {"runs": torch.as_tensor(ro, dtype=torch.int32, device=dev)}
        if self.speculative:
            zeros = [0] * len(tokens)
            runs["spec"] = SpecRows(t(zeros if kept is None else kept), t(zeros if verify is None else verify))
        hidden = m.hidden(toks, t(positions), slots_t, self.kv, m.buffers(len(tokens)),
                          self.make_ws(len(tokens), self.max_len),
                          block_table=self.kv.block_table if self.paged else None, max_len=self.max_len, **runs)
        self.last_hidden = hidden
        a = self.inp
        if n:
            a[SAMPLE_ROW, :n], a[SAMPLE_SLOT, :n] = t(sample_rows), t(sample_slots)
            if seeds is not None:
                a[SEED, :n], a[STEP, :n] = t(seeds), t(steps)
            self._head(n, rows=hidden[a[SAMPLE_ROW, :n]])
        return self._finish(flip, n)

    def stage_lockstep(self, slots, positions, seeds=None, steps=None) -> None:
        """Stage a lockstep run: row i decodes slot slots[i] at positions[i], feeding the slot's last sampled id
        (slot_next) and sampling with seeds[i] at steps[i]; rows and positions then advance on the device."""
        nrows = len(slots)
        flip = self.flip
        a, t, ro = self.stage_np[flip]
        # paged KV: the table rows were uploaded by earlier steps. Every row samples in place (SAMPLE_ROW and
        # SAMPLE_SLOT are unused), padded to the captured lockstep graph's rows when there is one
        pad = self.lock_rows if self.lock_graphs else 0
        self._fill(a, t, ro, [0] * nrows, positions, slots, [1] * nrows, range(nrows), slots, seeds, steps, None, pad)
        self.flat.copy_(self.stage[flip], non_blocking=True)
        self.locked = tuple(slots)

    def lockstep(self, steps: int) -> Launched:
        """Replay the staged lockstep rows `steps` times (<= LOCKSTEP_MAX); the handle returns steps x rows ids."""
        with pdl.applied(self.policy):
            return self._lockstep_run(steps)

    def _lockstep_run(self, steps: int) -> Launched:
        nrows = len(self.locked)
        if not 1 <= steps <= LOCKSTEP_MAX or not nrows:
            raise ValueError(f"lockstep of {steps} steps over {nrows} staged rows")
        r = self.lock_rows if self.lock_graphs else bucket_for(nrows)
        flip = self.flip
        self.flip ^= 1
        for i in range(steps):
            self._run(self.lock_graphs, self._lockstep, r)
            self.history[i, :nrows].copy_(self.next[:nrows])
            self.mark("lock")
        n = steps * nrows
        self.ids_host[flip][:n].view(steps, nrows).copy_(self.history[:steps, :nrows], non_blocking=True)
        self.mark("copy")
        return Launched(n, flip, self.marks[-1][1] if self.cuda else None)

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

    def step_times(self, kinds: tuple[str, ...] = ("rows", "lock")) -> list[float]:
        """Seconds from each mark of `kinds` back to the mark before it: a step's span on the device's timeline,
        idle time before it included. Only after the run has synchronized."""
        out = []
        for (_, a), (kind, b) in zip(self.marks, self.marks[1:]):
            if kind in kinds:
                out.append(self.clock.seconds(a, b))
        return out
