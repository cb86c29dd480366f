"""W4A16 projection y[M, N] = x[M, K] @ w[N, K]^T with w kept quantized (GGUF Q4_0 / Q4_1 / Q4_K / Q8_0,
repacked by kernels/quant_pack.py), bf16/fp16 x, fp32 accumulation, x's dtype out (or fp32); batch-invariant
like kernels/gemm.py: row m of y is bitwise the same for the same x[m] whatever M is and whatever the other
rows hold, so B greedy streams are bit-exact with one stream.

Definition: ``w4a16_linear_ref(x, pw) = (x.float() @ w.float().T).to(x.dtype)`` with w = unpack_ref(pw) rounded
to x's dtype, the weights the dequantized model holds (``exact=True``: unpack_ref(pw) itself).

Two K loops, chosen per (N, K, fmt) by FOLD (default on; both batch-invariant), and for FOLD per shape W16: the
weights folded in 16-bit arithmetic, kernels.quant_pack.unpack_folded's values (definition: w4a16_linear_ref(x, pw,
folded=True)), by one packed fma per pair on the GPU; MEASURED sets it on the 27B hybrid's Q4_K shapes.
  FOLD (default)  per block of GPB groups every weight is dequantized in fp32 exactly (16-byte word loads,
                  eight nibbles per word by inline PTX), scaled, rounded once to x's dtype, and the block
                  goes into one tensor-core dot accumulating in fp32. Its products are those of the
                  dequantized model: w4a16_linear_ref.
  group loop      exact integer weights, one dot per 32-weight group and the group's fp32 scale after it
                  (below): the exact-weight reference. Slower at large B (a fresh dot and rescale per group).
Why it stays slower than bf16 cuBLAS at many sequences, in part: the dequantized [BLOCK_N, BLOCK_K] tile leaves the
join/reshape in a layout that is not the wgmma's register-A layout, and the conversion goes through shared memory
every K block, on top of the x tile's cp.async ring. The measurements, and the alternatives tried and dropped:
kernels/PROBES.md, kernels/int4_gemm.py.

The group loop (swap-AB: weight rows on the MMA's M side, sequences on its N side)
  A program owns BLOCK_N weight rows x BLOCK_M sequences (a decode step of up to 128 rows is one M tile;
  more rows run over the grid, never over registers) and walks its K range one 32-weight group at a time
  (GPB groups per loop iteration, unrolled). Per group it loads the rows' packed bytes once (16 contiguous
  bytes per row, consecutive rows adjacent), turns them into the exact integers q in registers, and
  applies them to every sequence of the tile with one tensor-core dot; the group's scale comes after:
      P_g[n, m] = sum_k qq[n, k] * x[m, k]        tl.dot [BLOCK_N, 32] x [32, BLOCK_M], fresh fp32 acc
                  (qq = q - 8 for Q4_0, q otherwise: small integers, exact in bf16 / fp16)
      acc[n, m] = fma(s_g[n], P_g[n, m], acc[n, m])                         s = d; Q4_K: d * sc
      acc[n, m] = fma(c_g[n], X_g[n, m], acc[n, m])     Q4_1: c = m; Q4_K: c = -(dmin * mn)
                  X_g = tl.dot(ones [BLOCK_N, 32], x_g^T): the group sums of x[m], computed by the same
                  kind of dot as P_g so they land in its layout (no reduction, no layout change)
  The weights are never rounded: q and x are exact dot operands and s, c exact fp32 products of the file's
  fp16 values and 6-bit integers (Q4_K). q comes from the bytes either by plain Triton shifts and masks
  (three joins: word -> half-words -> bytes -> nibbles, all in the thread's registers; the interpreter's
  path) or, on the GPU by default (DEQ_ASM), by inline PTX that builds two bf16/fp16 values per
  instruction with the magic-exponent trick (_nibble_asm_text). Both give the same values, so the same
  bits; DEQ_ASM takes fewer instructions per weight (kernels/PROBES.md, kernels/int4_gemm.py: DEQ_ASM).

Why it is batch-invariant
  Each output element's arithmetic is the chain above over the groups of its split in ascending order,
  then (split-K) the fp32 partials summed in split order 0..S-1 and rounded once. What fixes that chain --
  BLOCK_N, GPB, SPLIT_K and the split boundaries -- comes from (N, K, fmt) alone (``_shape_rule``). fma is
  exactly rounded, so FMA contraction cannot change it. M moves only BLOCK_M (16/32/64/128: the MMA's
  N extent, the batch side), num_warps (4, or 8 for BLOCK_N 128 with BLOCK_M >= 64: a second warpgroup
  takes the other 64 weight rows) and the grid. Rows past M load zeros, columns past N re-read valid rows
  (index modulo N); neither is stored, and MMA columns (sequences) are independent.
  The one hardware assumption: a tensor-core dot gives each element the same bits whatever the MMA's N
  extent and whichever warpgroup issues it. Every BLOCK_M lowers to the same instruction, wgmma
  m64nXk16 (X = BLOCK_M; the M side is BLOCK_N = 64 or 128), checked offline by
  tests/test_int4_gemm.py::test_kernel_compiles_for_sm90; the GPU tests compare rows across every BLOCK_M.
  If they ever differ, pin one: ``onepass.kernels.int4_gemm.PIN_BLOCK_M = 16`` or ``ONEPASS_INT4_BLOCK_M=16``.

Configuration: ``int4_config(M, N, K, fmt)``. (N, K, fmt) -> BLOCK_N, BLOCK_K, SPLIT_K, num_stages,
MAX_BLOCK_M, DEQ_ASM (and optionally num_warps) from ``MEASURED`` (per-shape choices; the probes behind them:
kernels/PROBES.md, kernels/int4_gemm.py) over the rule (``_shape_rule``): BLOCK_N 64, BLOCK_K 128 (4 groups), 3
stages; split-K until the grid holds TARGET_PROGRAMS (~4 programs per SM): the smallest S in 1..MAX_SPLIT_K dividing
the K blocks, >= MIN_KB_PER_SPLIT K blocks per split, N tiles * S >= TARGET_PROGRAMS (else the largest such S), as
kernels/gemm.py does for the SM count. BLOCK_M = the smallest of 16/32/64/128 holding M (capped by MAX_BLOCK_M).
Nothing is autotuned at run time.

CUDA graphs: with ``out`` given nothing is allocated and nothing is read back to the host, provided the
split-K workspace is large enough (a per-device grow-only buffer; an eager call of the same or a larger
shape, or ``reserve_workspace``, sizes it; replaced buffers are kept alive for captured graphs).

CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported; slow, tests
only). There (UPCAST) the dots run in fp64 and are rounded to fp32, and the final fp32 -> bf16 rounding is
done by hand (round to nearest even, the GPU cast's rounding; the interpreter's own cast truncates). The
interpreter would multiply bf16 storage as raw integers, and its fp32 matmul (numpy's BLAS) changes its
summation order with the tile's BLOCK_M; in fp64 the products q * x are exact and 32-term sums exact for
any realistic x, so the interpreter models a tensor core whose per-element result does not depend on
BLOCK_M, and the CPU invariance tests (fp32 ``out``, where any reduction-order change shows) check the
kernel's own structure: groups, splits, masks, tiles.
"""
from __future__ import annotations

import functools
import os

import torch

from onepass.kernels.quant_pack import GROUP, PackedWeight, unpack_folded, unpack_ref
from onepass.kernels.splitk import cast_out, run_splits
from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton
from onepass.kernels.workspace import SplitKWorkspace, block_m_from_env

NUM_SMS = 132                 # H200; a constant so the rule (and the bits) is machine-independent
GPB_DEFAULT = 4               # groups per loop iteration: BLOCK_K = 128
MAX_SPLIT_K = 16
TARGET_PROGRAMS = 4 * NUM_SMS  # the rule's grid (split-K included; why: kernels/PROBES.md, kernels/int4_gemm.py)
MIN_KB_PER_SPLIT = 4          # K blocks per split (>= 512 weights of K)
SPLITK_M_CHUNK = 256          # rows per split-K launch (bounds the workspace)
BLOCK_M_CHOICES = (16, 32, 64, 128)
FMT_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q8_0": 3}
_DTYPES = (torch.bfloat16, torch.float16)



# One BLOCK_M for every M (fallback if the GPU test finds rows differing across BLOCK_M); None: the rule.
PIN_BLOCK_M: int | None = block_m_from_env("ONEPASS_INT4_BLOCK_M", BLOCK_M_CHOICES)
# Default dequantization of the 4-bit formats on the GPU: False = plain Triton shifts / masks / converts,
# True = the inline-PTX magic-number conversion (_nibbles_asm). Both feed the same exact integers to the
# same dot, so the results are bitwise equal (tests/test_int4_gemm.py checks it on the GPU); the choice is
# speed only. Per shape via MEASURED[...]["DEQ_ASM"]; the interpreter always takes the plain path.
DEQ_ASM_DEFAULT: bool = os.environ.get("ONEPASS_INT4_DEQ_ASM", "1").strip() not in ("", "0")
# Default K loop: True = FOLD (scales folded into weights rounded to x's dtype, one long dot), False = exact
# integer weights with one dot per group (module docstring). Per shape via MEASURED[...]["FOLD"].
FOLD_DEFAULT: bool = os.environ.get("ONEPASS_INT4_FOLD", "1").strip() not in ("", "0")


def w4a16_linear_ref(x: torch.Tensor, pw: PackedWeight, *, exact: bool = False, folded: bool = False) -> torch.Tensor:
    """The definition: x [M, K] @ w^T in fp32, rounded once to x's dtype, where w = unpack_ref(pw) rounded to
    x's dtype -- the weights the dequantized model holds, what the FOLD kernel multiplies -- or, with
    ``exact``, unpack_ref(pw) itself in fp32 (the group-loop kernel and kernels/int4_mma.py's exact form), or with
    ``folded`` unpack_folded(pw, x.dtype) (FOLD with W16, and kernels/int4_mma.py's folded form)."""
    if folded:
        w = unpack_folded(pw, x.dtype).to(x.device)
        return (x.float() @ w.T).to(x.dtype)
    w = unpack_ref(pw).to(x.device)
    if not exact:
        w = w.to(x.dtype).float()
    return (x.float() @ w.T).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _expand(w, FMT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr = 0):
    """Packed words [BLOCK_N, W] int32 -> the group's integers [BLOCK_N, 32] int32 in k order (layout:
    kernels/quant_pack.py); with GROUPS > 0, words [BLOCK_N, GROUPS, W] -> [BLOCK_N, GROUPS, 32]. Three
    joins split word -> half-words -> bytes (-> nibbles); each join adds a minor axis held by the same
    thread, so a thread expands its own words in registers."""
    if FMT == 3:   # q8_0: sign-extended bytes; byte 2a+b of word j is k = 4j + 2a + b
        h = tl.join((w << 16) >> 16, w >> 16)
        q = tl.join((h << 24) >> 24, h >> 8)
    else:          # 4-bit: nibble 4a+2b+c of word j is k = 8j + 4a + 2b + c
        h = tl.join(w & 0xFFFF, (w >> 16) & 0xFFFF)
        b = tl.join(h & 0xFF, h >> 8)
        q = tl.join(b & 0xF, b >> 4)
    if GROUPS == 0:
        return tl.reshape(q, (BLOCK_N, 32))
    else:
        return tl.reshape(q, (BLOCK_N, GROUPS, 32))


@triton.jit
def _decode(w, off, soff, s_ptr, c_ptr, sub_ptr, FMT: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK records' words [BLOCK, W] -> their values [BLOCK, 32] in fp32, unpack_ref's arithmetic (q * s exact,
    then + c): off [BLOCK] the records' (group, row) index g * N + n, soff the Q4_K super-block's (g // 8) * N + n.
    The dequantize workspace (rows of one group) and the packed embedding gather (groups of one row) share it."""
    q = _expand(w, FMT, BLOCK).to(tl.float32)
    if FMT == 0:
        q = q - 8.0
    if FMT == 2:
        d = tl.load(s_ptr + soff).to(tl.float32)
        sc = tl.load(sub_ptr + off * 2).to(tl.float32)
        mn = tl.load(sub_ptr + off * 2 + 1).to(tl.float32)
        dmin = tl.load(c_ptr + soff).to(tl.float32)
        val = (d * sc)[:, None] * q - (dmin * mn)[:, None]
    elif FMT == 1:
        d = tl.load(s_ptr + off).to(tl.float32)
        m = tl.load(c_ptr + off).to(tl.float32)
        val = d[:, None] * q + m[:, None]
    else:
        d = tl.load(s_ptr + off).to(tl.float32)
        val = d[:, None] * q
    return val


def _nibble_asm_text(high: bool, f16: bool, sub8: bool) -> str:
    """PTX for one `tl.inline_asm_elementwise` call over packed bytes (pack=4: $2 holds 4 bytes, byte i =
    element i; $0 / $1 receive elements 0,1 / 2,3 as 16-bit pairs, element 0 in the low half). Element i
    is the low (high=False) or high nibble q of byte i, as the number q - 8 (sub8) or q in bf16 / fp16:
      prmt  spreads bytes 0,1 (2,3) into the two half-words;  lop3  keeps the nibbles and ORs in the
      magic exponent (bf16 0x4300 = 128, fp16 0x6400 = 1024), giving 128 + q (1024 + q) exactly;
      fma   x * 1 - (magic [+ 8]) on both halves, exact.
    tests/test_int4_gemm.py runs these strings through a small PTX emulator."""
    magic, one, neg = (0x6400, 0x3C00, 0xE400) if f16 else (0x4300, 0x3F80, 0xC300)
    neg += 8 if sub8 else 0                      # -(magic + 8): the 8 lands in the low mantissa bits
    t = "f16x2" if f16 else "bf16x2"
    src = "a4" if high else "$2"
    return ("{ .reg .b32 a4, t0, t1, one, mg; "
            f"mov.b32 one, 0x{one:04X}{one:04X}; mov.b32 mg, 0x{neg:04X}{neg:04X}; "
            + ("shr.b32 a4, $2, 4; " if high else "")
            + f"prmt.b32 t0, {src}, 0, 0x4140; prmt.b32 t1, {src}, 0, 0x4342; "
            f"lop3.b32 t0, t0, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA; "
            f"lop3.b32 t1, t1, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA; "
            f"fma.rn.{t} $0, t0, one, mg; fma.rn.{t} $1, t1, one, mg; }}")


def _word_asm_text(f16: bool, sub8: bool, fold: bool = False) -> str:
    """PTX for one `tl.inline_asm_elementwise` call per packed int32 word $8 (pack=1) with eight 16-bit
    outputs: $s (s = 0..7) is nibble s of the word (weight 8j + s of its group) as the number q - 8 (sub8)
    or q in bf16 / fp16, exactly. The word shifted by 0/4/8/12 puts nibbles (s, s + 4) at bits 0 and 16;
    one lop3 masks them and ORs in the magic exponent (two values per instruction), one fma per pair
    removes the magic, and the pair is split into its two halves. 11 instructions per 8 weights, read
    from a 16-byte load per (row, group) instead of 16 byte loads.
    fold: inputs $9 and $10 are the group's scale s and offset c in x's dtype (both halves) and $s is
    q_s * s + c rounded once to x's dtype (one more packed fma per pair): kernels.quant_pack.unpack_folded's
    values, 15 instructions per 8 weights and no fp32 round trip (the fp32 path: a convert, an fma and half
    a pack per weight)."""
    magic, one, neg = (0x6400, 0x3C00, 0xE400) if f16 else (0x4300, 0x3F80, 0xC300)
    neg += 8 if sub8 else 0
    t = "f16x2" if f16 else "bf16x2"
    body = ["{ .reg .b32 w1, w2, w3, t0, t1, t2, t3, one, mg;",
            f"mov.b32 one, 0x{one:04X}{one:04X}; mov.b32 mg, 0x{neg:04X}{neg:04X};",
            "shr.b32 w1, $8, 4; shr.b32 w2, $8, 8; shr.b32 w3, $8, 12;"]
    for i, src in enumerate(("$8", "w1", "w2", "w3")):
        body.append(f"lop3.b32 t{i}, {src}, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA;")
    for i in range(4):
        body.append(f"fma.rn.{t} t{i}, t{i}, one, mg;")
    for i in range(4 if fold else 0):
        body.append(f"fma.rn.{t} t{i}, t{i}, $9, $10;")
    for i in range(4):
        body.append(f"mov.b32 {{${i}, ${i + 4}}}, t{i};")
    return " ".join(body) + " }"


_cx = getattr(tl, "constexpr", None) or (lambda v: v)     # triton_compat without triton: plain strings
ASM_LO_BF16_SUB8 = _cx(_nibble_asm_text(False, False, True))
ASM_HI_BF16_SUB8 = _cx(_nibble_asm_text(True, False, True))
ASM_LO_BF16 = _cx(_nibble_asm_text(False, False, False))
ASM_HI_BF16 = _cx(_nibble_asm_text(True, False, False))
ASM_LO_F16_SUB8 = _cx(_nibble_asm_text(False, True, True))
ASM_HI_F16_SUB8 = _cx(_nibble_asm_text(True, True, True))
ASM_LO_F16 = _cx(_nibble_asm_text(False, True, False))
ASM_HI_F16 = _cx(_nibble_asm_text(True, True, False))
ASM_W_BF16_SUB8 = _cx(_word_asm_text(False, True))
ASM_W_BF16 = _cx(_word_asm_text(False, False))
ASM_W_F16_SUB8 = _cx(_word_asm_text(True, True))
ASM_W_F16 = _cx(_word_asm_text(True, False))
ASM_WF_BF16_SUB8 = _cx(_word_asm_text(False, True, fold=True))
ASM_WF_BF16 = _cx(_word_asm_text(False, False, fold=True))
ASM_WF_F16_SUB8 = _cx(_word_asm_text(True, True, fold=True))
ASM_WF_F16 = _cx(_word_asm_text(True, False, fold=True))


@triton.jit
def _nibbles_asm(wb, BLOCK_N: tl.constexpr, SUB8: tl.constexpr, X_F16: tl.constexpr, GROUPS: tl.constexpr = 0):
    """GPU only. Packed bytes [BLOCK_N, 16] uint8 -> the group's values [BLOCK_N, 32] in x's dtype (q - 8
    for Q4_0, q otherwise; exact small integers) by the magic-number trick on pairs (_nibble_asm_text);
    with GROUPS > 0, bytes [BLOCK_N, GROUPS, 16] -> [BLOCK_N, GROUPS, 32]. Byte e holds k = 2e (low
    nibble) and 2e + 1 (high nibble): `lo` and `hi` are elementwise over bytes and joined. Same values as
    the plain path (_expand), fewer instructions."""
    if X_F16:
        if SUB8:
            lo = tl.inline_asm_elementwise(ASM_LO_F16_SUB8, "=r,=r,r", [wb], dtype=tl.float16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(ASM_HI_F16_SUB8, "=r,=r,r", [wb], dtype=tl.float16, is_pure=True, pack=4)
        else:
            lo = tl.inline_asm_elementwise(ASM_LO_F16, "=r,=r,r", [wb], dtype=tl.float16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(ASM_HI_F16, "=r,=r,r", [wb], dtype=tl.float16, is_pure=True, pack=4)
    else:
        if SUB8:
            lo = tl.inline_asm_elementwise(ASM_LO_BF16_SUB8, "=r,=r,r", [wb], dtype=tl.bfloat16, is_pure=True,
                                           pack=4)
            hi = tl.inline_asm_elementwise(ASM_HI_BF16_SUB8, "=r,=r,r", [wb], dtype=tl.bfloat16, is_pure=True,
                                           pack=4)
        else:
            lo = tl.inline_asm_elementwise(ASM_LO_BF16, "=r,=r,r", [wb], dtype=tl.bfloat16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(ASM_HI_BF16, "=r,=r,r", [wb], dtype=tl.bfloat16, is_pure=True, pack=4)
    if GROUPS == 0:
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, 32))
    else:
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, GROUPS, 32))


@triton.jit
def _k_order(v, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """The eight per-word values v[s] ([BLOCK_N, GROUPS, 4] each, nibble s of word j) -> [BLOCK_N, GROUPS, 32] in
    k order: nibble s = 4a + 2b + c of word j is k = 8j + s; each join appends a minor axis, so join over a
    first (v_s, v_s+4), then b, then c: [..., a, b, c] flattens to s."""
    q = tl.join(tl.join(tl.join(v[0], v[4]), tl.join(v[2], v[6])), tl.join(tl.join(v[1], v[5]), tl.join(v[3], v[7])))
    return tl.reshape(q, (BLOCK_N, GROUPS, 32))


@triton.jit
def _words_values(w, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SUB8: tl.constexpr, X_F16: tl.constexpr,
                  ASM: tl.constexpr):
    """Packed words [BLOCK_N, GROUPS, 4] int32 (4-bit formats) -> the values [BLOCK_N, GROUPS, 32] as fp32
    (q - 8 for Q4_0, q otherwise; exact), nibble s of word j at k = 8j + s. ASM (GPU only): the eight
    nibbles of a word by _word_asm_text; else shifts and masks (the interpreter's path). Both end in the
    same joins, so the CPU tests check the element order the GPU uses."""
    C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r"
    if not ASM:
        o = 8 if SUB8 else 0
        v = (((w & 15) - o).to(tl.float32), (((w >> 4) & 15) - o).to(tl.float32),
             (((w >> 8) & 15) - o).to(tl.float32), (((w >> 12) & 15) - o).to(tl.float32),
             (((w >> 16) & 15) - o).to(tl.float32), (((w >> 20) & 15) - o).to(tl.float32),
             (((w >> 24) & 15) - o).to(tl.float32), (((w >> 28) & 15) - o).to(tl.float32))
    elif X_F16:
        if SUB8:
            v = tl.inline_asm_elementwise(ASM_W_F16_SUB8, C, [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise(ASM_W_F16, C, [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        if SUB8:
            v = tl.inline_asm_elementwise(ASM_W_BF16_SUB8, C, [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise(ASM_W_BF16, C, [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return _k_order(v, BLOCK_N, GROUPS).to(tl.float32)


@triton.jit
def _words_folded(w, s2, c2, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SUB8: tl.constexpr, X_F16: tl.constexpr):
    """GPU only. Packed words [BLOCK_N, GROUPS, 4] int32 and per group the scale and offset as 16-bit pairs
    s2, c2 [BLOCK_N, GROUPS] int32 -> the folded weights [BLOCK_N, GROUPS, 32] in x's dtype (_word_asm_text, fold),
    in _words_values' k order."""
    C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r"
    s3 = tl.broadcast_to(s2[:, :, None], (BLOCK_N, GROUPS, 4))
    c3 = tl.broadcast_to(c2[:, :, None], (BLOCK_N, GROUPS, 4))
    if X_F16:
        if SUB8:
            v = tl.inline_asm_elementwise(ASM_WF_F16_SUB8, C, [w, s3, c3], dtype=(tl.float16,) * 8, is_pure=True,
                                          pack=1)
        else:
            v = tl.inline_asm_elementwise(ASM_WF_F16, C, [w, s3, c3], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        if SUB8:
            v = tl.inline_asm_elementwise(ASM_WF_BF16_SUB8, C, [w, s3, c3], dtype=(tl.bfloat16,) * 8, is_pure=True,
                                          pack=1)
        else:
            v = tl.inline_asm_elementwise(ASM_WF_BF16, C, [w, s3, c3], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return _k_order(v, BLOCK_N, GROUPS)


@triton.jit
def _pair_bits(v, x_ptr, RNE: tl.constexpr):
    """fp32 values -> x's dtype (one rounding), as int32 holding the 16-bit pattern in both halves."""
    b = cast_out(v, x_ptr, RNE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _fold_loop(acc, x_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, rows_x, row_ok, rows_w, N64, G, stride_xm, stride_xk,
               kb_lo, kb_hi, FMT: tl.constexpr, BLOCK_N: tl.constexpr, GPB: tl.constexpr, EVEN_K: tl.constexpr,
               W_EVICT: tl.constexpr, UPCAST: tl.constexpr, DEQ_ASM: tl.constexpr, X_F16: tl.constexpr,
               W16: tl.constexpr):
    """FOLD: the K loop with the scales folded into the weights. Per block of GPB groups every weight is
    dequantized in fp32 exactly as unpack_ref does (products of the file's fp16 values and small integers
    are exact in fp32), rounded once to x's dtype -- the values the dequantized model holds -- and the
    block goes into ONE tensor-core dot accumulating into acc: no fresh dot and rescale per group.
    W16 (4-bit formats): the group's scale and offset rounded to x's dtype first, then q * s + c rounded once
    (kernels.quant_pack.unpack_folded, the folded mma kernel's weights), on the GPU by one packed 16-bit fma per
    pair straight from the word (_words_folded)."""
    WPG: tl.constexpr = 8 if FMT == 3 else 4
    BK: tl.constexpr = GPB * 32
    offs_g = tl.arange(0, GPB)
    g3 = offs_g[None, :, None].to(tl.int64)                                         # [1, GPB, 1]
    r3 = rows_w[:, None, None]                                                      # [BN, 1, 1]
    w_base = qw_ptr + g3 * N64 * WPG + r3 * WPG + tl.arange(0, WPG)[None, None, :]  # [BN, GPB, W] words
    s_off = offs_g[None, :].to(tl.int64) * N64 + rows_w[:, None]                    # [BN, GPB] (g, n)
    offs_k = tl.arange(0, BK)
    x_base = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :] * stride_xk      # [BM, BK]
    for kb in range(kb_lo, kb_hi):                     # ascending K blocks: the one reduction order
        g0 = tl.cast(kb * GPB, tl.int64)
        if EVEN_K:
            g_ok = tl.full((1, GPB), 1, tl.int1)
            x_ok = row_ok[:, None]
        else:
            g_ok = (kb * GPB + offs_g[None, :]) < G                                # [1, GPB]
            x_ok = row_ok[:, None] & ((kb * BK + offs_k[None, :]) < G * 32)
        xk = tl.load(x_base + g0 * 32 * stride_xk, mask=x_ok, other=0.0)
        w = tl.load(w_base + g0 * N64 * WPG, mask=g_ok[:, :, None], other=0, eviction_policy=W_EVICT)
        if FMT == 3:
            v = _expand(w, FMT, BLOCK_N, GPB).to(tl.float32)                          # [BN, GPB, 32]
        elif W16 and DEQ_ASM:
            v = w                                                                     # folded below, in 16 bits
        else:
            v = _words_values(w, BLOCK_N, GPB, FMT == 0, X_F16, DEQ_ASM)
        RNE: tl.constexpr = UPCAST and not X_F16
        # the group's scale s and offset c in fp32, exact (Q4_0 and Q8_0 have no offset)
        if FMT == 2:
            sub = sub_ptr + (s_off + g0 * N64) * 2
            d = tl.load(s_ptr + ((g0 + offs_g[None, :]) // 8) * N64 + rows_w[:, None], mask=g_ok, other=0.0)
            s = d.to(tl.float32) * tl.load(sub, mask=g_ok, other=0).to(tl.float32)
            dm = tl.load(c_ptr + ((g0 + offs_g[None, :]) // 8) * N64 + rows_w[:, None], mask=g_ok, other=0.0)
            c = -(dm.to(tl.float32) * tl.load(sub + 1, mask=g_ok, other=0).to(tl.float32))
        else:
            s = tl.load(s_ptr + s_off + g0 * N64, mask=g_ok, other=0.0).to(tl.float32)
            if FMT == 1:
                c = tl.load(c_ptr + s_off + g0 * N64, mask=g_ok, other=0.0).to(tl.float32)
            else:
                c = s                                                                 # unused: no offset
        if W16 and DEQ_ASM:
            if FMT == 0:
                c2 = tl.full((BLOCK_N, GPB), -2147450880, tl.int32)                   # -0 in both halves
            else:
                c2 = _pair_bits(c, x_ptr, RNE)
            wk = tl.reshape(_words_folded(v, _pair_bits(s, x_ptr, RNE), c2, BLOCK_N, GPB, FMT == 0, X_F16),
                            (BLOCK_N, BK))
        else:
            if W16:   # the same values in fp32: q * s exact, + c exact but in extreme cases, one rounding after
                s = cast_out(s, x_ptr, RNE).to(tl.float32)
                c = cast_out(c, x_ptr, RNE).to(tl.float32)
            if FMT == 1 or FMT == 2:
                wv = v * s[:, :, None] + c[:, :, None]
            else:
                wv = v * s[:, :, None]
            wk = cast_out(tl.reshape(wv, (BLOCK_N, BK)), x_ptr, RNE)                  # one rounding per weight
        if UPCAST:   # interpreter: exact products, fp64 block sums rounded to fp32 (see the module docstring)
            acc = acc + tl.dot(wk.to(tl.float64), tl.trans(xk.to(tl.float64)), out_dtype=tl.float64).to(tl.float32)
        else:
            acc = tl.dot(wk, tl.trans(xk), acc)
    return acc


@triton.jit
def _group_loop(acc, x_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, rows_x, row_ok, rows_w, N64, G, stride_xm, stride_xk,
                kb_lo, kb_hi, FMT: tl.constexpr, BLOCK_N: tl.constexpr, GPB: tl.constexpr, EVEN_K: tl.constexpr,
                W_EVICT: tl.constexpr, UPCAST: tl.constexpr, DEQ_ASM: tl.constexpr, X_F16: tl.constexpr):
    """The K loop with exact integer weights: one fresh dot per 32-weight group, its fp32 scale (and min)
    applied to the group's sums (module docstring)."""
    WPG: tl.constexpr = 8 if FMT == 3 else 4
    offs_j = tl.arange(0, WPG)
    offs_k = tl.arange(0, 32)
    w_base = qw_ptr + rows_w[:, None] * WPG + offs_j[None, :]          # + g * N * WPG
    wb_base = qw_ptr.to(tl.pointer_type(tl.uint8)) + rows_w[:, None] * 16 + tl.arange(0, 16)[None, :]
    x_base = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :] * stride_xk   # + g * 32 * stride_xk
    for kb in range(kb_lo, kb_hi):                     # ascending groups: the one reduction order
        for i in tl.static_range(GPB):
            g = kb * GPB + i
            g64 = g.to(tl.int64)
            if EVEN_K:
                xg = tl.load(x_base + g64 * 32 * stride_xk, mask=row_ok[:, None], other=0.0)
                if DEQ_ASM:
                    wb = tl.load(wb_base + g64 * N64 * 16, eviction_policy=W_EVICT)
                else:
                    w = tl.load(w_base + g64 * N64 * WPG, eviction_policy=W_EVICT)
            else:
                g_ok = (g + tl.zeros((BLOCK_N,), dtype=tl.int32)) < G      # tail group block only
                xg = tl.load(x_base + g64 * 32 * stride_xk, other=0.0,
                             mask=row_ok[:, None] & ((g + tl.zeros((1, 32), dtype=tl.int32)) < G))
                if DEQ_ASM:
                    wb = tl.load(wb_base + g64 * N64 * 16, mask=g_ok[:, None], other=0, eviction_policy=W_EVICT)
                else:
                    w = tl.load(w_base + g64 * N64 * WPG, mask=g_ok[:, None], other=0, eviction_policy=W_EVICT)
            if DEQ_ASM:    # 4-bit formats, compiled only: values straight in x's dtype
                p = tl.dot(_nibbles_asm(wb, BLOCK_N, FMT == 0, X_F16), tl.trans(xg))
            else:
                q = _expand(w, FMT, BLOCK_N)
                if FMT == 0:
                    q = q - 8
                if UPCAST:   # interpreter: exact products and (practically) exact sums -> fp32, see docstring
                    p = tl.dot(q.to(tl.float64), tl.trans(xg.to(tl.float64)), out_dtype=tl.float64).to(tl.float32)
                else:
                    p = tl.dot(q.to(xg.dtype), tl.trans(xg))     # [BLOCK_N, BLOCK_M] fp32, fresh accumulator

            # group scale (and min) per row, fp32, applied after the dot
            if EVEN_K:
                if FMT == 2:
                    sc = tl.load(sub_ptr + (g64 * N64 + rows_w) * 2).to(tl.float32)
                    s = tl.load(s_ptr + (g64 // 8) * N64 + rows_w).to(tl.float32) * sc
                else:
                    s = tl.load(s_ptr + g64 * N64 + rows_w).to(tl.float32)
            else:
                if FMT == 2:
                    sc = tl.load(sub_ptr + (g64 * N64 + rows_w) * 2, mask=g_ok, other=0).to(tl.float32)
                    s = tl.load(s_ptr + (g64 // 8) * N64 + rows_w, mask=g_ok, other=0.0).to(tl.float32) * sc
                else:
                    s = tl.load(s_ptr + g64 * N64 + rows_w, mask=g_ok, other=0.0).to(tl.float32)
            acc = tl.fma(p, s[:, None], acc)
            if FMT == 1 or FMT == 2:
                # X_g[m] = sum of the group's 32 x[m, k], by the same kind of tensor-core dot as P_g with a
                # block of ones: it lands in P's layout, every row n holding the same sums
                if UPCAST:
                    xs = tl.dot(tl.full((BLOCK_N, 32), 1.0, tl.float64), tl.trans(xg.to(tl.float64)),
                                out_dtype=tl.float64).to(tl.float32)
                else:
                    xs = tl.dot(tl.full((BLOCK_N, 32), 1.0, xg.dtype), tl.trans(xg))
                if EVEN_K:
                    if FMT == 1:
                        c = tl.load(c_ptr + g64 * N64 + rows_w).to(tl.float32)
                    else:
                        mn = tl.load(sub_ptr + (g64 * N64 + rows_w) * 2 + 1).to(tl.float32)
                        c = -(tl.load(c_ptr + (g64 // 8) * N64 + rows_w).to(tl.float32) * mn)
                else:
                    if FMT == 1:
                        c = tl.load(c_ptr + g64 * N64 + rows_w, mask=g_ok, other=0.0).to(tl.float32)
                    else:
                        mn = tl.load(sub_ptr + (g64 * N64 + rows_w) * 2 + 1, mask=g_ok, other=0).to(tl.float32)
                        c = -(tl.load(c_ptr + (g64 // 8) * N64 + rows_w, mask=g_ok, other=0.0).to(tl.float32) * mn)
                acc = tl.fma(c[:, None], xs, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, y_ptr, M, N, G,
                  stride_xm, stride_xk, stride_ym, stride_yn, stride_ys, KB_PER_SPLIT,
                  FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GPB: tl.constexpr,
                  EVEN_K: tl.constexpr, W_EVICT: tl.constexpr, UPCAST: tl.constexpr, RNE_BF16: tl.constexpr,
                  DEQ_ASM: tl.constexpr, X_F16: tl.constexpr, FOLD: tl.constexpr, W16: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # FMT: 0 q4_0, 1 q4_1, 2 q4_k, 3 q8_0
    # program -> (split, N tile, M tile), M tile fastest: programs sharing a weight tile run together
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid % num_pid_m
    pid_n = (pid // num_pid_m) % num_pid_n
    pid_s = pid // (num_pid_m * num_pid_n)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    rows_x = tl.where(row_ok, offs_m, 0).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)                  # columns past N re-read valid rows; not stored
    N64 = tl.cast(N, tl.int64)          # tl.cast: N == 1 arrives as a constexpr

    kb_lo = pid_s * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(G, GPB))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if FOLD:
        acc = _fold_loop(acc, x_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, rows_x, row_ok, rows_w, N64, G, stride_xm,
                         stride_xk, kb_lo, kb_hi, FMT, BLOCK_N, GPB, EVEN_K, W_EVICT, UPCAST, DEQ_ASM, X_F16, W16)
    else:
        acc = _group_loop(acc, x_ptr, qw_ptr, s_ptr, c_ptr, sub_ptr, rows_x, row_ok, rows_w, N64, G, stride_xm,
                          stride_xk, kb_lo, kb_hi, FMT, BLOCK_N, GPB, EVEN_K, W_EVICT, UPCAST, DEQ_ASM, X_F16)

    y_ptrs = (y_ptr + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[None, :] * stride_ym
              + offs_n.to(tl.int64)[:, None] * stride_yn)
    mask = (offs_n[:, None] < N) & row_ok[None, :]
    tl.store(y_ptrs, cast_out(acc, y_ptr, RNE_BF16), mask=mask)


# whether triton.jit produced interpreter objects (TRITON_INTERPRET=1 when triton was imported)
_INTERPRETED = type(_w4a16_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------------------------------
# configuration

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# (N, K, fmt) -> tile choices measured per shape, merged over the rule: any of BLOCK_N, BLOCK_K, SPLIT_K,
# num_warps, num_stages, DEQ_ASM (per shape, never per M) and MAX_BLOCK_M (caps the M-dependent BLOCK_M). Keyed by
# (N, K, fmt) alone, so every row's reduction order is independent of M. A shape without an entry takes the rule.
# After editing it at run time call ``clear_config_cache()``. Each entry's probe, and the small shapes left to the
# rule: kernels/PROBES.md, kernels/int4_gemm.py: MEASURED.
MEASURED: dict[tuple[int, int, str], dict[str, int]] = {
    (4096, 4096, "q4_0"): {"SPLIT_K": 4},                  # a split other than the rule's, faster at most B
    # the 27B hybrid's Q4_K shapes: weights folded in 16 bits (W16), and the split where the rule's was not the fastest
    (34816, 5120, "q4_k"): {"SPLIT_K": 2, "W16": True},
    (16384, 5120, "q4_k"): {"SPLIT_K": 1, "W16": True},
    (14336, 5120, "q4_k"): {"SPLIT_K": 1, "W16": True},
    (5120, 6144, "q4_k"): {"W16": True},
    (5120, 17408, "q4_k"): {"W16": True},
    (248320, 5120, "q4_k"): {"W16": True},                 # the LM head
}
_SHAPE_KEYS = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "MAX_BLOCK_M", "DEQ_ASM", "FOLD", "W16"}


def _split_rule(n_tiles: int, k_blocks: int) -> int:
    """Split-K until the grid holds TARGET_PROGRAMS: the smallest S in 1..MAX_SPLIT_K dividing the K blocks,
    keeping >= MIN_KB_PER_SPLIT blocks per split, with n_tiles * S >= TARGET_PROGRAMS (else the largest)."""
    if n_tiles >= TARGET_PROGRAMS:
        return 1
    ok = [s for s in range(1, MAX_SPLIT_K + 1) if k_blocks % s == 0 and k_blocks // s >= MIN_KB_PER_SPLIT]
    if not ok:
        return 1
    enough = [s for s in ok if n_tiles * s >= TARGET_PROGRAMS]
    return enough[0] if enough else ok[-1]


@functools.lru_cache(maxsize=None)
def _shape_rule(N: int, K: int, fmt: str) -> dict:
    """Everything that fixes the K reduction order (and the per-shape launch choices), from (N, K, fmt) only:
    BLOCK_N 64, BLOCK_K 128 and split-K up to ~4 programs per SM: 64-row tiles with more programs beat 128-row
    tiles (kernels/PROBES.md, kernels/int4_gemm.py: TARGET_PROGRAMS)."""
    groups = K // GROUP
    gpb = _next_pow2(max(1, min(GPB_DEFAULT, groups)) + 1) // 2    # a power of two (FOLD's tile)
    k_blocks = _cdiv(groups, gpb)
    block_n = 64                                       # the smallest wgmma M side (swap-AB)
    split = _split_rule(_cdiv(N, block_n), k_blocks)
    rule = {"BLOCK_N": block_n, "BLOCK_K": GROUP * gpb, "SPLIT_K": split, "num_warps": None, "num_stages": 3,
            "MAX_BLOCK_M": BLOCK_M_CHOICES[-1], "DEQ_ASM": DEQ_ASM_DEFAULT and fmt != "q8_0", "FOLD": FOLD_DEFAULT,
            "W16": False}
    measured = MEASURED.get((N, K, fmt), {})
    unknown = set(measured) - _SHAPE_KEYS
    assert not unknown, f"MEASURED[{(N, K, fmt)}]: unknown keys {sorted(unknown)}"
    return {**rule, **measured}


def _block_m(M: int, pin: int | None, cap: int) -> int:
    if pin is not None:
        return pin
    return next(b for b in BLOCK_M_CHOICES if M <= b or b >= cap)


@functools.lru_cache(maxsize=4096)
def _resolve_rule(M: int, N: int, K: int, fmt: str, pin: int | None, m_chunk_max: int) -> dict:
    return _build(M, N, K, fmt, None, pin, m_chunk_max)


def clear_config_cache() -> None:
    """Forget cached configurations (after editing MEASURED or DEQ_ASM_DEFAULT; PIN_BLOCK_M is part of the
    key already)."""
    _shape_rule.cache_clear()
    _resolve_rule.cache_clear()


_OVERRIDE_KEYS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "DEQ_ASM", "FOLD", "W16"}


def _build(M: int, N: int, K: int, fmt: str, override: dict | None, pin: int | None, m_chunk_max: int) -> dict:
    assert fmt in FMT_CODE, f"int4_config: unknown format {fmt!r} (one of {sorted(FMT_CODE)})"
    shape = _shape_rule(N, K, fmt)
    block_n, block_k, split = shape["BLOCK_N"], shape["BLOCK_K"], shape["SPLIT_K"]
    num_warps, num_stages, deq_asm = shape["num_warps"], shape["num_stages"], shape["DEQ_ASM"]
    fold, w16 = shape["FOLD"], shape["W16"]
    block_m = _block_m(M, pin, shape["MAX_BLOCK_M"])
    if override:
        unknown = set(override) - _OVERRIDE_KEYS
        assert not unknown, f"unknown int4 config keys {sorted(unknown)}"
        block_m = override.get("BLOCK_M", block_m)
        block_n = override.get("BLOCK_N", block_n)
        block_k = override.get("BLOCK_K", block_k)
        split = override.get("SPLIT_K", split)
        num_warps = override.get("num_warps", num_warps)
        num_stages = override.get("num_stages", num_stages)
        deq_asm = override.get("DEQ_ASM", deq_asm)
        fold = override.get("FOLD", fold)
        w16 = override.get("W16", w16)
    assert not w16 or (fold and fmt != "q8_0"), "W16 (16-bit folded weights) needs FOLD and a 4-bit format"
    deq_asm = bool(deq_asm) and fmt != "q8_0"
    if num_warps is None:   # 128 x BLOCK_M fp32 accumulators (x2 with the min term) fit 4 warps up to BLOCK_M 32
        num_warps = 8 if block_n >= 128 and block_m >= 64 else 4
    assert block_k % GROUP == 0 and block_k > 0, f"BLOCK_K {block_k} must be a positive multiple of {GROUP}"
    assert block_m >= 16 and block_n >= 16, "tl.dot needs BLOCK_M, BLOCK_N >= 16"
    groups = K // GROUP
    gpb = block_k // GROUP
    assert not fold or gpb & (gpb - 1) == 0, f"FOLD needs BLOCK_K / 32 a power of two, got BLOCK_K {block_k}"
    k_blocks = max(1, _cdiv(groups, gpb))
    split = max(1, min(int(split), k_blocks))
    kb_per_split = _cdiv(k_blocks, split)
    split = _cdiv(k_blocks, kb_per_split)              # no empty splits
    m_chunk = min(M, m_chunk_max) if split > 1 else M
    return {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GPB": gpb, "SPLIT_K": split,
        "K_BLOCKS_PER_SPLIT": kb_per_split, "num_warps": num_warps, "num_stages": num_stages,
        "DEQ_ASM": deq_asm, "FOLD": bool(fold), "W16": bool(w16), "m_chunk": m_chunk,
        "grid": _cdiv(max(m_chunk, 1), block_m) * _cdiv(N, block_n) * split,
        "workspace_bytes": 4 * split * m_chunk * N if split > 1 else 0,
    }


def int4_config(M: int, N: int, K: int, fmt: str) -> dict:
    """The tile configuration w4a16_linear uses for x [M, K] and a [N, K] weight of format `fmt`.

    BLOCK_N / BLOCK_K (= 32 * GPB) / SPLIT_K / K_BLOCKS_PER_SPLIT / DEQ_ASM depend on (N, K, fmt) only
    (they fix the bits); BLOCK_M, num_warps (unless MEASURED pins it), num_stages and the grid also on M.
    ``grid`` counts programs of one launch of m_chunk rows; ``workspace_bytes`` is the split-K fp32 buffer."""
    return dict(_resolve_rule(int(M), int(N), int(K), str(fmt), PIN_BLOCK_M, SPLITK_M_CHUNK))


# --------------------------------------------------------------------------------------------------
# split-K workspace (one per device, grows, never freed while a graph may use it)

_SPLITK = SplitKWorkspace()
_workspace = _SPLITK.get


def reserve_workspace(device: torch.device | str, shapes, max_rows: int) -> None:
    """Size the split-K workspace for up to ``max_rows`` rows of every (N, K, fmt) in ``shapes``, so later
    calls (e.g. during CUDA-graph capture) allocate nothing."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    need = max([int4_config(m, n, k, f)["workspace_bytes"] // 4 for n, k, f in shapes
                for m in (1, min(max_rows, SPLITK_M_CHUNK))], default=0)
    if need:
        _workspace(device, need)


# --------------------------------------------------------------------------------------------------
# host entry point

def w4a16_linear(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
                 config: dict | None = None, defer: bool = False):
    """y = x @ w^T for a packed weight, batch-invariant (module docstring). x [M, K] bf16/fp16, any strides;
    writes into ``out`` [M, N] (any strides) when given: x's dtype, or float32 for the unrounded fp32 result
    (same arithmetic, no final rounding; the tests use it to see reduction-order changes that rounding to
    bf16 would hide). ``config`` overrides the rule's tile choice (tests / tuning only: the bits then follow
    the override).
    ``defer``: where K runs as several splits (one M chunk), return the partials unreduced as a
    kernels.splitk.SplitSums for the consumer to add (``out`` is then not written)."""
    assert isinstance(pw, PackedWeight), f"w4a16_linear: pw must be a PackedWeight, got {type(pw).__name__}"
    assert x.dim() == 2, f"w4a16_linear: x must be [M, K], got {tuple(x.shape)}"
    M, K = x.shape
    N = pw.N
    assert K == pw.K, f"w4a16_linear: x is [{M}, {K}] but the weight is [{N}, {pw.K}]"
    assert x.dtype in _DTYPES, f"w4a16_linear: x dtype {x.dtype} not supported (bf16 / fp16)"
    assert pw.qweight.device == x.device, f"w4a16_linear: weight on {pw.qweight.device}, x on {x.device}"
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (M, N), f"w4a16_linear: out is {tuple(out.shape)}, expected {(M, N)}"
        assert out.dtype in (x.dtype, torch.float32), \
            f"w4a16_linear: out dtype {out.dtype} must be x's ({x.dtype}) or float32"
        assert out.device == x.device, f"w4a16_linear: out on {out.device}, x on {x.device}"
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    assert x.is_cuda or _INTERPRETED, (
        "w4a16_linear: CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
        "first imported (or use w4a16_linear_ref)")

    fmt = pw.fmt
    if config:
        cfg = _build(M, N, K, fmt, config, PIN_BLOCK_M, SPLITK_M_CHUNK)
    else:
        cfg = _resolve_rule(M, N, K, fmt, PIN_BLOCK_M, SPLITK_M_CHUNK)
    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    G = K // GROUP
    # unused pointer slots get a valid tensor (never dereferenced: the branches are constexpr)
    c = pw.mins if pw.mins is not None else pw.scales
    sub = pw.sub if pw.sub is not None else pw.scales
    consts = dict(FMT=FMT_CODE[fmt], BLOCK_M=bm, BLOCK_N=bn, GPB=cfg["GPB"], EVEN_K=(G % cfg["GPB"] == 0),
                  UPCAST=_INTERPRETED, DEQ_ASM=cfg["DEQ_ASM"] and not _INTERPRETED,
                  X_F16=x.dtype == torch.float16, FOLD=cfg["FOLD"], W16=cfg["W16"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    rne = _INTERPRETED and out.dtype == torch.bfloat16

    if split == 1:
        # every weight byte is read once when one M tile covers all rows: stream it past L2
        w_evict = "evict_first" if _cdiv(M, bm) == 1 else ""
        _w4a16_kernel[(cfg["grid"],)](
            x, pw.qweight, pw.scales, c, sub, out, M, N, G,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), 0,
            cfg["K_BLOCKS_PER_SPLIT"], W_EVICT=w_evict, RNE_BF16=rne, **consts, **pdl.triton_opts(x.device))
        return out

    def launch(xs, ws, rows):
        _w4a16_kernel[(_cdiv(rows, bm) * _cdiv(N, bn) * split,)](
            xs, pw.qweight, pw.scales, c, sub, ws, rows, N, G,
            xs.stride(0), xs.stride(1), N, 1, rows * N,
            cfg["K_BLOCKS_PER_SPLIT"], W_EVICT="evict_first" if _cdiv(rows, bm) == 1 else "", RNE_BF16=False,
            **consts, **pdl.triton_opts(xs.device))
    return run_splits(x, out, split, cfg["m_chunk"], _workspace, launch, defer, rne)


__all__ = ["w4a16_linear", "w4a16_linear_ref", "int4_config", "reserve_workspace", "clear_config_cache",
           "MEASURED", "PIN_BLOCK_M"]
