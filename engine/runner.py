"""The fused decoder behind the static-batching stepper interface, with one CUDA graph per row bucket.

Inputs live in device buffers sized for the largest bucket: token ids, positions and slot ids per
row, sampling parameters per row and a step counter. A captured step reads them, writes the new ids
back into the token buffer and advances positions on the device, so the host only replays graphs:
no sync, no allocation, no `.item()` inside a step. Rows beyond the batch point at a scratch slot.
"""
from __future__ import annotations

from typing import Callable

import torch

from onepass.kernels.errors import ConfigError
from onepass.engine.fused_model import FusedDecoder
from onepass.engine.fused_qwen35 import FusedQwen35Decoder
from onepass.engine.sampler import SamplingParams

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_for(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    for b in buckets:
        if b >= rows:
            return b
    raise ConfigError(f"{rows} rows exceed the largest CUDA-graph bucket {buckets[-1]}")


class GraphStepper:
    def __init__(self, model: FusedDecoder | FusedQwen35Decoder, kv, batch: int, sampling: SamplingParams,
                 use_graphs: bool = True, attn_workspace: Callable[[int, int], object] | None = None,
                 max_len: int | None = None):
        """`kv` must hold batch + 1 slots: the last one is the scratch slot that padded rows write to (a
        HybridCache for the hybrid decoder: padded rows sit at position 0, so they restart the scratch slot's
        recurrent state every step and never read what other padded rows wrote).
        `max_len` bounds every position this stepper will feed (default: the cache's ctx); the decode
        attention grid is sized for it, so a shorter bound skips split-KV work no row can need."""
        if kv.num_slots < batch + 1:
            raise ConfigError(f"the KV cache needs {batch + 1} slots (batch + a scratch slot), has {kv.num_slots}")
        self.model, self.kv, self.device = model, kv, model.device
        self.batch, self.rows = batch, bucket_for(batch)
        self.max_len = min(max_len or kv.ctx, kv.ctx)
        self.scratch = kv.num_slots - 1
        dev, R = self.device, self.rows
        self.tokens = torch.zeros(R, dtype=torch.long, device=dev)
        self.positions = torch.zeros(R, dtype=torch.long, device=dev)
        self.slots = torch.full((R,), self.scratch, dtype=torch.long, device=dev)
        self.slots[:batch] = torch.arange(batch, device=dev)
        self.next = torch.zeros(R, dtype=torch.long, device=dev)
        self.step_count = torch.zeros(1, dtype=torch.long, device=dev)
        self.sampling = sampling
        self.temperature = torch.full((R,), max(sampling.temperature, 1e-6), device=dev)
        self.top_k = torch.full((R,), sampling.top_k, dtype=torch.long, device=dev)
        self.top_p = torch.full((R,), sampling.top_p, device=dev)
        self.seeds = sampling.seed * 1_000_003 + torch.arange(R, dtype=torch.long, device=dev)
        self.buf = model.buffers(R)
        self.normed = torch.empty(R, model.cfg.dim, device=dev, dtype=model.dtype)
        self.logits = torch.empty(R, model.cfg.vocab_size, device=dev, dtype=model.dtype)
        self.make_ws = attn_workspace or (lambda rows, max_len: None)  # decode-attention split buffers
        self.attn_ws = self.make_ws(R, self.max_len)
        self.graph = self._capture() if use_graphs else None

    def _choose(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        k = self.model.k
        if self.sampling.greedy:
            return k.argmax(logits, out=out)
        n = logits.shape[0]
        return k.sample(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seeds[:n], self.step_count,
                        out=out)

    def _step(self) -> None:
        """One decode step over all rows of the bucket, feeding its output back as the next input."""
        m = self.model
        hidden = m.hidden(self.tokens, self.positions, self.slots, self.kv, self.buf, self.attn_ws,
                          max_len=self.max_len)
        m.logits(hidden, out=self.logits, normed=self.normed)
        self._choose(self.logits, self.next)
        self.tokens.copy_(self.next)
        self.positions[:self.batch].add_(1)  # padded rows stay at position 0 of the scratch slot
        self.step_count.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        saved = (self.slots.clone(), self.positions.clone(), self.tokens.clone())
        self.slots.fill_(self.scratch)  # warm-up steps write only the scratch slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles every Triton kernel before capture
                self.positions.zero_()
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        for dst, src in zip((self.slots, self.positions, self.tokens), saved):
            dst.copy_(src)
        self.step_count.zero_()
        return graph

    def decode(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.next[:self.batch]

    def prefill(self, prompts: torch.Tensor, mode: str) -> torch.Tensor:
        B, P = prompts.shape
        if B != self.batch:
            raise ConfigError(f"prefill of {B} prompts on a stepper built for {self.batch} slots")
        if mode == "token":  # the seed's way: every prompt token through the decode step, logits discarded
            for t in range(P):
                self.tokens[:B] = prompts[:, t]
                self.positions[:B] = t
                self.decode()
            return self.next[:B]
        # batched: all B*P prompt tokens as rows of one eager step; logits for each slot's last row only
        m, dev = self.model, self.device
        rows = B * P
        slots = torch.arange(B, device=dev).repeat_interleave(P)
        positions = torch.arange(P, device=dev).repeat(B)
        runs = {"seq_len": P} if getattr(m, "hybrid", False) else {}  # recurrent layers walk each slot's run in order
        hidden = m.hidden(prompts.reshape(-1), positions, slots, self.kv, m.buffers(rows),
                          self.make_ws(rows, self.max_len), max_len=self.max_len, **runs)
        last = hidden.view(B, P, -1)[:, -1].contiguous()
        logits = m.logits(last)
        self.step_count.zero_()
        self._choose(logits, self.next[:B])
        self.tokens[:B] = self.next[:B]
        self.positions[:B] = P
        return self.next[:B]
