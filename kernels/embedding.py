"""Token embedding: a row gather, out[r] = table[ids[r]]. The table is dense, or a PackedWeight kept as the GGUF
stored it (Q4_0 / Q4_1 / Q4_K / Q8_0): then each gathered row is decoded on the fly, so the table holds the file's bytes
on the device rather than a dequantized copy (for a 1B model's 128256 x 2048 table, 525 MB of bf16 against 74 of
Q4_0). A packed row's values are unpack_ref's (q * s exact in fp32, then + c) rounded once to out's dtype: bitwise the
dense table the loader would have made."""
from __future__ import annotations

import torch

from onepass.kernels import pdl
from onepass.kernels.int4_gemm import FMT_CODE, _decode      # the packed layout's format codes and decode
from onepass.kernels.quant_pack import GROUP, PackedWeight, unpack_ref
from onepass.kernels.triton_compat import tl, triton


def embedding_ref(ids: torch.Tensor, table: torch.Tensor | PackedWeight) -> torch.Tensor:
    """ids: [R] int (any device-compatible integer dtype); table: [V, D] -> [R, D] in table's dtype; a PackedWeight
    table -> ids.shape + (D,) float32 (its rows decoded)."""
    if isinstance(table, PackedWeight):
        rows = unpack_ref(table.select_rows(ids.reshape(-1)))
        return rows.reshape(tuple(ids.shape) + (table.K,))
    return table[ids.long()]


# --------------------------------------------------------------------------------------------------
# Triton: grid (rows, column blocks), a plain copy (bitwise equal to the reference; a cast only when
# `out` has another dtype). ids are read on device: no host sync, no allocation when `out` is given.
# Ids must lie in [0, V): they are not checked (that would need a sync or a device assert).


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


def _rows_and_out(ids: torch.Tensor, D: int, dtype: torch.dtype, device, out: torch.Tensor | None):
    """Both gathers' arguments: ids checked and flattened to rows (a view for contiguous ids: no copy); out checked
    (ids.shape + (D,), a contiguous last dim) or allocated in dtype; returns (rows, out, out as [R, D])."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    shape = tuple(ids.shape) + (D,)
    flat = ids.reshape(-1) if ids.dim() != 1 else ids
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape:
        raise ValueError(f"out shape {tuple(out.shape)} != {shape}")
    out2 = out.view(flat.shape[0], D) if out.dim() != 2 else out
    if out2.stride(1) != 1 and D > 1:
        raise ValueError("out must have a contiguous last dim")
    return flat, out, out2


def embedding_triton(ids: torch.Tensor, table: torch.Tensor | PackedWeight,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [R] (or any shape, flattened to rows) int32/int64 on the table's device; table: [V, D] with a
    contiguous last dim, or a PackedWeight (embedding_packed_triton). Returns [R, D] (ids.shape + (D,) when ids has
    more dims), out's dtype."""
    if isinstance(table, PackedWeight):
        return embedding_packed_triton(ids, table, out)
    if table.dim() != 2 or (table.stride(1) != 1 and table.shape[1] > 1):
        raise ValueError(f"table must be [V, D] with a contiguous last dim, got {tuple(table.shape)}")
    D = table.shape[1]
    flat, out, out2 = _rows_and_out(ids, D, table.dtype, table.device, out)
    R = flat.shape[0]
    if R == 0 or D == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(D))
    _embedding_kernel[(R, triton.cdiv(D, BLOCK))](flat, table, out2, D, flat.stride(0), table.stride(0), out2.stride(0),
                                                   BLOCK=BLOCK, num_warps=4 if BLOCK >= 512 else 1,
                                                   **pdl.triton_opts(flat.device))
    return out


# --------------------------------------------------------------------------------------------------
# Triton, packed table: grid (rows, blocks of BLOCK_G groups); each program reads its token's record of each group
# (the packed layout is [G, V] records, so a row's groups lie V records apart) and its scales, and stores the group's
# 32 values. A gather of B rows is B x K / 2 bytes of records: nothing next to the step's weight reads.


@triton.jit
def _embedding_packed_kernel(ids_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, out_ptr, V, G, s_ids, s_out,
                             FMT: tl.constexpr, BLOCK_G: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    WPG: tl.constexpr = 8 if FMT == 3 else 4
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + row * s_ids).to(tl.int64)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = gs < G
    g = tl.where(ok, gs, 0).to(tl.int64)
    V64 = tl.cast(V, tl.int64)
    off = g * V64 + tok
    w = tl.load(qw_ptr + off[:, None] * WPG + tl.arange(0, WPG)[None, :])
    val = _decode(w, off, (g // 8) * V64 + tok, s_ptr, c_ptr, sub_ptr, FMT, BLOCK_G)   # [BLOCK_G, 32]
    ptrs = out_ptr + row * s_out + g[:, None] * 32 + tl.arange(0, 32)[None, :]          # GROUP = 32 values
    if UPCAST:   # interpreter: fp32 out (the caller rounds), its own bf16 cast truncates
        tl.store(ptrs, val, mask=ok[:, None])
    else:
        tl.store(ptrs, val.to(out_ptr.dtype.element_ty), mask=ok[:, None])


_INTERPRETED_PACKED = type(_embedding_packed_kernel).__name__ == "InterpretedFunction"


def embedding_packed_triton(ids: torch.Tensor, table: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids: [R] (or any shape) int32/int64 on the table's device; table: a PackedWeight [V, D]. Returns ids.shape +
    (D,) in out's dtype (float32 when out is None): the rows decoded, bitwise embedding_ref's rounded to that dtype."""
    V, D = table.N, table.K
    flat, out, out2 = _rows_and_out(ids, D, torch.float32, table.device, out)
    R = flat.shape[0]
    if R == 0 or D == 0:
        return out
    G = D // GROUP
    c = table.mins if table.mins is not None else table.scales
    sub = table.sub if table.sub is not None else table.scales
    tgt = out2 if not _INTERPRETED_PACKED or out2.dtype == torch.float32 else torch.empty((R, D), device=out.device)
    BLOCK_G = min(32, triton.next_power_of_2(G))
    _embedding_packed_kernel[(R, triton.cdiv(G, BLOCK_G))](
        flat, table.qweight, table.scales, c, sub, tgt, V, G, flat.stride(0), tgt.stride(0), FMT=FMT_CODE[table.fmt],
        BLOCK_G=BLOCK_G, UPCAST=_INTERPRETED_PACKED, num_warps=4 if BLOCK_G >= 16 else 1,
        **pdl.triton_opts(flat.device))
    if tgt is not out2:
        out2.copy_(tgt)
    return out
