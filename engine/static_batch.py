"""Static batching: B slots start together, advance one token per step in lockstep, end together.

Prompts must have equal length. Prefill either feeds the prompt through the decode step one token per
step with logits discarded (the seed's way, mode "token"), or all prompt tokens in one forward
("batched"); both leave the same KV. The loop drives a stepper: the torch reference model here, or
the fused GPU decoder with CUDA graphs (engine/runner.py); both expose prefill() and decode().
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm.auto import tqdm

from onepass.kernels.errors import ConfigError
from onepass.engine.sampler import Sampler, SamplingParams

PREFILL_MODES = ("token", "batched")
STOP_CHECK_EVERY = 8  # on a GPU, reading tokens back is a sync: look for stop tokens every few steps only


@dataclass
class StaticBatchResult:
    prompts: list[list[int]]
    outputs: list[list[int]]  # generated ids per slot, stop token included, nothing after it
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # time of each decode step (forward + sample)
    decode_s: float = 0.0  # wall time of the whole decode loop, host bookkeeping included

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps (the first token of each slot comes from prefill)."""
        return sum(max(len(o) - 1, 0) for o in self.outputs)


class Stepper(Protocol):
    device: torch.device

    def prefill(self, prompts: torch.Tensor, mode: str) -> torch.Tensor:
        """Feed [B, P] prompt ids into slots 0..B-1; return the first sampled ids [B]."""

    def decode(self) -> torch.Tensor:
        """Feed each slot's last sampled token at its next position; return the new ids [B]."""


class ReferenceStepper:
    """The torch reference model (any device, eager): slot b = row b of the KV cache."""

    def __init__(self, model, kv, sampling: SamplingParams, batch: int):
        if batch > kv.num_slots:
            raise ConfigError(f"batch of {batch} slots but the KV cache has {kv.num_slots}")
        self.model, self.kv, self.device = model, kv, model.device
        self.slots = torch.arange(batch, device=self.device)
        self.sampler = Sampler(sampling, batch, self.device)

    def prefill(self, prompts, mode):
        B, P = prompts.shape
        if mode == "batched":
            logits = self.model.forward(prompts, torch.arange(P, device=self.device).expand(B, P), self.slots, self.kv)
        else:
            for t in range(P):
                logits = self.model.forward(prompts[:, t:t + 1], torch.full((B, 1), t, device=self.device), self.slots,
                                            self.kv)
        self.pos, self.last = P, self.sampler(logits, self.slots)
        return self.last

    def decode(self):
        B = self.last.shape[0]
        logits = self.model.forward(self.last.view(B, 1), torch.full((B, 1), self.pos, device=self.device), self.slots,
                                    self.kv)
        self.pos, self.last = self.pos + 1, self.sampler(logits, self.slots)
        return self.last


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


class _Clock:
    """Step times: CUDA events on a GPU (no sync per step), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_static(stepper: Stepper, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
               prefill: str = "batched", ctx: int | None = None, progress: bool = False) -> StaticBatchResult:
    """Run B = len(prompts) slots to max_new_tokens or a stop token each."""
    if prefill not in PREFILL_MODES:
        raise ConfigError(f"unknown prefill mode {prefill!r}; choose one of {PREFILL_MODES}")
    B, P = len(prompts), len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ConfigError("static batching needs prompts of equal length; use the continuous scheduler for ragged "
                          "prompts")
    if ctx is not None:
        check_fits(P, max_new_tokens, ctx)
    dev = stepper.device
    history = torch.empty(B, max_new_tokens, dtype=torch.long, device=dev)

    _sync(dev)
    t0 = time.perf_counter()
    history[:, 0] = stepper.prefill(torch.tensor(prompts, dtype=torch.long, device=dev), prefill)
    _sync(dev)
    prefill_s = time.perf_counter() - t0

    stops = torch.tensor(sorted(set(stop_ids)), device=dev) if stop_ids else None
    clock, steps = _Clock(dev), 1
    t_loop = time.perf_counter()
    clock.mark()
    for steps in tqdm(range(1, max_new_tokens), desc=f"decode B={B}", disable=not progress, leave=False):
        if stops is not None and (steps % STOP_CHECK_EVERY == 1 or dev.type == "cpu"):
            if torch.isin(history[:, :steps], stops).any(dim=1).all():
                break
        history[:, steps] = stepper.decode()
        clock.mark()
    else:
        steps = max_new_tokens
    _sync(dev)
    result = StaticBatchResult(prompts, [], prefill_s, clock.intervals(), time.perf_counter() - t_loop)
    for row in history[:, :steps].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in set(stop_ids)), len(row))
        result.outputs.append(row[:cut])
    return result


def generate_static(model, kv, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                    stop_ids: tuple[int, ...] = (), prefill: str = "batched",
                    progress: bool = False) -> StaticBatchResult:
    """Static batching on the torch reference model (slot b = row b of `kv`)."""
    stepper = ReferenceStepper(model, kv, sampling, len(prompts))
    return run_static(stepper, prompts, max_new_tokens, stop_ids, prefill, kv.ctx, progress)
