"""Draft tokens for speculative decoding: a draft source proposes up to k tokens that may follow a request's
sequence; the target checks them in the same step as the request's own next token (engine/scheduler.py,
engine/runner.py) and keeps the longest prefix it agrees with.

Every source here proposes tokens without a distribution of its own (a point mass), so the target's check needs no
probabilities: each draft row samples the target's token exactly as the run without speculation would (the
request's seed at that token's index), and a draft is kept while it equals that token. Greedy or sampled, the
output is token for token the output without speculation; speculation changes only how many steps it takes.

A source is called as `source(request, k) -> drafts` and told `forget(rid)` when a request ends. The qwen35 MTP head
(engine/mtp_drafts.py, method "mtp") also reads the target's hidden states: the runner binds it to its model
(`bind`) and shows it every step's rows once their tokens are settled (`observe`).
"""
from __future__ import annotations

import random

from onepass.engine.scheduler import Request
from onepass.kernels.errors import ConfigError

# mtp: the qwen35 MTP head (engine/mtp_drafts.py); mtp_scripted: that head run for its cost, its tokens scripted
METHODS = ("off", "ngram", "scripted", "mtp", "mtp_scripted")


class PromptLookup:
    """Prompt lookup: the most recent earlier occurrence of the sequence's last n tokens (n from max_n down to
    min_n) in the request's own prompt and output, and the tokens that followed it. No weights; each request's
    n-grams are indexed as its tokens arrive, so a proposal costs O(new tokens), not O(length)."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"speculative.ngram_min={min_n}, ngram_max={max_n}: need 1 <= min <= max")
        self.max_n, self.min_n = max_n, min_n
        self.index: dict[int, tuple[list[int], list[dict]]] = {}   # rid -> (tokens indexed, per n: n-gram -> start)

    def __call__(self, req: Request, k: int) -> list[int]:
        toks = req.prompt + req.output
        seen, grams = self.index.setdefault(req.rid, ([], [{} for _ in range(self.max_n + 1)]))
        if toks[:len(seen)] != seen:      # another request under this id: start over
            seen.clear()
            for g in grams:
                g.clear()
        L = len(toks)
        # an n-gram starting at s is indexed once the token after it exists: its entry is then always "earlier"
        for n in range(self.min_n, self.max_n + 1):
            for s in range(max(0, len(seen) - n), L - n):
                grams[n][tuple(toks[s:s + n])] = s
        seen.extend(toks[len(seen):])
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            s = grams[n].get(tuple(toks[L - n:]))
            if s is not None:
                return toks[s + n:s + n + k]
        return []

    def forget(self, rid: int) -> None:
        self.index.pop(rid, None)


class ScriptedDrafts:
    """Controlled acceptance for benchmarks: the target's own future tokens (from a run without speculation), each
    replaced by a wrong token with probability 1 - acceptance. Every cost of speculation is the real one; only how
    often a draft is right is set. Whether the draft for a request's token j is right is fixed by (seed, rid, j),
    so reruns propose the same drafts, and a draft proposed again after an earlier one was rejected is the same."""

    def __init__(self, futures: dict[int, list[int]], acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ConfigError(f"speculative.acceptance={acceptance}: a probability in [0, 1]")
        self.acceptance, self.vocab, self.seed = acceptance, vocab_size, seed
        # every request's drafts made once, so a proposal is a slice (the benchmark times the step, not this)
        self.scripts = {rid: self._script(rid, future) for rid, future in futures.items()}

    def _script(self, rid: int, future: list[int]) -> list[int]:
        rng = random.Random(f"{self.seed}:{rid}")
        out = []
        for tok in future:
            right, shift = rng.random() < self.acceptance, 1 + rng.randrange(self.vocab - 1)
            out.append(tok if right else (tok + shift) % self.vocab)
        return out

    def __call__(self, req: Request, k: int) -> list[int]:
        n = len(req.output)
        return self.scripts.get(req.rid, [])[n:n + k]

    def forget(self, rid: int) -> None:
        pass
