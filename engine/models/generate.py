"""The oracle's own loop: greedy or seeded sampling on a plain-torch reference model (engine/models), slot b of
the cache holding prompt b. Tests and checks compare the engine against it; the engine never runs it."""
from __future__ import annotations

import torch

from onepass.engine.runner import PREFILL_MODES, StaticBatchResult, check_fits
from onepass.engine.sampler import Sampler, SamplingParams
from onepass.kernels.errors import ConfigError


def reference_generate(model, kv, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                       stop_ids: tuple[int, ...] = (), prefill: str = "batched") -> StaticBatchResult:
    """Prompts of one length decoded together, eagerly, to max_new_tokens or a stop token each. Prefill "batched"
    feeds each prompt in one forward, "token" a token per forward."""
    if prefill not in PREFILL_MODES:
        raise ConfigError(f"unknown prefill mode {prefill!r}; choose one of {PREFILL_MODES}")
    B, P = len(prompts), len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ConfigError("the reference decodes prompts of equal length together; run them one at a time")
    if B > kv.num_slots:
        raise ConfigError(f"batch of {B} prompts but the KV cache has {kv.num_slots} slots")
    check_fits(P, max_new_tokens, kv.ctx)
    dev = model.device
    slots = torch.arange(B, device=dev)
    sampler = Sampler(sampling, B, dev)
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    if prefill == "batched":
        logits = model.forward(ids, torch.arange(P, device=dev).expand(B, P), slots, kv)
    else:
        for t in range(P):
            logits = model.forward(ids[:, t:t + 1], torch.full((B, 1), t, device=dev), slots, kv)
    stops = set(stop_ids)
    outputs: list[list[int]] = [[] for _ in range(B)]
    last = sampler(logits, slots)
    for step in range(max_new_tokens):
        for b, tok in enumerate(last.tolist()):
            if not (outputs[b] and outputs[b][-1] in stops):   # nothing after a slot's stop token
                outputs[b].append(tok)
        if step + 1 == max_new_tokens or all(o and o[-1] in stops for o in outputs):
            break
        logits = model.forward(last.view(B, 1), torch.full((B, 1), P + step, device=dev), slots, kv)
        last = sampler(logits, slots)
    return StaticBatchResult(prompts, outputs, 0.0)
