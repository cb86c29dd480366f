"""Prompt token ids for a workload: the real tokenizer and chat template when the model has them,
otherwise deterministic ids with the seed's prompt lengths."""
from __future__ import annotations

import hashlib

import torch

from onepass.engine.tokenizer import Tokenizer
from onepass.kernels.errors import ConfigError

FIRST_ID = 3   # synthetic prompts skip ids 0-2, where a vocabulary keeps its special tokens


def prompt_ids(workload, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        if workload.chat and tokenizer.chat_template:
            return tokenizer.encode_chat(workload.prompt)
        return tokenizer.encode(workload.prompt)
    # No tokenizer (synthetic weights): ids seeded by the prompt text, so every run of a workload agrees.
    if vocab_size <= FIRST_ID:
        raise ConfigError(f"a synthetic prompt draws ids {FIRST_ID}..vocab_size-1 (below {FIRST_ID}: the special "
                          f"tokens), but the model's vocab_size is {vocab_size}: give the model more than "
                          f"{FIRST_ID} tokens")
    seed = int(hashlib.sha256(workload.prompt.encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab_size, (workload.synthetic_prompt_len,), generator=g).tolist()


def workload_digest(prompts: list[list[int]], workload) -> str:
    """A hash of exactly what was fed: equal digests mean two runs decoded the same workload."""
    h = hashlib.sha256()
    h.update(repr([list(p) for p in prompts]).encode())
    h.update(f"{workload.max_new_tokens}|{workload.ignore_eos}".encode())
    if workload.num_requests:  # serving workloads: the request count and the max-gen draw
        h.update(f"|{workload.num_requests}|{workload.min_new_tokens}|{workload.seed}".encode())
    return h.hexdigest()[:16]
