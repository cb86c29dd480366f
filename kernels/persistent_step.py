"""The dense decode step (llama, qwen3) of up to 16 rows as one persistent kernel: every layer in one launch.

A step of the kernel-per-op path (engine/fused_model.py) is about 9 launches a layer; at small batches each pays its
ramp, tail and dependency wait, and a step costs about twice its weight bytes' floor. Here one program per SM walks
the layers through five phases, each a loop over the phase's work items (tiles of output columns, or (row, kv head,
split of the keys) triples), separated by grid barriers on a global counter instead of kernel boundaries:

    ss    per column tile and row: the residual's sum of squares and res * g (the first norm's input; the prologue)
    qkv   rms_norm(res) @ Wqkv^T as ((res * g) @ Wqkv^T) / rms, from that input and the tiles' sums of squares
    attn  per (row, kv head, key split): q/k head norm (qwen3), RoPE, the KV write, causal attention over the split
          of the row's history; a row's splits merged by the last to finish
    o     attn @ Wo^T; res += it; the new tile's sums of squares and res * g of the ffn norm
    ffn   the same norm folding; silu(h @ Wgate^T) * (h @ Wup^T)
    down  act @ Wdown^T; res += it; the tile's input to the next layer's attention norm

A norm needs a whole row; instead of a phase of its own, the phase that writes the residual leaves per-tile sums of
squares (a fixed-order sum, so each row's arithmetic never depends on the other rows: batch invariant) and the tile
times the norm weight, and the consumer scales its sums by the 1/rms the tiles' partials give, after its K loop.
Per-layer tensors come from element-offset tables against layer 0's (every layer's tensors have one shape), so the
engine's own weights and KV cache are used in place.

`mode="phased"` runs the same phase functions as one launch per phase and layer: Triton's interpreter runs programs
one after another, so a grid barrier would never open there; the CPU tests check the phases' math that way, the GPU
tests the persistent launch against it and against the kernel-per-op step.
"""
from __future__ import annotations

import math

import torch

from onepass.kernels import pdl
from onepass.kernels.errors import ConfigError
from onepass.kernels.int4_gemm import FMT_CODE, _expand, _pair_bits, _words_folded, _words_values
from onepass.kernels.quant_pack import PackedWeight
from onepass.kernels.triton_compat import tl, triton

MAX_ROWS = 16          # rows padded to one 16-row tile (tl.dot's smallest M)
BLOCK_N = 32           # weight rows per work item: output columns (gate|up: BLOCK_N // 2 of each), residual tile width
# per-layer offsets: qkv, o, gate_up, down (dense weights, or packed words), attn_norm, ffn_norm, q_norm, k_norm,
# k cache, v cache, then (scales, mins, sub-scales) of qkv, o, gate_up and down (packed weights; else placeholders)
N_TABLE = 22
_N_TABLE = tl.constexpr(N_TABLE)   # the jitted code's copy (a plain global is refused there)
PHASES = ("ss", "qkv", "attn", "o", "ffn", "down")


# ---------------------------------------------------------------------------------------------------------------------
# device functions shared by both launch modes
@triton.jit
def _grid_sync(bar, target, stamp, TIMED: tl.constexpr):
    """Arrive at the grid barrier and wait until `target` arrivals (every program, cumulatively) are counted. TIMED:
    the program stamps the time it arrived (its work done, before the release) at `stamp`. The count is watched by
    an acquire atomic add of 0 (an acquire load timed slower: kernels/PROBES.md)."""
    tl.debug_barrier()                       # every warp's stores issued before the program arrives
    if TIMED:
        tl.store(stamp, _now())
    tl.atomic_add(bar, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


# whether triton.jit compiles (False under TRITON_INTERPRET=1 when triton was imported): inline assembly or not
_COMPILED = tl.constexpr(type(_grid_sync).__name__ != "InterpretedFunction")


@triton.jit
def _cta_sync():
    """Every warp of the program meets here (bar.sync). Compiled, as inline assembly: tl.debug_barrier would keep
    Triton from pipelining the loop it stands in. The interpreter runs no assembly (nor needs the barrier)."""
    if _COMPILED:
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.debug_barrier()


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _rstd(ss, R, eps, DIM: tl.constexpr, BLOCK_N: tl.constexpr, BR: tl.constexpr):
    """1 / rms of each row from the per-tile sums of squares ss [DIM // BLOCK_N, BR], summed in a fixed order."""
    NT: tl.constexpr = DIM // BLOCK_N
    rows = tl.arange(0, BR)
    acc = tl.zeros([BR], tl.float32)
    for t0 in range(0, NT, 64):
        t = t0 + tl.arange(0, 64)
        part = tl.load(ss + t[:, None] * BR + rows[None, :], mask=t[:, None] < NT, other=0.0, cache_modifier=".cg")
        acc += tl.sum(part, axis=0)
    return 1.0 / tl.sqrt(acc / DIM + eps)


@triton.jit
def _norm_input(xg, ss, v, gn, t, R, DIM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """What the next norm needs of residual tile t (v [BR, BN], fp32 of the dtype's values): its sums of squares per
    row into ss[t], and v * g (the next norm's weight gn, rounded to the dtype) into xg: the consuming K loop reads
    that operand as it is and scales its sums by 1/rms after the loop, so no K chunk normalizes anything."""
    rows = tl.arange(0, BR)
    cols = t * BN + tl.arange(0, BN)
    g = tl.load(gn + cols).to(tl.float32)
    tl.store(xg + rows[:, None] * DIM + cols[None, :], (v * g[None, :]).to(xg.dtype.element_ty),
             mask=rows[:, None] < R)
    tl.store(ss + t * BR + rows, tl.sum(v * v, axis=1))


@triton.jit
def _residual_tile(res, ss, xg, gn, acc, t, R, DIM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """res[:, tile t] += acc (rounded to res's dtype first, as the kernel path's GEMM output is); the new tile's norm
    input (_norm_input)."""
    rows = tl.arange(0, BR)
    cols = t * BN + tl.arange(0, BN)
    m = rows[:, None] < R
    p = res + rows[:, None] * DIM + cols[None, :]
    old = tl.load(p, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    new = (old + acc.to(res.dtype.element_ty).to(tl.float32)).to(res.dtype.element_ty)
    tl.store(p, new, mask=m)
    _norm_input(xg, ss, new.to(tl.float32), gn, t, R, DIM, BR, BN)


@triton.jit
def _phase_ss(res, ss, xg, gn, R, pid, nprog, DIM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BR)
    for t in range(pid, DIM // BN, nprog):
        cols = t * BN + tl.arange(0, BN)
        v = tl.load(res + rows[:, None] * DIM + cols[None, :], mask=rows[:, None] < R, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        _norm_input(xg, ss, v, gn, t, R, DIM, BR, BN)


@triton.jit
def _tile_cols(n0, BN: tl.constexpr, PAIR: tl.constexpr):
    """A work item's weight rows: n0..n0+BN, and with PAIR > 0 also PAIR+n0.. (gate and up of a fused gate|up)."""
    if PAIR > 0:
        j = tl.arange(0, 2 * BN)
        cols = tl.where(j < BN, n0 + j, PAIR + n0 + j - BN)
    else:
        cols = n0 + tl.arange(0, BN)
    return cols


@triton.jit
def _narrow_at(p, i, BITS: tl.constexpr):
    """p[i] of a 16- or 8-bit array (4-byte aligned) as the int32 of its bits, read through the 4-byte word holding
    it: Triton's pipeliner copies only loads of 4 bytes or more ahead (cp.async); a narrower one stays in the K loop,
    and every chunk would wait a memory latency for its scales."""
    PER: tl.constexpr = 32 // BITS
    word = tl.load(p.to(tl.pointer_type(tl.int32), bitcast=True) + i // PER)
    return (word >> ((i % PER) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _f16_at(p, i):
    """p[i] of an fp16 array as fp32 (_narrow_at)."""
    return _narrow_at(p, i, 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _packed_chunk(qw, s, c, sub, cols, N, K, k0, x, FMT: tl.constexpr, BK: tl.constexpr):
    """Rows `cols`, columns k0..k0+BK of a packed weight (kernels/quant_pack.py's layout: words [G, N, W], scales by
    (group, row)) in x's dtype; columns past K are 0. A 16-bit x takes the folded values the kernel-per-op step's
    int4 kernels multiply (quant_pack.unpack_folded: each group's scale and offset rounded to x's dtype, then
    q * s + c rounded once; on the GPU one packed fma a pair straight from the word, int4_gemm._words_folded); fp32
    x takes unpack_ref's (q * s exact, then + offset). Scales, mins and Q4_K's sub-scales are read a 4-byte word at
    a time."""
    GPB: tl.constexpr = BK // 32
    W: tl.constexpr = 8 if FMT == 3 else 4
    NC: tl.constexpr = cols.shape[0]
    dt: tl.constexpr = x.dtype.element_ty
    FOLD: tl.constexpr = dt != tl.float32
    g = k0 // 32 + tl.arange(0, GPB)
    ok = (g[None, :] < K // 32) & (cols[:, None] < N)
    rec = tl.where(ok, g[None, :] * N + cols[:, None], 0)          # [NC, GPB] (group, row) records; outside: record 0
    words = tl.load(qw + rec.to(tl.int64)[:, :, None] * W + tl.arange(0, W)[None, None, :])
    if FMT == 2:
        srec = tl.where(ok, (g[None, :] // 8) * N + cols[:, None], 0)
        scale = _f16_at(s, srec) * _narrow_at(sub, rec * 2, 8).to(tl.float32)
        off = -(_f16_at(c, srec) * _narrow_at(sub, rec * 2 + 1, 8).to(tl.float32))
    elif FMT == 1:
        scale = _f16_at(s, rec)
        off = _f16_at(c, rec)
    else:
        scale = _f16_at(s, rec)
        off = scale                                                # unused: no offset
    if FOLD and _COMPILED and FMT != 3:
        if FMT == 0:
            off2 = tl.full((NC, GPB), -2147450880, tl.int32)      # -0 in both halves
        else:
            off2 = _pair_bits(off, x, False)
        vals = _words_folded(words, _pair_bits(scale, x, False), off2, NC, GPB, FMT == 0, dt == tl.float16)
    else:
        if FMT == 3:
            v = _expand(words, FMT, NC, GPB).to(tl.float32)
        else:
            v = _words_values(words, NC, GPB, FMT == 0, False, _COMPILED)
        if FOLD:
            scale = scale.to(dt).to(tl.float32)
            off = off.to(dt).to(tl.float32)
        if FMT == 1 or FMT == 2:
            vals = (v * scale[:, :, None] + off[:, :, None]).to(dt)
        else:
            vals = (v * scale[:, :, None]).to(dt)
    kk = k0 + tl.arange(0, BK)
    return tl.where(kk[None, :] < K, tl.reshape(vals, [NC, BK]), 0.0)


@triton.jit
def _chunk_dot(x, sx, w, ws, wc, wb, cols, N, K, k0, R, IEEE: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
               FMT: tl.constexpr):
    """X[:, k0:k0+BK] @ W[cols, k0:k0+BK]^T in fp32, in x's dtype. W: dense w [N, K] (FMT < 0), or packed in the
    format FMT (int4_gemm.FMT_CODE: words w, scales ws, mins wc, Q4_K sub-scales wb), its values in x's dtype
    (_packed_chunk)."""
    dt = x.dtype.element_ty
    rows = tl.arange(0, BR)
    kk = k0 + tl.arange(0, BK)
    km = kk[None, :] < K
    xv = tl.load(x + rows[:, None] * sx + kk[None, :], mask=(rows[:, None] < R) & km, other=0.0,
                 cache_modifier=".cg")
    if FMT < 0:
        wv = tl.load(w + cols[:, None].to(tl.int64) * K + kk[None, :], mask=(cols[:, None] < N) & km, other=0.0)
    else:
        wv = _packed_chunk(w, ws, wc, wb, cols, N, K, k0, x, FMT, BK)
    return _dot(xv, tl.trans(wv.to(dt)), IEEE)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32 (IEEE: full fp32 products, for fp32 models)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile_gemm(x, sx, w, n0, N, K, R, IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               PAIR: tl.constexpr):
    """One work item of dense weights: [BR, BN] (PAIR: [BR, 2 BN]) fp32 = X @ W[cols]^T over K, its K loop
    double-buffered by hand (chunk k+1's loads issued before chunk k's product, in registers)."""
    cols = _tile_cols(n0, BN, PAIR)
    rows = tl.arange(0, BR)
    acc = tl.zeros([BR, cols.shape[0]], tl.float32)
    rm = rows[:, None] < R
    cm = cols[:, None] < N
    ks = tl.arange(0, BK)
    xp = x + rows[:, None] * sx
    wp = w + cols[:, None].to(tl.int64) * K
    xv = tl.load(xp + ks[None, :], mask=rm & (ks[None, :] < K), other=0.0, cache_modifier=".cg")
    wv = tl.load(wp + ks[None, :], mask=cm & (ks[None, :] < K), other=0.0, eviction_policy="evict_first")
    for k0 in range(0, K, BK):
        kn = k0 + BK + ks
        xn = tl.load(xp + kn[None, :], mask=rm & (kn[None, :] < K), other=0.0, cache_modifier=".cg")
        wn = tl.load(wp + kn[None, :], mask=cm & (kn[None, :] < K), other=0.0, eviction_policy="evict_first")
        acc += _dot(xv, tl.trans(wv), IEEE)
        xv = xn
        wv = wn
    return acc


@triton.jit
def _epilogue(acc, t, R, out, res, ss, xg, gn, KIND: tl.constexpr, NOUT: tl.constexpr, DIM: tl.constexpr,
              BR: tl.constexpr, BN: tl.constexpr):
    """Work item t's result: KIND 0 stored to out [rows, NOUT] (q|k|v); 1 added to the residual (o, down) with the
    tile's input to the next norm, whose weight is gn (_norm_input); 2 gate|up pairs made silu(gate) * up into out
    [rows, NOUT] (swiglu_ref's rounding: each rounded to the dtype first)."""
    rows = tl.arange(0, BR)
    cols = t * BN + tl.arange(0, BN)
    if KIND == 0:
        tl.store(out + rows[:, None] * NOUT + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=(rows[:, None] < R) & (cols[None, :] < NOUT))
    elif KIND == 1:
        _residual_tile(res, ss, xg, gn, acc, t, R, DIM, BR, BN)
    else:
        dt = out.dtype.element_ty
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BR, 2, BN]), [0, 2, 1]))
        gf = gate.to(dt).to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))) * up.to(dt).to(tl.float32)
        tl.store(out + rows[:, None] * NOUT + cols[None, :], a.to(dt), mask=rows[:, None] < R)


@triton.jit
def _unit_done(acc, t, s, R, out, res, ss, xg, gn, part, cnt, KIND: tl.constexpr, NOUT: tl.constexpr,
               DIM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """Split s of item t has its K range's product in acc. With S = 1 it is the item's result; else it is stored to
    part, where q|k|v's splits are left for attention to sum (_qkv_at); of the others', the split that arrives last
    at the item's counter sums all S in split order (a fixed order, so the result never depends on which program
    came last) and finishes the item, then resets the counter for the next layer."""
    if S == 1:
        _epilogue(acc, t, R, out, res, ss, xg, gn, KIND, NOUT, DIM, BR, BN)
    else:
        NC: tl.constexpr = acc.shape[1]
        tile = tl.arange(0, BR)[:, None] * NC + tl.arange(0, NC)[None, :]
        base = part + t * (S * BR * NC)
        tl.store(base + s * (BR * NC) + tile, acc)
        if KIND != 0:
            _cta_sync()                      # every warp's part stored before the program counts itself
            seen = tl.atomic_add(cnt + t, 1, sem="acq_rel", scope="gpu")
            _cta_sync()
            if seen == S - 1:
                tot = tl.zeros_like(acc)
                for j in tl.static_range(S):    # unrolled: a loop inside the K loop would keep it from pipelining
                    tot += tl.load(base + j * (BR * NC) + tile, cache_modifier=".cg")
                tl.atomic_xchg(cnt + t, 0, sem="relaxed", scope="gpu")
                _epilogue(tot, t, R, out, res, ss, xg, gn, KIND, NOUT, DIM, BR, BN)


@triton.jit
def _gemm_phase(x, sx, w, ws, wc, wb, gn, rstd, out, res, ss, xg, part, cnt, R, pid, nprog, N: tl.constexpr,
                K: tl.constexpr, NOUT: tl.constexpr, DIM: tl.constexpr, KIND: tl.constexpr, NORM: tl.constexpr,
                IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                FMT: tl.constexpr, S: tl.constexpr):
    """The cdiv(NOUT, BN) items over the weight w [N, K], each cut into S splits of its K range: the program's units
    u = pid, pid + nprog, .. of items x S (item u // S, split u % S). STAGES = 0: unit by unit, each K loop
    double-buffered by hand (_tile_gemm; S = 1); STAGES > 0: all of them as one loop over (unit, K chunk) left to
    Triton's pipeliner, so STAGES chunks stay in flight across units too (a loop per unit would drain it at every
    unit boundary). NORM: x is the norm input g * res (_norm_input), and each unit's sums are scaled by 1/rms
    (rstd) after its K range; o and down leave the next norm's input in xg (norm weight gn)."""
    PAIR: tl.constexpr = NOUT if KIND == 2 else 0
    NT: tl.constexpr = (NOUT + BN - 1) // BN
    if STAGES > 0:
        KCH: tl.constexpr = (K // S + BK - 1) // BK
        acc = tl.zeros([BR, _tile_cols(0, BN, PAIR).shape[0]], tl.float32)
        for i in tl.range(0, (NT * S - pid + nprog - 1) // nprog * KCH, num_stages=STAGES):
            u = pid + (i // KCH) * nprog
            t = u // S
            acc += _chunk_dot(x, sx, w, ws, wc, wb, _tile_cols(t * BN, BN, PAIR), N, K,
                              (u % S) * (K // S) + (i % KCH) * BK, R, IEEE, BR, BK, FMT)
            if i % KCH == KCH - 1:
                if NORM:
                    acc = acc * rstd[:, None]
                _unit_done(acc, t, u % S, R, out, res, ss, xg, gn, part, cnt, KIND, NOUT, DIM, BR, BN, S)
                acc = tl.zeros_like(acc)
    else:
        for t in range(pid, NT, nprog):
            acc = _tile_gemm(x, sx, w, t * BN, N, K, R, IEEE, BR, BN, BK, PAIR)
            if NORM:
                acc = acc * rstd[:, None]
            _epilogue(acc, t, R, out, res, ss, xg, gn, KIND, NOUT, DIM, BR, BN)


@triton.jit
def _phase_qkv(xg, ss, qkv, w, ws, wc, wb, part, cnt, R, eps, pid, nprog, DIM: tl.constexpr, NQKV: tl.constexpr,
               IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               FMT: tl.constexpr, S: tl.constexpr):
    rstd = _rstd(ss, R, eps, DIM, BN, BR)
    _gemm_phase(xg, DIM, w, ws, wc, wb, None, rstd, qkv, None, ss, xg, part, cnt, R, pid, nprog, NQKV, DIM, NQKV, DIM,
                0, True, IEEE, BR, BN, BK, STAGES, FMT, S)


@triton.jit
def _head_norm_rope(a, b, nw, c, s, eps, D: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads' halves a, b [heads, D/2] (the dtype's values): each head's RMSNorm (qwen3), then rotate-half RoPE with
    c, s [1, D/2]; each step rounded to the dtype as the references are."""
    dt = a.dtype
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    if QK_NORM:
        HALF: tl.constexpr = D // 2
        d2 = tl.arange(0, HALF)
        r = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)
        wa = tl.load(nw + d2).to(tl.float32)
        wb = tl.load(nw + HALF + d2).to(tl.float32)
        a = ((a * r[:, None]) * wa[None, :]).to(dt).to(tl.float32)
        b = ((b * r[:, None]) * wb[None, :]).to(dt).to(tl.float32)
    return (a * c - b * s).to(dt), (b * c + a * s).to(dt)


@triton.jit
def _qkv_at(qkv, part, r, cols, mask, NQKV: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """Row r's q|k|v values at columns cols: from qkv, or with the phase cut in S > 1 splits, the splits' partial
    products (_unit_done's layout) summed in split order and rounded to the dtype, as the last split would have."""
    if S == 1:
        return tl.load(qkv + r * NQKV + cols, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        base = part + (cols // BN) * (S * BR * BN) + r * BN + cols % BN
        tot = tl.zeros(cols.shape, tl.float32)
        for j in tl.static_range(S):
            tot += tl.load(base + j * (BR * BN), mask=mask, other=0.0, cache_modifier=".cg")
        return tot.to(qkv.dtype.element_ty)


@triton.jit
def _attn_chunk(length, TS: tl.constexpr, AK: tl.constexpr, BNA: tl.constexpr):
    """Keys a split of a row of `length` keys takes, and into how many splits the row is cut: at most TS (fixed by
    the program count, so one row's (kv head, split) units can fill the programs), each of AK keys or more (a split
    costs its own q, its share of the KV write and a merge), a multiple of BNA. A function of the row's own length:
    rows stay batch invariant."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, TS), BNA) * BNA, AK)
    return chunk, tl.cdiv(length, chunk)


@triton.jit
def _phase_attn(qkv, part, attn, ao, al, cnt, kc, vc, qn, kn, rope, positions, slots, bt, bt_stride, block_size,
                kc_s0, kc_s1, kc_s2, R, eps, scale, pid, nprog,
                H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, GB: tl.constexpr, GP: tl.constexpr,
                PAGED: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr, BNA: tl.constexpr, TS: tl.constexpr,
                AK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, S: tl.constexpr):
    """Per (row, kv head, split of the row's keys): the group's q heads and the kv head normed (qwen3) and roped, the
    k and v of the step's rows whose positions fall in the split written to the cache at their (slot, position),
    then the fp32 online softmax(q k^T * scale) v over the split's keys. A row of one split stores its output; of
    several, each split stores its normalized partial and log-sum-exp (ao, al), and the split that arrives last at
    the (row, kv head) counter merges them (_merge_splits: a fixed order), so the output never depends on which came
    last. Rows of a negative slot (padding) write zeros and touch no cache. q, k, v come from the q|k|v phase's S
    splits (_qkv_at): summed here, that phase needs no counters."""
    HALF: tl.constexpr = D // 2
    G: tl.constexpr = H // KVH
    NQKV: tl.constexpr = (H + 2 * KVH) * D
    d2 = tl.arange(0, HALF)
    dd = tl.arange(0, D)
    gi = tl.arange(0, GB)
    gm = gi < G
    NI = R * KVH
    # units split-major: the rows' first splits spread over the programs before any row's second
    rr = tl.arange(0, BR)
    _, ns_all = _attn_chunk(tl.load(positions + rr, mask=rr < R, other=0) + 1, TS, AK, BNA)
    ns_all = tl.where(tl.load(slots + rr, mask=rr < R, other=-1) >= 0, ns_all, 1)   # padding: one unit, zeros
    for u in range(pid, tl.max(ns_all) * NI, nprog):
        sp = u // NI
        it = u % NI
        r = it // KVH
        g = it % KVH
        slot = tl.load(slots + r)
        pos = tl.load(positions + r)
        chunk, ns = _attn_chunk(pos + 1, TS, AK, BNA)
        out = attn + r * (H * D) + (g * G + gi[:, None]) * D
        if slot < 0:
            if sp == 0:
                zero = tl.zeros([GB, D], tl.float32).to(attn.dtype.element_ty)
                tl.store(out + dd[None, :], zero, mask=gm[:, None])
        elif sp < ns:
            lo = sp * chunk
            hi = tl.minimum(lo + chunk, pos + 1)
            c = tl.load(rope + pos * D + d2)[None, :]
            s = tl.load(rope + pos * D + HALF + d2)[None, :]
            qc = (g * G + gi[:, None]) * D + d2[None, :]
            qa = _qkv_at(qkv, part, r, qc, gm[:, None], NQKV, BR, BN, S)
            qb = _qkv_at(qkv, part, r, qc + HALF, gm[:, None], NQKV, BR, BN, S)
            qa, qb = _head_norm_rope(qa, qb, qn, c, s, eps, D, QK_NORM)
            # k and v of every row of this slot whose position is in the split: a step may hold several rows of one
            # slot (a prompt's), whose units all write the same bits there, so none waits for another
            for r2 in range(0, R):
                s2 = tl.load(slots + r2)
                p2 = tl.load(positions + r2)
                if (s2 == slot) & (p2 >= lo) & (p2 < hi):
                    kcol = (H + g) * D + d2[None, :]
                    every = kcol >= 0
                    c2 = tl.load(rope + p2 * D + d2)[None, :]
                    s2n = tl.load(rope + p2 * D + HALF + d2)[None, :]
                    ka, kb = _head_norm_rope(_qkv_at(qkv, part, r2, kcol, every, NQKV, BR, BN, S),
                                             _qkv_at(qkv, part, r2, kcol + HALF, every, NQKV, BR, BN, S), kn, c2,
                                             s2n, eps, D, QK_NORM)
                    if PAGED:
                        blk = tl.load(bt + slot * bt_stride + p2 // block_size)
                        at = blk * kc_s0 + (p2 % block_size) * kc_s1 + g * kc_s2
                    else:
                        at = slot * kc_s0 + p2 * kc_s1 + g * kc_s2
                    tl.store(kc + at + d2[None, :], ka)
                    tl.store(kc + at + HALF + d2[None, :], kb)
                    vcol = kcol + KVH * D
                    tl.store(vc + at + d2[None, :], _qkv_at(qkv, part, r2, vcol, every, NQKV, BR, BN, S))
                    tl.store(vc + at + HALF + d2[None, :], _qkv_at(qkv, part, r2, vcol + HALF, every, NQKV, BR, BN,
                                                                   S))
            tl.debug_barrier()               # the k, v just written are read back below by the program's other warps
            # the group's heads as one [GB, D] tile, scores and values as tl.dots (GB >= 16 rows, tl.dot's least)
            q = tl.reshape(tl.permute(tl.join(qa, qb), [0, 2, 1]), [GB, D])
            m_i = tl.full([GB], float("-inf"), tl.float32)
            l_i = tl.zeros([GB], tl.float32)
            acc = tl.zeros([GB, D], tl.float32)
            for n0 in range(lo, hi, BNA):
                keys = n0 + tl.arange(0, BNA)
                valid = keys < hi
                if PAGED:
                    blks = tl.load(bt + slot * bt_stride + keys // block_size, mask=valid, other=0)
                    base = blks * kc_s0 + (keys % block_size) * kc_s1 + g * kc_s2
                else:
                    base = slot * kc_s0 + keys * kc_s1 + g * kc_s2
                km = valid[:, None]
                k = tl.load(kc + base[:, None] + dd[None, :], mask=km, other=0.0, cache_modifier=".cg")
                v = tl.load(vc + base[:, None] + dd[None, :], mask=km, other=0.0, cache_modifier=".cg")
                sc = _dot(q, tl.trans(k), IEEE)
                sc = tl.where(valid[None, :], sc * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
                m_i = m_new
            if ns == 1:
                tl.store(out + dd[None, :], (acc / l_i[:, None]).to(attn.dtype.element_ty), mask=gm[:, None])
            else:
                pb = it * TS + sp
                tl.store(ao + (pb * G + gi[:, None]) * D + dd[None, :], acc / l_i[:, None], mask=gm[:, None])
                tl.store(al + pb * G + gi, m_i + tl.log(l_i), mask=gm)
                _cta_sync()                  # every warp's partial stored before the program counts itself
                seen = tl.atomic_add(cnt + it, 1, sem="acq_rel", scope="gpu")
                _cta_sync()
                if seen == ns - 1:
                    _merge_splits(ao, al, attn + r * (H * D) + g * G * D, it * TS, ns, G, GP, D, TS)
                    tl.atomic_xchg(cnt + it, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits(ao, al, out, pb, ns, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, TS: tl.constexpr):
    """The ns splits' partial outputs (ao, records pb..pb + ns) weighed by exp of their log-sum-exps (al) into the G
    heads' rows [G, D] at out: every split's partial read at once (a loop over the splits would wait a round trip to
    L2 for each), summed over the splits in the compiled reduction's fixed order."""
    j = tl.arange(0, TS)
    h = tl.arange(0, GP)
    dd = tl.arange(0, D)
    m2 = (j[:, None] < ns) & (h[None, :] < G)
    lse = tl.load(al + (pb + j[:, None]) * G + h[None, :], mask=m2, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(ao + ((pb + j[:, None, None]) * G + h[None, :, None]) * D + dd[None, None, :],
                   mask=m2[:, :, None], other=0.0, cache_modifier=".cg")
    w = tl.exp(lse - tl.max(lse, axis=0)[None, :])        # 0 for the masked splits
    o = tl.sum(w[:, :, None] * part, axis=0) / tl.sum(w, axis=0)[:, None]
    tl.store(out + h[:, None] * D + dd[None, :], o.to(out.dtype.element_ty), mask=h[:, None] < G)


@triton.jit
def _phase_o(attn, res, ss, xg, gn, w, ws, wc, wb, part, cnt, R, pid, nprog, DIM: tl.constexpr, QD: tl.constexpr,
             IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
             FMT: tl.constexpr, S: tl.constexpr):
    _gemm_phase(attn, QD, w, ws, wc, wb, gn, None, res, res, ss, xg, part, cnt, R, pid, nprog, DIM, QD, DIM, DIM, 1,
                False, IEEE, BR, BN, BK, STAGES, FMT, S)


@triton.jit
def _phase_ffn(xg, ss, act, w, ws, wc, wb, part, cnt, R, eps, pid, nprog, DIM: tl.constexpr, F: tl.constexpr,
               IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               FMT: tl.constexpr, S: tl.constexpr):
    """act = silu(gate) * up with gate, up the h @ W^T tiles of the fused gate|up weight [2F, DIM]: an item's BN
    weight rows are BN // 2 of gate and the same columns of up."""
    rstd = _rstd(ss, R, eps, DIM, BN, BR)
    _gemm_phase(xg, DIM, w, ws, wc, wb, None, rstd, act, None, ss, xg, part, cnt, R, pid, nprog, 2 * F, DIM, F, DIM,
                2, True, IEEE, BR, BN // 2, BK, STAGES, FMT, S)


@triton.jit
def _phase_down(act, res, ss, xg, gn, w, ws, wc, wb, part, cnt, R, pid, nprog, DIM: tl.constexpr, F: tl.constexpr,
                IEEE: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                FMT: tl.constexpr, S: tl.constexpr):
    _gemm_phase(act, F, w, ws, wc, wb, gn, None, res, res, ss, xg, part, cnt, R, pid, nprog, DIM, F, DIM, DIM, 1,
                False, IEEE, BR, BN, BK, STAGES, FMT, S)


# ---------------------------------------------------------------------------------------------------------------------
# the two launch modes
@triton.jit
def _at(base, offs, j, AL: tl.constexpr):
    """base + offs[j], the offset known to be a multiple of AL elements: without that, Triton cannot prove a layer
    tensor's alignment and reads it 2 bytes a load."""
    return base + tl.multiple_of(tl.load(offs + j), AL)


@triton.jit
def _packed_at(s, c, b, o, j, AL: tl.constexpr, FMT: tl.constexpr):
    """A packed projection's scales, mins and sub-scales in this layer (offsets j, j + 1, j + 2); dense weights have
    none, and their placeholders are never read, so no offset is loaded for them."""
    if FMT >= 0:
        return _at(s, o, j, AL), _at(c, o, j + 1, AL), _at(b, o, j + 2, AL)
    else:
        return s, c, b


@triton.jit
def _barrier(bar, n, nb, nprog, clock, pid, TIMED: tl.constexpr):
    """Grid barrier number n of nb (every program's n-th arrival); with TIMED each program stamps the time it
    arrived at clock[1, n - 1, pid] and the time it left at clock[0, n - 1, pid] (clock: [2, nb, nprog])."""
    _grid_sync(bar, n * nprog, clock + (nb + n - 1) * nprog + pid, TIMED)
    if TIMED:
        tl.store(clock + (n - 1) * nprog + pid, _now())
    return n + 1


@triton.jit
def _barriers_only(bar, clock, NB: tl.constexpr, PDL: tl.constexpr = False):
    """NB grid barriers with nothing between them, every one stamped as the step's are (_barrier): what the
    barrier alone costs on this many programs."""
    pdl.enter(PDL)  # kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = 1
    for _ in range(NB):
        n = _barrier(bar, n, NB, nprog, clock, pid, True)


@triton.jit
def _persistent_step(res, ss, xg, qkv, attn, act, part, ao, al, cnt, bar, clock, offs, w_qkv, w_o, w_gu, w_down,
                     n_attn, n_ffn, n_q, n_k, kc, vc, s_qkv, c_qkv, b_qkv, s_o, c_o, b_o, s_gu, c_gu, b_gu, s_down,
                     c_down, b_down, rope, positions, slots, bt, bt_stride, block_size, kc_s0, kc_s1, kc_s2, R, L, eps,
                     scale,
                     DIM: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                     GB: tl.constexpr, GP: tl.constexpr, PAGED: tl.constexpr, QK_NORM: tl.constexpr,
                     IEEE: tl.constexpr, TS: tl.constexpr, AK: tl.constexpr, TIMED: tl.constexpr, BR: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, BNA: tl.constexpr,
                     STAGES: tl.constexpr, FMT: tl.constexpr, AL: tl.constexpr, S_QKV: tl.constexpr,
                     S_O: tl.constexpr, S_GU: tl.constexpr, S_DOWN: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NQKV: tl.constexpr = (H + 2 * KVH) * D
    QD: tl.constexpr = H * D
    _phase_ss(res, ss, xg, _at(n_attn, offs, 4, AL), R, pid, nprog, DIM, BR, BN)
    NB = 1 + 5 * L     # barriers in the step
    n = _barrier(bar, 1, NB, nprog, clock, pid, TIMED)
    for layer in range(L):
        # the layer's tensors, their offsets loaded here together rather than one at the start of each phase
        # (after a barrier, behind its acquire)
        o = offs + layer * _N_TABLE
        wq, wo, wgu, wd = _at(w_qkv, o, 0, AL), _at(w_o, o, 1, AL), _at(w_gu, o, 2, AL), _at(w_down, o, 3, AL)
        nf, nq, nk = _at(n_ffn, o, 5, AL), _at(n_q, o, 6, AL), _at(n_k, o, 7, AL)
        kl, vl = _at(kc, o, 8, AL), _at(vc, o, 9, AL)
        # the next layer's attention norm (the last layer's own: the LM head normalizes the residual itself)
        gn = _at(n_attn, offs + tl.minimum(layer + 1, L - 1) * _N_TABLE, 4, AL)
        sq, cq, bq = _packed_at(s_qkv, c_qkv, b_qkv, o, 10, AL, FMT)
        so, co, bo = _packed_at(s_o, c_o, b_o, o, 13, AL, FMT)
        sg, cg, bg = _packed_at(s_gu, c_gu, b_gu, o, 16, AL, FMT)
        sd, cd, bd = _packed_at(s_down, c_down, b_down, o, 19, AL, FMT)
        _phase_qkv(xg, ss, qkv, wq, sq, cq, bq, part, cnt, R, eps, pid, nprog, DIM, NQKV, IEEE, BR, BN, BK, STAGES,
                   FMT, S_QKV)
        n = _barrier(bar, n, NB, nprog, clock, pid, TIMED)
        _phase_attn(qkv, part, attn, ao, al, cnt, kl, vl, nq, nk, rope, positions, slots, bt, bt_stride, block_size,
                    kc_s0, kc_s1, kc_s2, R, eps, scale, pid, nprog, H, KVH, D, GB, GP, PAGED, QK_NORM, IEEE, BNA, TS,
                    AK, BR, BN, S_QKV)
        n = _barrier(bar, n, NB, nprog, clock, pid, TIMED)
        _phase_o(attn, res, ss, xg, nf, wo, so, co, bo, part, cnt, R, pid, nprog, DIM, QD, IEEE, BR, BN, BK, STAGES,
                 FMT, S_O)
        n = _barrier(bar, n, NB, nprog, clock, pid, TIMED)
        _phase_ffn(xg, ss, act, wgu, sg, cg, bg, part, cnt, R, eps, pid, nprog, DIM, F, IEEE, BR, BN, BK, STAGES, FMT,
                   S_GU)
        n = _barrier(bar, n, NB, nprog, clock, pid, TIMED)
        _phase_down(act, res, ss, xg, gn, wd, sd, cd, bd, part, cnt, R, pid, nprog, DIM, F, IEEE, BR, BN, BK, STAGES,
                    FMT, S_DOWN)
        n = _barrier(bar, n, NB, nprog, clock, pid, TIMED)


@triton.jit
def _one_phase(res, ss, xg, qkv, attn, act, part, ao, al, cnt, w, ws, wc, wb, nw, kc, vc, n_q, n_k, rope, positions,
               slots, bt, bt_stride, block_size, kc_s0, kc_s1, kc_s2, R, eps, scale, PHASE: tl.constexpr,
               DIM: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
               GB: tl.constexpr, GP: tl.constexpr, PAGED: tl.constexpr, QK_NORM: tl.constexpr, IEEE: tl.constexpr,
               TS: tl.constexpr, AK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               BNA: tl.constexpr,
               STAGES: tl.constexpr, FMT: tl.constexpr, S: tl.constexpr, PDL: tl.constexpr = False):
    """Phase PHASE of one layer (nw: the norm weight whose input the phase leaves: ss, o and down)."""
    pdl.enter(PDL)  # kernels/pdl.py
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PHASE == 0:
        _phase_ss(res, ss, xg, nw, R, pid, nprog, DIM, BR, BN)
    elif PHASE == 1:
        _phase_qkv(xg, ss, qkv, w, ws, wc, wb, part, cnt, R, eps, pid, nprog, DIM, (H + 2 * KVH) * D, IEEE,
                   BR, BN, BK, STAGES, FMT, S)
    elif PHASE == 2:
        _phase_attn(qkv, part, attn, ao, al, cnt, kc, vc, n_q, n_k, rope, positions, slots, bt, bt_stride,
                    block_size, kc_s0, kc_s1, kc_s2, R, eps, scale, pid, nprog, H, KVH, D, GB, GP, PAGED,
                    QK_NORM, IEEE, BNA, TS, AK, BR, BN, S)  # S: the q|k|v phase's splits
    elif PHASE == 3:
        _phase_o(attn, res, ss, xg, nw, w, ws, wc, wb, part, cnt, R, pid, nprog, DIM, H * D, IEEE, BR, BN, BK,
                 STAGES, FMT, S)
    elif PHASE == 4:
        _phase_ffn(xg, ss, act, w, ws, wc, wb, part, cnt, R, eps, pid, nprog, DIM, F, IEEE, BR, BN, BK, STAGES, FMT, S)
    else:
        _phase_down(act, res, ss, xg, nw, w, ws, wc, wb, part, cnt, R, pid, nprog, DIM, F, IEEE, BR, BN, BK, STAGES,
                    FMT, S)


# ---------------------------------------------------------------------------------------------------------------------
PROJECTIONS = ("qkv", "o", "gate_up", "down")
DENSE_FORM = dict(block_k=256, stages=4, num_warps=4)    # block_k halved for fp32 weights
PACKED_FORM = dict(block_k=256, stages=4, num_warps=4)
ATTN_KEYS = 512       # the fewest keys a split of a row's keys takes (_attn_chunk)
MAX_ATTN_SPLITS = 16  # the most splits a row's keys are cut into (their partials are merged in one read)
BALANCE = 90   # a GEMM phase's K range is cut until its units fill this percentage of the programs' rounds (_splits)


_TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                 torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8"}


# the settings a form of the step is made of (PersistentStep's keyword arguments of that name; engine.persistent_form)
FORM_SETTINGS = ("block_k", "num_warps", "block_n_attn", "attn_keys", "stages", "balance", "per_sm")


def parse_form(text: str) -> dict[str, int]:
    """'block_k=512,stages=3' -> {'block_k': 512, 'stages': 3} ('' -> {}: every setting its default). Settings outside
    FORM_SETTINGS, or not integers, are refused by name; whether a form compiles is PersistentStep's to check."""
    out = {}
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key not in FORM_SETTINGS or not eq:
            raise ConfigError(f"persistent step form {text!r}: {item!r} is not one of "
                              f"{', '.join(k + '=<int>' for k in FORM_SETTINGS)}")
        try:
            out[key] = int(value)
        except ValueError:
            raise ConfigError(f"persistent step form {text!r}: {key} takes an integer, got {value!r}") from None
    return out


def _data(w) -> torch.Tensor:
    return w.qweight if isinstance(w, PackedWeight) else w


def _part(w, part: str) -> torch.Tensor:
    """A packed weight's scales / mins / sub-scales; for what it lacks (and dense weights), a tensor of the list's
    kind that the kernel never reads."""
    if not isinstance(w, PackedWeight):
        return w
    return getattr(w, part) if getattr(w, part) is not None else w.scales


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _splits(items: int, K: int, block_k: int, programs: int, balance: int) -> int:
    """Into how many K ranges a GEMM phase's items are cut: the least power of two at which the units (items x
    splits) fill `balance` percent or more of the programs' rounds (64 items on 132 programs fill 48%; cut in two,
    97%), every range whole K chunks. Cutting costs each unit a partial product's store and load, so no further than
    that. 1: uncut."""
    def fill(s: int) -> float:
        units = items * s
        return units / (-(-units // programs) * programs)

    s = 1
    if balance > 0 and K % block_k == 0:
        while fill(s) * 100 < balance and (K // block_k) % (2 * s) == 0:
            s *= 2
    return s


def programs_an_sm_holds(n_regs: int, shared: int, num_warps: int, props) -> int:
    """How many programs of a kernel one SM holds at once (props: torch's device properties): by registers (allocated
    256 a warp, each warp from one quarter of the register file), by shared memory (1 KB reserved a block) and by
    threads."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = 4 * ((props.regs_per_multiprocessor // 4) // warp_regs) // num_warps
    by_smem = props.shared_memory_per_multiprocessor // (shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return min(by_regs, by_smem, by_threads)


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's element offset from the first (all of one dtype): the kernel adds it to the first's pointer."""
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    out = []
    for t in tensors:
        delta = t.data_ptr() - base
        if delta % size:
            raise ConfigError(f"persistent step: a layer tensor is not aligned to its element size ({size} B)")
        out.append(delta // size)
    return out


class PersistentStep:
    """The whole-layer-stack decode step of a dense FusedDecoder over up to MAX_ROWS rows, in place of its
    kernel-per-op `hidden`. Built once per (model, KV cache): it reads the model's weights and the cache's tensors
    where they are. `unsupported(model, kv)` says why a model cannot take it (None: it can)."""

    def __init__(self, model, kv, *, mode: str = "persistent", programs: int | None = None,
                 block_k: int | None = None, block_n_attn: int = 32, attn_keys: int = ATTN_KEYS,
                 num_warps: int | None = None, stages: int | None = None, balance: int = BALANCE, per_sm: int = 1,
                 timed: bool = False):
        """per_sm programs an SM (programs: another count, for the phased launches): every program must be resident
        at once, or a barrier never opens, so the first launch checks that the compiled kernel's registers and shared
        memory let per_sm programs share an SM (_check_resident). The GEMM phases' K loop: block_k, num_warps,
        stages (0: item by item, each K loop double-buffered by hand; 2 or more: one loop over all of a program's
        (unit, K chunk) pairs, left to Triton's pipeliner with that many stages), balance (how evenly the K splits
        must spread a phase's units over the programs, in percent: _splits; 0: no split); block_n_attn: keys an
        attention step reads; attn_keys: the fewest keys a split of a row's keys takes (_attn_chunk; a multiple of
        block_n_attn; more than the context: never split).
        Defaults: DENSE_FORM, PACKED_FORM (kernels/PROBES.md has what picked them)."""
        why = self.unsupported(model, kv)
        if why:
            raise ConfigError(f"persistent step: {why}; use engine.step=kernels for this model")
        self.fmt = self.weight_format(model)
        form = DENSE_FORM if self.fmt < 0 else PACKED_FORM
        if block_k is None:   # a chunk of the same bytes in fp32, so its stages fit in shared memory
            block_k = form["block_k"] // (2 if model.dtype == torch.float32 else 1)
        stages = form["stages"] if stages is None else stages
        num_warps = form["num_warps"] if num_warps is None else num_warps
        if stages == 1 or stages < 0:
            raise ConfigError(f"persistent step: stages={stages}; 0 (by hand) or >= 2 (a pipelined loop)")
        if self.fmt >= 0 and (stages < 2 or block_k % 32):
            raise ConfigError(f"persistent step: packed weights are read in whole 32-weight groups by the pipelined "
                              f"K loop: block_k must be a multiple of 32 and stages >= 2 (got {block_k}, {stages})")
        if mode not in ("persistent", "phased"):
            raise ConfigError(f"persistent step mode must be persistent or phased, got {mode!r}")
        c = model.cfg
        self.model, self.kv, self.mode, self.timed = model, kv, mode, timed
        self.block_k, self.block_n_attn, self.num_warps = block_k, block_n_attn, num_warps
        self.stages = stages
        dev, dt = model.embed.device, model.dtype
        if per_sm < 1:
            raise ConfigError(f"persistent step: per_sm={per_sm}; give 1 or more programs an SM")
        if programs is None:
            programs = per_sm * (torch.cuda.get_device_properties(dev).multi_processor_count
                                 if dev.type == "cuda" else 4)
        self.programs, self.per_sm = programs, per_sm
        L = c.n_layers
        lay = model.layers
        self.qk_norm = lay[0]["q_norm"] is not None
        proj = {name: [x[name].weights[0] for x in lay] for name in PROJECTIONS}
        cols = {
            **{name: [_data(w) for w in ws] for name, ws in proj.items()},
            "attn_norm": [x["attn_norm"] for x in lay], "ffn_norm": [x["ffn_norm"] for x in lay],
            "q_norm": [x["q_norm"] if self.qk_norm else x["attn_norm"] for x in lay],
            "k_norm": [x["k_norm"] if self.qk_norm else x["attn_norm"] for x in lay],
            "k": list(kv.k), "v": list(kv.v),
        }
        for name, ws in proj.items():   # a packed weight's scales, mins, sub-scales (scales stand in for absent ones)
            for part in ("scales", "mins", "sub"):
                cols[f"{name}.{part}"] = [_part(w, part) for w in ws]
                if self.fmt >= 0 and any(t.data_ptr() % 4 for t in cols[f"{name}.{part}"]):
                    raise ConfigError(f"persistent step: a packed {name} weight's {part} is not 4-byte aligned (the "
                                      "kernel reads them a word at a time); use engine.step=kernels")
        self.layer0 = {name: ts[0] for name, ts in cols.items()}
        self.tensors = cols   # kept: the offsets point into them
        self.offs = torch.tensor([_offsets(ts) for ts in cols.values()], dtype=torch.int64).T.contiguous().to(dev)
        assert self.offs.shape == (L, N_TABLE)
        # the largest power of two (up to 16) dividing every offset: the kernel's alignment hint (_at)
        g = math.gcd(*self.offs.flatten().tolist())
        self.align = min(g & -g, 16) if g else 16
        self.ss = torch.zeros(c.dim // BLOCK_N, MAX_ROWS, dtype=torch.float32, device=dev)
        self.xg = torch.zeros(MAX_ROWS, c.dim, dtype=dt, device=dev)     # the next norm's input (_norm_input)
        self.qkv = torch.zeros(MAX_ROWS, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, dtype=dt, device=dev)
        self.attn = torch.zeros(MAX_ROWS, c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.act = torch.zeros(MAX_ROWS, c.ffn_dim, dtype=dt, device=dev)
        # each GEMM phase's K splits (the hand-buffered loop runs whole items), and the splits' partial products and
        # arrival counters (_unit_done)
        items = {"qkv": (c.n_heads + 2 * c.n_kv_heads) * c.head_dim // BLOCK_N, "o": c.dim // BLOCK_N,
                 "gate_up": c.ffn_dim // (BLOCK_N // 2), "down": c.dim // BLOCK_N}
        depth = {"qkv": c.dim, "o": c.n_heads * c.head_dim, "gate_up": c.dim, "down": c.ffn_dim}
        self.splits = {p: _splits(n, depth[p], block_k, programs, balance if stages else 0) for p, n in items.items()}
        self.part = torch.zeros(max(n * self.splits[p] for p, n in items.items()) * MAX_ROWS * BLOCK_N,
                                dtype=torch.float32, device=dev)
        # attention's key splits (_attn_chunk): their partial outputs and log-sum-exps, merged by the last to arrive
        # at the (row, kv head) counter
        if attn_keys < block_n_attn or attn_keys % block_n_attn:
            raise ConfigError(f"persistent step: attn_keys={attn_keys}; give a multiple of block_n_attn "
                              f"({block_n_attn})")
        self.attn_keys = attn_keys
        # splits at most: programs // kv heads (one row's units fill the programs), a power of two (merged as a tile)
        self.attn_ts = min(MAX_ATTN_SPLITS, 1 << (max(1, programs // c.n_kv_heads).bit_length() - 1))
        units = MAX_ROWS * c.n_kv_heads * self.attn_ts * (c.n_heads // c.n_kv_heads)
        self.ao = torch.zeros(units * c.head_dim, dtype=torch.float32, device=dev)
        self.al = torch.zeros(units, dtype=torch.float32, device=dev)
        self.cnt = torch.zeros(max(*items.values(), MAX_ROWS * c.n_kv_heads), dtype=torch.int32, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        # _barrier's stamps: [exits, arrivals] x barriers x programs
        self.clock = torch.zeros(2, 1 + 5 * L, programs, dtype=torch.int64, device=dev)
        self.compiled = None    # the persistent kernel, once launched

    @staticmethod
    def weight_format(model) -> int:
        """The projections' packed format (int4_gemm.FMT_CODE), or -1 for dense weights."""
        w = model.layers[0]["qkv"].weights[0]
        return FMT_CODE[w.fmt] if isinstance(w, PackedWeight) else -1

    @staticmethod
    def unsupported(model, kv) -> str | None:
        c = model.cfg
        if c.arch not in ("llama", "qwen3"):
            return f"architecture {c.arch!r} (it runs llama and qwen3)"
        kinds = set()
        for layer in model.layers:
            for name in PROJECTIONS:
                ws = layer[name].weights
                if len(ws) != 1:
                    return f"a {name} projection of {len(ws)} parts (mixed formats dequantized apart)"
                kinds.add(ws[0].fmt if isinstance(ws[0], PackedWeight) else "dense")
        if len(kinds) > 1:
            return (f"projections of several formats ({', '.join(sorted(kinds))}): it reads one packed format, or "
                    "dense weights, throughout")
        if c.dim % BLOCK_N or c.ffn_dim % BLOCK_N:
            return f"dim {c.dim} and ffn_dim {c.ffn_dim} must be multiples of {BLOCK_N}"
        if c.head_dim & (c.head_dim - 1) or c.head_dim < 16:
            return f"head_dim {c.head_dim} is not a power of two of at least 16"
        if c.n_heads % c.n_kv_heads:
            return f"{c.n_heads} heads over {c.n_kv_heads} kv heads"
        return None

    def _args(self, positions, slots, block_table):
        kc0 = self.layer0["k"]
        paged = block_table is not None
        bt = block_table if paged else slots
        return dict(rope=self.model.rope, positions=positions, slots=slots, bt=bt,
                    bt_stride=block_table.stride(0) if paged else 0,
                    block_size=kc0.shape[1] if paged else 1, kc_s0=kc0.stride(0), kc_s1=kc0.stride(1),
                    kc_s2=kc0.stride(2)), paged

    def _consts(self, paged: bool):
        c = self.model.cfg
        return dict(DIM=c.dim, H=c.n_heads, KVH=c.n_kv_heads, D=c.head_dim, F=c.ffn_dim,
                    GB=max(16, _pow2(c.n_heads // c.n_kv_heads)), GP=_pow2(c.n_heads // c.n_kv_heads), PAGED=paged,
                    TS=self.attn_ts, AK=self.attn_keys,
                    QK_NORM=self.qk_norm,
                    IEEE=self.model.dtype == torch.float32, BR=MAX_ROWS, BN=BLOCK_N, BK=self.block_k,
                    BNA=self.block_n_attn, STAGES=self.stages, FMT=self.fmt)

    def _persistent_args(self, positions, slots, res, block_table):
        """The persistent kernel's arguments and constexprs for one launch."""
        c = self.model.cfg
        a, paged = self._args(positions, slots, block_table)
        l0 = self.layer0
        args = [res, self.ss, self.xg, self.qkv, self.attn, self.act, self.part, self.ao, self.al, self.cnt, self.bar,
                self.clock, self.offs, l0["qkv"], l0["o"], l0["gate_up"], l0["down"], l0["attn_norm"], l0["ffn_norm"],
                l0["q_norm"], l0["k_norm"], l0["k"], l0["v"],
                *(l0[f"{n}.{part}"] for n in PROJECTIONS for part in ("scales", "mins", "sub")),
                a["rope"], a["positions"], a["slots"], a["bt"], a["bt_stride"], a["block_size"], a["kc_s0"],
                a["kc_s1"], a["kc_s2"], res.shape[0], c.n_layers, float(c.norm_eps), float(c.head_dim) ** -0.5]
        sp = self.splits
        return args, dict(TIMED=self.timed, AL=self.align, S_QKV=sp["qkv"], S_O=sp["o"],
                          S_GU=sp["gate_up"], S_DOWN=sp["down"], **self._consts(paged))

    def compile_for(self, positions, slots, res, block_table=None, capability: int = 90):
        """The persistent kernel as a launch on a GPU of that compute capability would compile it (its arguments'
        types, pointers and integers known 16-byte divisible where they are), without a GPU: its PTX (`.asm`), to
        check how it reads memory, and shared memory (`.metadata.shared`), to check that it fits."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        args, consts = self._persistent_args(positions, slots, res, block_table)
        names = list(_persistent_step.arg_names)
        sig, attrs = {}, {}
        for i, (name, v) in enumerate(zip(names, args)):
            if isinstance(v, torch.Tensor):
                sig[name] = "*" + _TRITON_DTYPE[v.dtype]
                aligned = v.data_ptr() % 16 == 0
            elif isinstance(v, float):
                sig[name], aligned = "fp32", False
            else:
                sig[name], aligned = ("i32" if abs(v) < 2 ** 31 else "i64"), v % 16 == 0
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        consts = {**consts, "PDL": False}
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(_persistent_step, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        target = GPUTarget("cuda", capability, 32)
        return triton.compile(src, target=target, options=dict(num_warps=self.num_warps))

    def __call__(self, positions: torch.Tensor, slots: torch.Tensor, res: torch.Tensor,
                 block_table: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over the rows whose embeddings are in res [R, dim] (R <= MAX_ROWS); res ends as the final
        residual stream (before the last norm), as FusedDecoder.hidden leaves it."""
        R = res.shape[0]
        if R > MAX_ROWS:
            raise ConfigError(f"persistent step: {R} rows exceed its {MAX_ROWS}")
        c = self.model.cfg
        a, paged = self._args(positions, slots, block_table)
        k = self._consts(paged)
        common = dict(eps=float(c.norm_eps), scale=float(c.head_dim) ** -0.5)
        if self.mode == "persistent":
            self.bar.zero_()
            args, consts = self._persistent_args(positions, slots, res, block_table)
            if self.compiled is None:    # compiled, not launched, until it is known to fit
                self._check_resident(_persistent_step.warmup(*args, **consts, num_warps=self.num_warps,
                                                             **pdl.triton_opts(res.device), grid=(self.programs,)),
                                     res.device)
            self.compiled = _persistent_step[(self.programs,)](*args, **consts, num_warps=self.num_warps,
                                                              **pdl.triton_opts(res.device))
            return res
        grid = (self.programs,)

        def phase(p, i=0):
            """Phase p of layer i, given that layer's tensors (each phase reads the ones it needs; the norm is the
            one whose input ss, o and down leave: down's, the next layer's, or its own in the last)."""
            name = {3: "o", 4: "gate_up", 5: "down"}.get(p, "qkv")
            norm = t["ffn_norm"][i] if p == 3 else t["attn_norm"][min(i + 1, c.n_layers - 1) if p == 5 else i]
            parts = [t[f"{name}.{part}"][i] for part in ("scales", "mins", "sub")]
            _one_phase[grid](res, self.ss, self.xg, self.qkv, self.attn, self.act, self.part, self.ao, self.al,
                             self.cnt, t[name][i], *parts, norm, t["k"][i], t["v"][i], t["q_norm"][i], t["k_norm"][i],
                             a["rope"], a["positions"], a["slots"], a["bt"], a["bt_stride"], a["block_size"],
                             a["kc_s0"], a["kc_s1"], a["kc_s2"], R,
                             common["eps"], common["scale"], PHASE=p, S=self.splits.get(name, 1), **k,
                             num_warps=self.num_warps, **pdl.triton_opts(res.device))

        t = self.tensors
        phase(0)
        for i in range(c.n_layers):
            for p in range(1, 6):
                phase(p, i)
        return res

    def _check_resident(self, kernel, dev) -> None:
        """Refuse a launch whose programs could not all be resident at once: it would wait at its first barrier
        forever."""
        kernel._init_handles()
        p = torch.cuda.get_device_properties(dev)
        fits = programs_an_sm_holds(kernel.n_regs, kernel.metadata.shared, self.num_warps, p)
        if fits * p.multi_processor_count < self.programs:
            raise ConfigError(
                f"persistent step: {self.programs} programs on {p.multi_processor_count} SMs, but an SM holds only "
                f"{fits} of this kernel ({kernel.n_regs} registers a thread x {self.num_warps} warps, "
                f"{kernel.metadata.shared} B shared memory); lower per_sm, num_warps or block_k in "
                f"engine.persistent_form")

    def stamped_us(self) -> dict[str, dict[str, float]]:
        """With timed=True, after a persistent launch, per phase summed over the layers (us): `time` program 0's
        exit to exit (a phase's time includes its barrier wait), `sync` the part of it from the last program's
        arrival at the closing barrier (its work done, before its release and atomic) to program 0 leaving it: what
        the barrier itself costs once every program's work is done; `slowest` the longest any program worked in the
        phase (its arrival at the closing barrier less its exit from the opening one), `mean` the programs' mean of
        the same."""
        ex, ar, sync = _read_stamps(self.clock)
        work = ar[1:] - ex[:-1]                                       # a program's work in each phase
        rows = {"time": ex[1:, 0] - ex[:-1, 0], "sync": sync,
                "slowest": work.max(dim=1).values, "mean": work.mean(dim=1)}
        return {k: {p: float(v[j::5].sum()) for j, p in enumerate(PHASES[1:])} for k, v in rows.items()}


def barrier_cost_us(programs: int, count: int, device, num_warps: int = 4) -> dict[str, float]:
    """`count` grid barriers over `programs` programs with nothing between them (_barriers_only), the last of three
    launches: per barrier, the mean time from program 0 leaving one to leaving the next (`period`) and from the last
    arrival to program 0 leaving (`sync`)."""
    bar = torch.zeros(1, dtype=torch.int32, device=device)
    clock = torch.zeros(2, count, programs, dtype=torch.int64, device=device)
    for _ in range(3):
        bar.zero_()
        _barriers_only[(programs,)](bar, clock, NB=count, num_warps=num_warps,
                                    **pdl.triton_opts(device))
    torch.cuda.synchronize(device)
    ex, _, sync = _read_stamps(clock)
    return {"period": float((ex[-1, 0] - ex[0, 0]) / (count - 1)), "sync": float(sync.mean())}


def _read_stamps(clock: torch.Tensor):
    """_barrier's stamps [2, barriers, programs] in us: every program's exits and arrivals, and of each barrier but
    the first the time from its last arrival to program 0 leaving it."""
    ex, ar = (x.double() / 1e3 for x in clock.cpu())
    return ex, ar, ex[1:, 0] - ar[1:].max(dim=1).values


def phase_profile(model, kv, rows: int, position: int) -> dict[str, tuple[float, float, int]]:
    """Each phase's time (us, summed over the layers, its barrier wait included) in one persistent launch of `rows`
    decode rows at `position` (slots 0..rows-1 of kv, whose entries at that position it overwrites), the barrier's
    own part of it (stamped_us' sync), and the bytes the phase must read: its weights, or for attention the rows' keys
    and values 0..position."""
    c = model.cfg
    step = PersistentStep(model, kv, timed=True, **model.persistent_form)
    dev = model.embed.device
    tokens = torch.zeros(rows, dtype=torch.long, device=dev)
    positions = torch.full((rows,), position, dtype=torch.long, device=dev)
    slots = torch.arange(rows, device=dev)
    table = getattr(kv, "block_table", None)
    res = model.buffers(rows)["residual"]
    for _ in range(3):      # the last launch's clock is read
        model.k.embedding(tokens, model.embed, out=res)
        step(positions, slots, res, table)
    torch.cuda.synchronize(dev)
    st = step.stamped_us()
    weights = {p: sum(_nbytes(layer[name].weights[0]) for layer in model.layers) for p, name in
               (("qkv", "qkv"), ("o", "o"), ("ffn", "gate_up"), ("down", "down"))}
    weights["attn"] = rows * c.n_layers * 2 * (position + 1) * c.n_kv_heads * c.head_dim * kv.k[0].element_size()
    return {p: (st["time"][p], st["sync"][p], weights[p]) for p in PHASES[1:]}
