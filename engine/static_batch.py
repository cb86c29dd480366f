"""Static batching: B slots start together, advance one token per step in lockstep, end together.

Prompts must have equal length. Prefill either feeds the prompt through the decode step one token per
step with logits discarded (the seed's way, mode "token"), or all prompt tokens in one forward
("batched"); both leave the same KV.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from engine.errors import ConfigError
from engine.sampler import Sampler, SamplingParams

PREFILL_MODES = ("token", "batched")


@dataclass
class StaticBatchResult:
    prompts: list[list[int]]
    outputs: list[list[int]]  # generated ids per slot, stop token included, nothing after it
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # wall time of each decode step (forward + sample)
    decode_s: float = 0.0  # wall time of the whole decode loop, host bookkeeping included

    @property
    def generated_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by decode steps (the first token of each slot comes from prefill)."""
        return sum(max(len(o) - 1, 0) for o in self.outputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_fits(prompt_len: int, max_new_tokens: int, ctx: int) -> None:
    if prompt_len < 1:
        raise ConfigError("empty prompt: a request needs at least one prompt token")
    need = prompt_len + max_new_tokens - 1  # the last sampled token is never fed back
    if need > ctx:
        raise ConfigError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens needs {need} KV positions, "
            f"but kv_cache.ctx={ctx}; raise kv_cache.ctx or shorten the prompt / workload.max_new_tokens")


def generate_static(model, kv, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                    stop_ids: tuple[int, ...] = (), prefill: str = "batched", progress: bool = False) -> StaticBatchResult:
    """Run B = len(prompts) slots (slot b = row b of the KV cache) to max_new_tokens or a stop token each."""
    if prefill not in PREFILL_MODES:
        raise ConfigError(f"unknown prefill mode {prefill!r}; choose one of {PREFILL_MODES}")
    B, P = len(prompts), len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ConfigError("static batching needs prompts of equal length; use the continuous scheduler for ragged prompts")
    if B > kv.num_slots:
        raise ConfigError(f"batch of {B} slots but the KV cache has {kv.num_slots}")
    check_fits(P, max_new_tokens, kv.ctx)

    dev = model.device
    slots = torch.arange(B, device=dev)
    prompt = torch.tensor(prompts, dtype=torch.long, device=dev)
    sampler = Sampler(sampling, B, dev)
    stops = set(stop_ids)

    _sync(dev)
    t0 = time.perf_counter()
    if prefill == "batched":
        positions = torch.arange(P, device=dev).expand(B, P)
        logits = model.forward(prompt, positions, slots, kv)
    else:
        for t in range(P):
            logits = model.forward(prompt[:, t:t + 1], torch.full((B, 1), t, device=dev), slots, kv)
    token = sampler(logits, slots)
    _sync(dev)
    result = StaticBatchResult(prompts, [[] for _ in range(B)], time.perf_counter() - t0)

    done = [False] * B
    t_loop = time.perf_counter()
    bar = tqdm(total=max_new_tokens, desc=f"decode B={B}", disable=not progress, leave=False)
    for step in range(max_new_tokens):
        ids = token.tolist()  # the only host transfer per step: B token ids
        for b in range(B):
            if not done[b]:
                result.outputs[b].append(ids[b])
                done[b] = ids[b] in stops or len(result.outputs[b]) == max_new_tokens
        bar.update(1)
        if all(done):
            break
        t0 = time.perf_counter()
        positions = torch.full((B, 1), P + step, device=dev)
        logits = model.forward(token.view(B, 1), positions, slots, kv)
        token = sampler(logits, slots)
        _sync(dev)
        result.step_s.append(time.perf_counter() - t0)
    bar.close()
    result.decode_s = time.perf_counter() - t_loop
    return result
