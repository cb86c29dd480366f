"""Token embedding: a row gather, out[r] = table[ids[r]]."""
from __future__ import annotations

import torch


def embedding_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ids: [R] int (any device-compatible integer dtype); table: [V, D] -> [R, D] in table's dtype."""
    return table[ids.long()]


# --------------------------------------------------------------------------------------------------
# Triton: grid (rows, column blocks), a plain copy (bitwise equal to the reference; a cast only when
# `out` has another dtype). ids are read on device: no host sync, no allocation when `out` is given.
# Ids must lie in [0, V): they are not checked (that would need a sync or a device assert).

from kernels import pdl
from kernels.triton_compat import tl, triton


@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, D, s_ids, s_table, s_out, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    tok = tl.load(ids_ptr + row * s_ids).to(tl.int64)
    x = tl.load(table_ptr + tok * s_table + cols, mask=mask)
    tl.store(out_ptr + row * s_out + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


def embedding_triton(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [R] (or any shape, flattened to rows) int32/int64 on the table's device; table: [V, D] with a
    contiguous last dim. Returns [R, D] (ids.shape + (D,) when ids has more dims), out's dtype."""
    if table.dim() != 2 or (table.stride(1) != 1 and table.shape[1] > 1):
        raise ValueError(f"table must be [V, D] with a contiguous last dim, got {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    D = table.shape[1]
    shape = tuple(ids.shape) + (D,)
    flat = ids.reshape(-1) if ids.dim() != 1 else ids  # a view for contiguous ids: no copy
    R = flat.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=table.device)
    if out.shape != shape:
        raise ValueError(f"out shape {tuple(out.shape)} != {shape}")
    out2 = out.view(R, D) if out.dim() != 2 else out
    if out2.stride(1) != 1 and D > 1:
        raise ValueError("out must have a contiguous last dim")
    if R == 0 or D == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(D))
    _embedding_kernel[(R, triton.cdiv(D, BLOCK))](flat, table, out2, D, flat.stride(0), table.stride(0), out2.stride(0),
                                                   BLOCK=BLOCK, num_warps=4 if BLOCK >= 512 else 1,
                                                   **pdl.triton_opts(flat.device))
    return out
