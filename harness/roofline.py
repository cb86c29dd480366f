"""Bytes a decode step must move, and the copy bandwidth measured in the same process: the floor."""
from __future__ import annotations

import torch

from onepass.engine.config import ModelConfig


def weight_bytes_per_step(cfg: ModelConfig, elem_bytes: int) -> int:
    """Every weight is read once per step, except the embedding table (a B-row gather) unless it is
    also the LM head (tied)."""
    params = cfg.param_count()
    if not cfg.tie_embeddings:
        params -= cfg.vocab_size * cfg.dim
    return params * elem_bytes


def kv_bytes_per_token(cfg: ModelConfig, elem_bytes: int) -> int:
    return cfg.n_layers * 2 * cfg.kv_dim * elem_bytes


def decode_floor_bytes(cfg: ModelConfig, elem_bytes: int, batch: int, prompt_len: int, steps: int) -> float:
    """Mean bytes per decode step: weights + each slot's KV read (positions 0..pos) + one KV row written."""
    if steps == 0:
        return 0.0
    kv = kv_bytes_per_token(cfg, elem_bytes)
    mean_len = sum(prompt_len + s + 1 for s in range(steps)) / steps  # step s feeds position prompt_len + s
    return weight_bytes_per_step(cfg, elem_bytes) + batch * kv * (mean_len + 1)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read + written (the notes' convention)."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3)


def hybrid_floor_bytes(cfg: ModelConfig, weight_bytes: int, kv, batch: int, prompt_len: int, steps: int) -> float:
    """Mean bytes per decode step of a hybrid model (kv: a HybridCache): the weights as the decoder holds them
    (`weight_bytes`, e.g. packed int4), plus per slot what every GDN layer's pool moves per token (the state read
    once and written once, or once in M tokens with a write-back period M, plus its log; the conv ring read and
    written: StatePool.step_bytes_per_slot), plus the attention layers' KV read over positions 0..pos and one row
    written."""
    if steps == 0:
        return 0.0
    st = kv.state
    attn = [i for i in range(cfg.n_layers) if i not in set(cfg.gdn_layers)]
    elem = kv.kv.k[attn[0]].element_size() if attn else 0
    kv_tok = len(attn) * 2 * cfg.kv_dim * elem
    mean_len = sum(prompt_len + s + 1 for s in range(steps)) / steps
    return weight_bytes + batch * (st.step_bytes_per_slot() + kv_tok * (mean_len + 1))
