"""What a run will hold in memory, estimated before anything is allocated, and the refusal when it cannot fit.

The caches are built on the meta device, so their sizes are the real layouts' (KV, recurrent state, the state log)
without a byte allocated; weights and per-row activations are counted from the model's shapes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepass.engine.config import ModelConfig
from onepass.kernels.errors import ConfigError

MIB = 2**20
HEADROOM = 0.9   # of the free memory: allocator rounding, kernel workspaces, the framework's own buffers


def free_bytes(device: torch.device) -> int:
    """Memory a run on `device` can still take: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def cache_bytes(cfg: ModelConfig, slots: int, ctx: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32,
                writeback: int = 1, spec_k: int = 0, mtp: bool = False) -> int:
    """Bytes of a contiguous KV cache of `slots` slots x `ctx` positions, plus a hybrid model's state pool; with
    speculation (spec_k drafts a step) its draft logs of k + 1 rows, and (mtp) the MTP head's own KV."""
    meta = torch.device("meta")
    if cfg.arch == "qwen35":
        from onepass.engine.state_pool import HybridCache

        cache = HybridCache.create(cfg, slots, ctx, dtype, meta, state_dtype, writeback=writeback)
        if spec_k:
            cache.state.reserve_drafts(spec_k + 1)
        head = 2 * slots * ctx * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize if mtp else 0
        return cache.nbytes + head
    from onepass.engine.kv_cache import ContiguousKVCache

    return ContiguousKVCache(cfg, slots, ctx, dtype, meta).nbytes


def row_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Activations of one row of a step (the fused decoders' buffers) plus its logits, fp32 on the host as well."""
    c, e = cfg, dtype.itemsize
    n = 3 * c.dim + 3 * c.ffn_dim + 2 * c.dim   # residual, h, x; gate_up and act; the gathered and normed row
    if len(c.gdn_layers) < c.n_layers:            # attention layers: fused qkv (+ gate), q and the output
        n += 2 * c.q_dim + 2 * c.kv_dim + 2 * c.q_dim
    if c.gdn_layers:
        n += c.gdn_conv_dim + 2 * c.gdn_value_dim + 2 * c.gdn_v_heads
        n += (c.gdn_conv_dim + c.gdn_value_dim) * 4 // e   # the conv and the core's fp32 outputs
    return n * e + c.vocab_size * (e + 4)


@dataclass(frozen=True)
class MemoryNeed:
    """A run's memory: the weights, `slots` cache slots (the scratch slot among them) and `rows` step rows."""
    weights: int
    slot: int      # one cache slot
    row: int       # one step row
    slots: int
    rows: int

    @property
    def total(self) -> int:
        return self.weights + self.slots * self.slot + self.rows * self.row

    def largest_batch(self, available: int) -> int:
        """The largest batch B (B + 1 slots, B rows a step, or as many per sequence as this need has) whose run
        fits in `available` bytes."""
        per = self.rows // max(self.slots - 1, 1)
        return max(int((available - self.weights - self.slot) // (self.slot + per * self.row)), 0)

    def describe(self) -> str:
        return (f"weights {self.weights / MIB:,.0f} MiB + {self.slots} cache slots x {self.slot / MIB:,.2f} MiB + "
                f"{self.rows} step rows x {self.row / MIB:,.2f} MiB = {self.total / MIB:,.0f} MiB")


def estimate(cfg: ModelConfig, weights: int, batch: int, ctx: int, dtype: torch.dtype, rows: int | None = None,
             state_dtype: torch.dtype = torch.float32, writeback: int = 1, spec_k: int = 0,
             mtp: bool = False) -> MemoryNeed:
    """The need of a batch of `batch` sequences of `ctx` positions (plus the scratch slot), `rows` rows a step
    (default: one per sequence, k + 1 with spec_k drafts a step), over `weights` bytes of weights."""
    one = cache_bytes(cfg, 1, ctx, dtype, state_dtype, writeback, spec_k, mtp)
    rows = batch * (1 + spec_k) if rows is None else rows
    # the MTP head's own step buffers and draft logits (engine/mtp_drafts.py): at most as many rows as the step's
    return MemoryNeed(weights, one, row_bytes(cfg, dtype), batch + 1, rows * (2 if mtp else 1))


def check_fits(need: MemoryNeed, device: torch.device, what: str) -> None:
    """Refuse a run whose estimate exceeds the device's free memory, with the numbers and the batch that would fit."""
    free = free_bytes(device)
    usable = int(free * HEADROOM)
    if need.total <= usable:
        return
    fits = need.largest_batch(usable)
    hint = (f"the largest batch that fits is {fits}: set batch.size={fits} or lower (or a shorter kv_cache.ctx)"
            if fits else "not even one sequence fits: use a smaller model, a shorter kv_cache.ctx or packed weights")
    raise ConfigError(f"{what} needs about {need.total / MIB:,.0f} MiB ({need.describe()}) but {device} has "
                      f"{free / MIB:,.0f} MiB free ({HEADROOM:.0%} of it usable); {hint}")
