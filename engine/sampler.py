"""Next-token choice per slot: greedy argmax, or temperature / top-k / top-p with a seeded RNG per slot.

Slot s draws from its own generator seeded from (seed, s), so a run is reproducible and slot s of a
B=8 run draws the same random numbers as slot s of a B=32 run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepass.kernels.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        # each of these would otherwise run: a negative temperature as greedy, top_p = 0 as NaN probabilities
        if not self.temperature >= 0.0:
            raise ConfigError(f"sampling.temperature={self.temperature}: use 0 for greedy or a positive temperature")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k={self.top_k}: use 0 for the whole vocabulary or a positive k")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p={self.top_p}: the nucleus is a probability in (0, 1]; "
                              "1 keeps everything")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled logits with everything outside top-k / the top-p nucleus set to -inf. logits: [B, V] fp32."""
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


class Sampler:
    def __init__(self, params: SamplingParams, num_slots: int, device: torch.device | str):
        self.params = params
        self.generators = []
        if not params.greedy:
            for s in range(num_slots):
                g = torch.Generator(device=device)
                g.manual_seed(params.seed * 1_000_003 + s)
                self.generators.append(g)

    def __call__(self, logits: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [B, V] -> token ids [B]; row b belongs to slot slots[b] (default: row index)."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        probs = filter_logits(logits.float(), self.params).softmax(dim=-1)
        rows = range(probs.shape[0]) if slots is None else slots.tolist()
        picks = [torch.multinomial(probs[b], 1, generator=self.generators[s]) for b, s in enumerate(rows)]
        return torch.cat(picks)
