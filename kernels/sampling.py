"""On-device next-token choice over the full vocabulary: only the R chosen token ids leave the GPU.

Greedy: `argmax_triton` (ties -> lowest index), two stages so one row still spreads over many SMs:
stage 1, grid (R, S), takes one chunk of CHUNK tokens per program (CHUNK = min(1024, pow2 >= V): a
function of V only, never of R) and writes (best value, its lowest index); stage 2, grid (R,), merges
the S partials in order. A max with lowest-index ties is exact, so the result is deterministic and
independent of the chunking.

Sampling: `sample_triton` draws token ~ softmax(s) restricted to the top-k / top-p set, where
s = logits / temperature (fp32, IEEE division), by the exponential race (Gumbel-max):

    token = argmax_i  s_i - log(E_i)   over the surviving tokens,  E_i = -log(u_i) ~ Exp(1)

(argmax of log p_i - log E_i; the log-normaliser is a constant shift and is dropped). The uniform
u_i of token i in a row comes from a counter-based RNG: Philox4x32-10 with key = the row's seed (64
bits) and counter = (i // 4, step mod 2^32, 0, 0), output word i % 4, mapped to (k + 0.5) * 2^-23
with k its top 23 bits, so u lies in (0, 1) exactly and both implementations (Triton here, torch in
`philox_uniform_ref`) produce the same bits. A (seed, step) pair therefore always draws the same
numbers whatever else is in the batch: the caller picks seed per slot (e.g. seed * 1_000_003 + slot,
as engine/sampler.py does) and step per decode step; step is a device tensor, so a captured CUDA
graph samples fresh numbers on every replay once the caller increments it on device.

Filtering (per row; off when top_k <= 0 or top_k >= V, and when top_p >= 1), the same order as
engine/sampler.py (temperature, then top-k, then top-p over the renormalised top-k set). Both keep a
set closed under value, {i : s_i >= t}, with a per-row threshold t:
  top-k: t_k = the k-th largest s (every token tied with it is kept, so > k may survive);
  top-p: t_p = the largest value t >= t_k whose kept mass sum_{s_i >= t} p_i reaches top_p: the
         smallest prefix in value order reaching top_p, widened to its whole tie group.
Ties are thus resolved by value, never by index (engine/sampler.py's sort may cut a tie group at an
arbitrary member; that is the only difference, and only at an exact tie on the boundary). The kept
mass is summed in fp32 (the reference in fp64): a boundary whose cumulative mass is within ~1e-6 of
top_p (relative) may fall either way.

How t is found without a sort: a search over the 32-bit order-preserving integer key of s (float
bits with negative numbers' magnitude bits flipped; -0 folded into +0). Each pass evaluates NT - 1 =
15 candidate keys spread over the current bracket [lo, hi) (count of s >= c for top-k, kept mass
for top-p) and shrinks the bracket ~16x; it ends when hi = lo + 1 (at most ceil(32 / 4) + 1 passes)
and t = float(lo) is then exactly an element's value. A pass reads only the chunks whose [min, max]
of s (from the stats kernel) meets the bracket, and blocks with no element inside the bracket skip
the candidate arithmetic, so after the first pass or two little of the row is touched. Starting
brackets: top-k from the k-th largest chunk max when k <= S (k chunks each hold an element >= it),
else the row min; top-p from max(t_k, m + log((1 - p) Z_k / V) - 2) (m = row max, Z_k = kept mass
relative to e^m): all tokens below that bound together hold < (1 - p) e^-2 of the mass, so the bound
always satisfies the condition (used for p < 0.9999 only, clear of fp32 rounding).

Kernels per `sample_triton` call (grids static given R and V; no host sync; nothing allocated when
`out` and `workspace` are given):
  1. stats      (R, S): per chunk max / min / sum exp(s - chunk max)   [rows that filter; others exit]
  2. threshold  (R,):   merge stats, search t_k then t_p, write t     [one program per row: at R = 1
                        this runs on one SM; the main latency cost of filtering]
  3. race       (R, S): per chunk best of s - log(E) over s >= t (greedy rows: plain logits); chunks
                        whose max is below t are not even read
  4. reduce     (R,):   merge the partials in chunk order -> int64 token
Every row's arithmetic depends only on its own logits and parameters and on V: results are bitwise
batch invariant. NaN logits are not supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton

NT = 16             # candidates (incl. the bracket's low end) per threshold-search pass
MAX_CHUNK = 1024    # vocab tokens per program in the (R, S) kernels
MAX_SEARCH_BLOCK = 512  # tokens per inner block of the threshold search


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def chunk_size(vocab: int) -> int:
    """Tokens per stage-1 program: depends on the vocabulary only (batch invariance)."""
    return max(4, min(MAX_CHUNK, _next_pow2(vocab)))


def num_chunks(vocab: int) -> int:
    return -(-int(vocab) // chunk_size(vocab))


# --------------------------------------------------------------------------------------------------
# references (torch; any device)

def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> int64 [R]; ties -> the lowest index (spelled out rather than relying on torch.argmax). NaN ranks as
    -inf, so a row of NaN (a model whose arithmetic broke down) still gives a valid id, 0, not one past the end."""
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    best = x.max(dim=-1, keepdim=True).values
    return torch.where(x == best, idx, x.shape[-1]).min(dim=-1).values


_M32 = 0xFFFFFFFF
_PHILOX_A, _PHILOX_B = 0xD2511F53, 0xCD9E8D57   # round multipliers (Triton's philox_impl, 32-bit)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85         # key increments


def _mulhilo32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a in [0, 2^32) (int64 tensor), in int64 arithmetic."""
    p_lo = a * (b & 0xFFFF)
    p_hi = a * (b >> 16)
    return (p_hi + (p_lo >> 16)) >> 16, (p_lo + ((p_hi & 0xFFFF) << 16)) & _M32


def philox4x32_ref(seeds: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor | None = None,
                   c3: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Philox4x32-10 (Random123) with key (seed low word, seed high word) and counter (c0, c1, c2, c3)
    (the kernel uses c2 = c3 = 0), exactly as Triton's `philox_impl` computes it; broadcasting int64
    tensors; returns the four uint32 output words as int64."""
    k0, k1 = seeds.long() & _M32, (seeds.long() >> 32) & _M32
    c0, c1 = c0.long() & _M32, c1.long() & _M32
    c2 = torch.zeros_like(c0) if c2 is None else c2.long() & _M32
    c3 = torch.zeros_like(c0) if c3 is None else c3.long() & _M32
    for _ in range(10):
        hb, lb = _mulhilo32(c2, _PHILOX_B)
        ha, la = _mulhilo32(c0, _PHILOX_A)
        c0, c1, c2, c3 = hb ^ c1 ^ k0, lb, ha ^ c3 ^ k1, la
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return [c0, c1, c2, c3]


def philox_uniform_ref(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's uniforms: u[r, i] in (0, 1), fp32 [R, V], bit-identical to the Triton kernel's.
    seeds: [R] int; step: [] / [1] / [R] int."""
    R = seeds.shape[0]
    dev = seeds.device
    n4 = -(-vocab // 4)
    ctr = torch.arange(n4, device=dev, dtype=torch.int64).view(1, n4)
    st = step.to(dev).long().reshape(-1)
    st = st.view(-1, 1).expand(R, 1) if st.numel() > 1 else st.view(1, 1)
    words = philox4x32_ref(seeds.to(dev).long().view(R, 1), ctr, st)
    w = torch.stack([x.expand(R, n4) for x in words], dim=-1).reshape(R, 4 * n4)[:, :vocab]
    return ((w >> 9).float() + 0.5) * (2.0 ** -23)


def keep_threshold_ref(s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row threshold t on the scaled logits s [R, V] (fp32): keep {i : s_i >= t}; -inf = keep all.
    Top-k then top-p, both closed under value ties (see the module doc); kept mass in fp64."""
    R, V = s.shape
    k = top_k.to(s.device).long()
    p = top_p.to(s.device).double()
    srt = s.sort(dim=-1, descending=True).values
    use_k = (k > 0) & (k < V)
    t_k = torch.where(use_k, srt.gather(1, (k.clamp(1, V) - 1).view(R, 1)).squeeze(1), float("-inf"))
    e = torch.exp(srt.double() - srt[:, :1].double()) * (srt >= t_k.view(R, 1))
    cum = e.cumsum(dim=1)
    j = (cum < (p * e.sum(dim=1)).view(R, 1)).sum(dim=1).clamp(max=V - 1)   # first prefix reaching p
    t_p = torch.where(p < 1, srt.gather(1, j.view(R, 1)).squeeze(1), float("-inf"))
    return torch.maximum(t_k, t_p)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, step: torch.Tensor, return_threshold: bool = False):
    """Reference of sample_triton (same math, same random numbers). Rows with temperature <= 0 are
    greedy (argmax of the logits). Returns int64 [R] (and the fp32 thresholds [R] if asked; -inf for
    greedy / unfiltered rows)."""
    x = logits.float()
    R, V = x.shape
    T = temperature.to(x.device).float()
    greedy = T <= 0
    s = x / torch.where(greedy, torch.ones_like(T), T).view(R, 1)
    thr = keep_threshold_ref(s, top_k, top_p)
    thr = torch.where(greedy, float("-inf"), thr)
    u = philox_uniform_ref(seeds, step, V).to(x.device)
    score = torch.where(s >= thr.view(R, 1), s + -torch.log(-torch.log(u)), float("-inf"))
    tokens = argmax_ref(torch.where(greedy.view(R, 1), x, score))
    return (tokens, thr) if return_threshold else tokens


# --------------------------------------------------------------------------------------------------
# Triton

@dataclass
class SamplingWorkspace:
    """Scratch for argmax_triton / sample_triton, for up to `rows` rows of a `vocab`-token row."""
    rows: int
    vocab: int
    val: torch.Tensor     # [rows, S] fp32: best score per chunk
    idx: torch.Tensor     # [rows, S] int32: its (lowest) token index
    cmax: torch.Tensor    # [rows, S] fp32: max of s per chunk
    cmin: torch.Tensor    # [rows, S] fp32: min of s per chunk
    csum: torch.Tensor    # [rows, S] fp32: sum exp(s - chunk max)
    thresh: torch.Tensor  # [rows] fp32: the keep threshold on s of the last sample_triton call (-inf: all)


def make_workspace(rows: int, vocab: int, device: torch.device | str) -> SamplingWorkspace:
    S = num_chunks(vocab)
    f = lambda *shape, dtype=torch.float32: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    return SamplingWorkspace(rows, vocab, f(rows, S), f(rows, S, dtype=torch.int32), f(rows, S), f(rows, S),
                             f(rows, S), f(rows))


_WORKSPACES: dict[tuple, SamplingWorkspace] = {}


def _workspace(R: int, V: int, device: torch.device, ws: SamplingWorkspace | None) -> SamplingWorkspace:
    if ws is not None:
        if ws.rows < R or ws.vocab != V or ws.val.shape[1] != num_chunks(V):
            raise ValueError(f"workspace for {ws.rows} rows x {ws.vocab} tokens cannot serve {R} x {V}")
        return ws
    # Allocated on first use per (device, R, V) and kept for the life of the process (a captured graph
    # keeps pointing at it): make one eager call before capturing, or pass `workspace=`.
    key = (str(device), R, V, num_chunks(V))
    if key not in _WORKSPACES:
        _WORKSPACES[key] = make_workspace(R, V, device)
    return _WORKSPACES[key]


@triton.jit
def _philox_uniform4(seed_lo, seed_hi, c0, c1):
    """Philox4x32-10 (Triton's philox_impl, 32-bit) with counter (c0, c1, 0, 0); four uniforms in (0, 1)."""
    c2 = c0 * 0
    c3 = c0 * 0
    k0 = seed_lo
    k1 = seed_hi
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    scale = 1.1920928955078125e-07  # 2^-23
    u0 = ((c0 >> 9).to(tl.float32) + 0.5) * scale
    u1 = ((c1 >> 9).to(tl.float32) + 0.5) * scale
    u2 = ((c2 >> 9).to(tl.float32) + 0.5) * scale
    u3 = ((c3 >> 9).to(tl.float32) + 0.5) * scale
    return u0, u1, u2, u3


@triton.jit
def _key(s):
    """Order-preserving int32 key of fp32 s (-0.0 folded into +0.0)."""
    b = s.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _from_key(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _uniform_kernel(seed_ptr, step_ptr, s_step, out_ptr, s_out, V, BLOCK4: tl.constexpr, PDL: tl.constexpr = False):
    """Debug/test: the race's uniforms of row r, laid out like the logits."""
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK4 + tl.arange(0, BLOCK4)
    j = tl.arange(0, 4)
    seed = tl.load(seed_ptr + r).to(tl.int64)
    step = tl.load(step_ptr + r * s_step).to(tl.int64)
    c0 = i.to(tl.uint32)
    u0, u1, u2, u3 = _philox_uniform4(seed.to(tl.uint32), (seed >> 32).to(tl.uint32), c0,
                                      c0 * 0 + step.to(tl.uint32))
    u = tl.where(j[None, :] == 0, u0[:, None],
                 tl.where(j[None, :] == 1, u1[:, None], tl.where(j[None, :] == 2, u2[:, None], u3[:, None])))
    offs = i[:, None] * 4 + j[None, :]
    tl.store(out_ptr + r * s_out + offs, u, mask=offs < V)


@triton.jit
def _stats_kernel(x_ptr, s_x, V, temp_ptr, topk_ptr, topp_ptr, cmax_ptr, cmin_ptr, csum_ptr, s_ws,
                  CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + r).to(tl.float32)
    k = tl.load(topk_ptr + r).to(tl.int64)
    p = tl.load(topp_ptr + r).to(tl.float32)
    filtering = ((k > 0) & (k < V)) | (p < 1.0)
    if (t > 0) & filtering:
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < V
        x = tl.load(x_ptr + r * s_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, t)
        cm = tl.max(s, axis=0)
        cn = tl.min(tl.where(mask, s, float("inf")), axis=0)
        e = tl.where(s > float("-inf"), tl.exp(s - cm), 0.0)
        tl.store(cmax_ptr + r * s_ws + c, cm)
        tl.store(cmin_ptr + r * s_ws + c, cn)
        tl.store(csum_ptr + r * s_ws + c, tl.sum(e, axis=0))


@triton.jit
def _search(row_ptr, ck_max, ck_min, sidx, V, t, m, lo, hi, k_target, mass_target,
            BY_COUNT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NCAND: tl.constexpr):
    """Largest key K in [lo, hi) with cond(K) true, given cond(lo) true; cond(K) = #{key >= K} >= k_target
    (BY_COUNT) or sum_{key >= K} exp(s - m) >= mass_target. Only elements with key >= lo count.
    ck_max / ck_min: keys of each chunk's max / min of s ([BLOCK_S] in registers, padding chunks have
    max = -2^31): a pass reads only the chunks whose range meets the bracket, in chunk order."""
    jj = tl.arange(0, NCAND)
    BLOCK_S: tl.constexpr = sidx.shape[0]
    cnt_hi = tl.sum(jj * 0, axis=0)            # tallies of {key >= hi}: nothing yet (hi = max key + 1)
    mass_hi = tl.sum(jj * 0.0, axis=0)
    while hi - lo > 1:
        cand = (lo + ((hi - lo) * jj.to(tl.int64)) // NCAND).to(tl.int32)   # cand[0] = lo
        lo32 = lo.to(tl.int32)
        hi32 = (hi - 1).to(tl.int32)   # hi may be 2^31: compare key <= hi - 1
        cnt = jj * 0
        mass = jj * 0.0
        live = (ck_max >= lo32) & (ck_min <= hi32)
        prev = tl.sum(jj * 0, axis=0) - 1
        for _ in range(0, tl.sum(live.to(tl.int32), axis=0)):
            c = tl.min(tl.where(live & (sidx > prev), sidx, BLOCK_S), axis=0)
            prev = c
            for b in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + b + tl.arange(0, BLOCK)
                msk = offs < V
                x = tl.load(row_ptr + offs, mask=msk, other=float("-inf")).to(tl.float32)
                s = tl.math.div_rn(x, t)
                key = _key(s)
                inb = msk & (key >= lo32) & (key <= hi32)
                if tl.max(inb.to(tl.int32), axis=0) > 0:
                    ge = inb[None, :] & (key[None, :] >= cand[:, None])
                    if BY_COUNT:
                        cnt += tl.sum(ge.to(tl.int32), axis=1)
                    else:
                        e = tl.exp(s - m)
                        mass += tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
        if BY_COUNT:
            tot_c = cnt_hi + cnt
            ok = tot_c >= k_target
        else:
            tot_m = mass_hi + mass
            ok = tot_m >= mass_target
        ok = ok | (jj == 0)
        first_bad = tl.min(tl.where(ok, NCAND, jj), axis=0)
        if first_bad < NCAND:
            if BY_COUNT:
                cnt_hi = tl.sum(tl.where(jj == first_bad, tot_c, 0), axis=0)
            else:
                mass_hi = tl.sum(tl.where(jj == first_bad, tot_m, 0.0), axis=0)
        new_lo = tl.max(tl.where(ok, cand, lo32), axis=0).to(tl.int64)
        hi = tl.min(tl.where(ok, hi, cand.to(tl.int64)), axis=0)
        lo = new_lo
    return lo


@triton.jit
def _mass_from(row_ptr, ck_max, sidx, V, t, m, lo, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """sum over key(s) >= lo of exp(s - m), in block order (chunks entirely below lo are not read)."""
    BLOCK_S: tl.constexpr = sidx.shape[0]
    acc = tl.zeros([BLOCK], tl.float32)
    lo32 = lo.to(tl.int32)
    live = ck_max >= lo32
    prev = tl.sum(sidx * 0, axis=0) - 1
    for _ in range(0, tl.sum(live.to(tl.int32), axis=0)):
        c = tl.min(tl.where(live & (sidx > prev), sidx, BLOCK_S), axis=0)
        prev = c
        for b in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + b + tl.arange(0, BLOCK)
            msk = offs < V
            x = tl.load(row_ptr + offs, mask=msk, other=float("-inf")).to(tl.float32)
            s = tl.math.div_rn(x, t)
            acc += tl.where(msk & (_key(s) >= lo32), tl.exp(s - m), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _kth_largest(keys, k):
    """k-th largest of an int32 key vector (k >= 1, at most the number of real entries), by bisection."""
    lo = tl.min(keys, axis=0).to(tl.int64)
    hi = tl.max(keys, axis=0).to(tl.int64) + 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if tl.sum((keys >= mid.to(tl.int32)).to(tl.int32), axis=0) >= k:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _threshold_kernel(x_ptr, s_x, V, temp_ptr, topk_ptr, topp_ptr, cmax_ptr, cmin_ptr, csum_ptr, s_ws, S,
                      thr_ptr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      NCAND: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + r).to(tl.float32)
    k = tl.load(topk_ptr + r).to(tl.int64)
    p = tl.load(topp_ptr + r).to(tl.float32)
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    thr = float("-inf")
    if (t > 0) & (use_k | use_p):
        row = x_ptr + r * s_x
        sidx = tl.arange(0, BLOCK_S)
        sm = sidx < S
        cm = tl.load(cmax_ptr + r * s_ws + sidx, mask=sm, other=float("-inf"))
        cn = tl.load(cmin_ptr + r * s_ws + sidx, mask=sm, other=float("inf"))
        cs = tl.load(csum_ptr + r * s_ws + sidx, mask=sm, other=0.0)
        ck_max = tl.where(sm, _key(cm), -2147483648)   # padding chunks never meet a bracket
        ck_min = tl.where(sm, _key(cn), 2147483647)
        m = tl.max(cm, axis=0)
        z = tl.sum(tl.where(cs > 0, cs * tl.exp(cm - m), 0.0), axis=0)
        lo = tl.min(ck_min, axis=0).to(tl.int64)
        hi = _key(m).to(tl.int64) + 1
        if use_k:
            # the k-th largest chunk max is a lower bound of t_k (k chunks each hold an element >= it)
            if k <= S:
                lo = tl.maximum(lo, _kth_largest(tl.where(sm, ck_max, tl.min(ck_min, axis=0)), k))
            lo = _search(row, ck_max, ck_min, sidx, V, t, m, lo, hi, k.to(tl.int32), 0.0, True, CHUNK, BLOCK, NCAND)
            if use_p:
                z = _mass_from(row, ck_max, sidx, V, t, m, lo, CHUNK, BLOCK)
        if use_p:
            plo = lo
            if p < 0.9999:
                bound = m + tl.log((1.0 - p) * z / V) - 2.0
                plo = tl.maximum(plo, _key(bound).to(tl.int64))
            lo = _search(row, ck_max, ck_min, sidx, V, t, m, plo, hi, 0, p * z, False, CHUNK, BLOCK, NCAND)
        thr = _from_key(lo.to(tl.int32))
    tl.store(thr_ptr + r, thr)


@triton.jit
def _race_kernel(x_ptr, s_x, V, temp_ptr, thr_ptr, cmax_ptr, seed_ptr, step_ptr, s_step, val_ptr, idx_ptr, s_ws,
                 SAMPLE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = tl.arange(0, CHUNK // 4)
    j = tl.arange(0, 4)
    offs = c * CHUNK + i[:, None] * 4 + j[None, :]          # [CHUNK/4, 4]: token 4i + j of the chunk
    mask = offs < V
    ptrs = x_ptr + r * s_x + offs
    if SAMPLE:
        t = tl.load(temp_ptr + r).to(tl.float32)
        if t > 0:
            thr = tl.load(thr_ptr + r)
            score = tl.full([CHUNK // 4, 4], float("-inf"), tl.float32)
            # a filtered row (thr > -inf) has this chunk's max of s from the stats pass: skip dead chunks
            if (thr == float("-inf")) | (tl.load(cmax_ptr + r * s_ws + c) >= thr):
                s = tl.math.div_rn(tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32), t)
                keep = mask & (s >= thr)
                seed = tl.load(seed_ptr + r).to(tl.int64)
                step = tl.load(step_ptr + r * s_step).to(tl.int64)
                c0 = (c * (CHUNK // 4) + i).to(tl.uint32)
                u0, u1, u2, u3 = _philox_uniform4(seed.to(tl.uint32), (seed >> 32).to(tl.uint32), c0,
                                                  c0 * 0 + step.to(tl.uint32))
                u = tl.where(j[None, :] == 0, u0[:, None],
                             tl.where(j[None, :] == 1, u1[:, None],
                                      tl.where(j[None, :] == 2, u2[:, None], u3[:, None])))
                score = tl.where(keep, s + -tl.log(-tl.log(u)), float("-inf"))
        else:
            score = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    else:
        score = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    score = tl.where(score == score, score, float("-inf"))   # NaN ranks as -inf (argmax_ref)
    best = tl.max(tl.max(score, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(score == best, offs, 2147483647), axis=1), axis=0)
    tl.store(val_ptr + r * s_ws + c, best)
    tl.store(idx_ptr + r * s_ws + c, first)


@triton.jit
def _reduce_kernel(val_ptr, idx_ptr, s_ws, S, out_ptr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_S)
    m = k < S
    v = tl.load(val_ptr + r * s_ws + k, mask=m, other=float("-inf"))
    ix = tl.load(idx_ptr + r * s_ws + k, mask=m, other=2147483647)
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(m & (v == best), ix, 2147483647), axis=0)
    tl.store(out_ptr + r, first.to(tl.int64))


def _check_rows(name: str, t: torch.Tensor, R: int, device: torch.device) -> None:
    if t.shape != (R,) or t.device != device:
        raise ValueError(f"{name} must be a [{R}] tensor on {device}, got {tuple(t.shape)} on {t.device}")


def _check_logits(logits: torch.Tensor, out: torch.Tensor | None) -> tuple[int, int, torch.Tensor]:
    if logits.dim() != 2 or (logits.stride(1) != 1 and logits.shape[1] > 1):
        raise ValueError(f"logits must be [R, V] with a contiguous last dim, got {tuple(logits.shape)}")
    R, V = logits.shape
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if out.shape != (R,) or out.dtype != torch.int64:
        raise ValueError(f"out must be int64 [{R}]")
    return R, V, out


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None,
                  workspace: SamplingWorkspace | None = None) -> torch.Tensor:
    """Greedy choice: int64 [R], ties -> lowest index. logits [R, V] bf16/fp16/fp32, V up to 2^31."""
    R, V, out = _check_logits(logits, out)
    if R == 0:
        return out
    ws = _workspace(R, V, logits.device, workspace)
    S, CHUNK = num_chunks(V), chunk_size(V)
    _race_kernel[(R, S)](logits, logits.stride(0), V, logits, logits, logits, logits, logits, 0,
                         ws.val, ws.idx, ws.val.stride(0), SAMPLE=False, CHUNK=CHUNK, num_warps=4,
                         **pdl.triton_opts(logits.device))
    _reduce_kernel[(R,)](ws.val, ws.idx, ws.val.stride(0), S, out, BLOCK_S=_next_pow2(S), num_warps=1,
                         **pdl.triton_opts(ws.val.device))
    return out


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, step: torch.Tensor, out: torch.Tensor | None = None,
                  workspace: SamplingWorkspace | None = None) -> torch.Tensor:
    """Per-row temperature / top-k / top-p sampling on device -> int64 [R] (module doc for the math).

    logits [R, V] (bf16/fp16/fp32, contiguous last dim); temperature [R] float (<= 0: greedy row);
    top_k [R] int (<= 0 or >= V: off); top_p [R] float (>= 1: off); seeds [R] int64 (per row, i.e. per
    slot); step: int tensor of shape [] / [1] (all rows) or [R] (per row). All on logits' device; the
    parameters are read on device, so one captured graph serves any mix of settings.
    workspace.thresh holds each row's keep threshold on s afterwards (debug)."""
    R, V, out = _check_logits(logits, out)
    dev = logits.device
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seeds", seeds)):
        _check_rows(name, t, R, dev)
    if step.numel() not in (1, R) or step.device != dev or step.is_floating_point():
        raise ValueError(f"step must be an int tensor of 1 or {R} elements on {dev}")
    if R == 0:
        return out
    ws = _workspace(R, V, dev, workspace)
    S, CHUNK = num_chunks(V), chunk_size(V)
    s_ws = ws.val.stride(0)
    s_step = 0 if step.numel() == 1 else step.reshape(-1).stride(0)
    BLOCK = min(MAX_SEARCH_BLOCK, _next_pow2(V))
    _stats_kernel[(R, S)](logits, logits.stride(0), V, temperature, top_k, top_p, ws.cmax, ws.cmin, ws.csum, s_ws,
                          CHUNK=CHUNK, num_warps=4, **pdl.triton_opts(logits.device))
    _threshold_kernel[(R,)](logits, logits.stride(0), V, temperature, top_k, top_p, ws.cmax, ws.cmin, ws.csum, s_ws,
                            S, ws.thresh, BLOCK_S=_next_pow2(S), CHUNK=CHUNK, BLOCK=min(BLOCK, CHUNK), NCAND=NT,
                            num_warps=8, **pdl.triton_opts(logits.device))
    _race_kernel[(R, S)](logits, logits.stride(0), V, temperature, ws.thresh, ws.cmax, seeds, step.reshape(-1), s_step,
                         ws.val, ws.idx, s_ws, SAMPLE=True, CHUNK=CHUNK, num_warps=4, **pdl.triton_opts(logits.device))
    _reduce_kernel[(R,)](ws.val, ws.idx, s_ws, S, out, BLOCK_S=_next_pow2(S), num_warps=1,
                         **pdl.triton_opts(ws.val.device))
    return out


def uniform_triton(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Debug/test: the uniforms the race kernel draws, fp32 [R, vocab] (compare with philox_uniform_ref)."""
    R = seeds.shape[0]
    out = torch.empty(R, vocab, dtype=torch.float32, device=seeds.device)
    s_step = 0 if step.numel() == 1 else step.reshape(-1).stride(0)
    BLOCK4 = min(256, _next_pow2(-(-vocab // 4)))
    _uniform_kernel[(R, triton.cdiv(-(-vocab // 4), BLOCK4))](seeds, step.reshape(-1), s_step, out, out.stride(0),
                                                             vocab, BLOCK4=BLOCK4, num_warps=4,
                                                             **pdl.triton_opts(seeds.device))
    return out
