"""W4A16 projection for small batches on tensor cores, y[M, N] = x[M, K] @ w[N, K]^T, in CUDA C++ compiled at
run time (the same NVRTC bindings as kernels/int4_cuda.py), on the PackedWeight layout of engine/quant_pack.py
(Q4_0 / Q4_1 / Q4_K; Q8_0 in the folded form only, see below).

Definition: kernels.int4_gemm.w4a16_linear_ref(x, pw, exact=True), i.e. x @ unpack_ref(w)^T with the file's
exact weights: every group's integer dot product is taken on the tensor cores and scaled in fp32.

Why: the CUDA-core kernel (int4_cuda) spends ~3.5 instructions per weight per lane (nibble to fp32, one FMA per
sequence), so at B = 1 it is issue-bound long before HBM is, and its time grows with every sequence. Here a
warp's mma.sync m16n8k16 takes 16 rows x 16 weights x 8 sequences in one instruction; what is left on the
CUDA cores is turning nibbles into 16-bit integers (a shift, a mask-and-or and a packed fma per pair of
weights: 1.5 instructions per weight), the same for 1 and for 8 sequences, plus per group 2 mmas and 4 fp32
scalings per 8 sequences. SASS of the inner loop (sm_90, bf16, Q4_0, B = 1): ~42 instructions per group per
warp (16 rows x 32 weights), 22 of them the nibble conversion; Q4_K ~80 (three 16-bit loads per row, and its
6-bit scale and min made floats per group).

The kernel (one warp = one 16-row tile; a batch tile of BT <= 8 sequences is the mma's n = 8 columns, 16 and 32
are two and four such blocks sharing the dequantized A fragments)
  Weights as the A operand, untouched integers: lane (g, t) (g = lane / 4, t = lane % 4) loads word t of the
  group's 16-byte record for rows g and g + 8 (a warp load covers 8 consecutive records: 128 contiguous
  bytes). The word's eight nibbles s = 0..7 (weights 8t + s) become four bf16x2 / f16x2 pairs (s, s + 4) with
  one mask-and-or into the exponent of 128 (bf16) or 1024 (fp16) and one fma that removes it (and Q4_0's 8):
  exact small integers. Pairs (0,4), (1,5) feed the group's first mma, (2,6), (3,7) its second. The loads
  step through the layout with pointers; where N % 16 == 0 (every model shape) row g + 8 is a constant
  offset from row g, so one pointer per tensor serves both rows.
  x as the B operand: the mma's k-slots of lane t are weights 8t + (0, 4, 1, 5) and 8t + (2, 6, 3, 7) of the
  group, so x is staged once per block in shared memory in that order (one 16-byte load per lane per group):
  every 16-byte piece copied at once with cp.async (from L2; one load at a time would put a round trip per
  piece on every block's start), then each thread reorders its own pieces. A tile of BT < 8 sequences gets a
  row of zeros that the mma's spare columns read, so no lane masks its operands.
  Per group: D = mma(A_hi, B_hi, mma(A_lo, B_lo, 0)) is the exact-weight dot product P_g (fp32 tensor-core
  accumulation), then acc = fma(s_g, P_g, acc) and, Q4_1 / Q4_K, acc = fma(c_g, X_g, acc) with X_g the
  group's sum of x -- the same per-group formula as int4_cuda, so the two agree to fp32 rounding.
  Block: RT row tiles x P phases = KW warps; phase p takes the split's groups p, p + P, ... in ascending
  order with a ring of U groups of loads in flight (a slot is refilled as soon as it is used); the phases'
  sums are added in phase order at the end; split-K partials go to a workspace and int4_cuda's reduce kernel
  adds them in split order. x for the split's whole K range is staged before the loop, so the loop has no
  barrier; that bounds a split to GMAX groups.

The folded form (fold=True, the dispatch's "cuda_mma_fold"; definition: x @ unpack_folded(w, x.dtype)^T, see
engine/quant_pack.py). Each group's scale and offset are rounded to x's dtype, one more packed fma per pair turns
the exact integers into the weights q * s + c, and the mmas accumulate into acc across the whole K range: no fp32
scaling per group and column block, and no group sums of x (Q4_1 / Q4_K), so nothing but x is staged.
It works on quads of 4 groups (apply_quad): each lane loads a whole 16-byte group record per row and that group's
scales, and an mma's k range spans the quad's 4 groups, so loads and scale work per group drop to a quarter. SASS
per group (sm_90, bf16): Q4_K 53 instructions at B = 1 (the exact form: 85), 63 at B = 32 (120); Q4_0 42 (42).
H200: 34816x5120 Q4_K 41.8 us at B = 1 (2.5 TB/s; exact form 51.9), 83 us at B = 32 (137). Launch shapes of its
own (FOLD_TILES); splits of whole quads. Its bits differ from the exact form's (rounded weights), so it is a
variant of its own. A warp may own MT row tiles (MT, MT16; MEASURED_FOLD per shape): each x fragment it reads from
shared memory then feeds MT tiles' mmas, and each load round brings MT times the weight bytes (sm_90, Q4_K, B = 32:
57 instructions per group and tile with 2 tiles, 68 with one, 119 registers).

Q8_0 (FMT 3) has the folded form only. Its record is 32 bytes per group and row (two 16-byte loads); weights s and
s + 4 of 8p .. 8p + 7 are byte s of words 2p and 2p + 1, so one prmt makes the same pairs nib_pair makes of a 4-bit
word, and x is staged as for the nibbles. A byte's low 7 bits go under the exponent of 128 (fp16: 1024) and its sign
bit into the fma's addend (-128 or -256; -1024 or -1152): two lop3 and one packed fma give the exact q in -128..127,
the fold's fma then q * d rounded once (unpack_folded; d rounded to x's dtype first). Per pair one prmt more than a
nibble pair costs, for twice the bytes: fewer instructions per byte than Q4_0. H200 at B = 1 (int4_gemm's method, the
reduce included, at 68d54b5): 5120x17408 28.6 us (3.3 TB/s; the CUDA-core kernel 42.4, Triton 47.9, bf16
cuBLAS 49.7), 17408x5120 28.7, 5120x12288 23.0, 4096x4096 9.0, 2048x8192 9.1.

Where the time goes (H200; kernels/PROBES.md has the probes behind each clause): at B = 1 a call is a streaming part
plus ~3.3 us (x's staging, the split-K partials, the launch's ramp and tail). Q4_0 streams at ~4.0 TB/s, near the copy
ceiling; Q4_K at ~3.1, bound by the instructions it issues per weight (its scales cost 5-13%) rather than by the tensor
pipe (9-27% busy) or by how many loads are in flight. Built, measured and not kept: weights through a shared-memory
ring, the split-K sum inside the kernel (last block or cluster), the folded form on wgmma, L2 prefetches and cache
policies, several row tiles in a row per warp, dequantizing before the PDL wait, the ring filled after x's copies,
leaner Q4_K scale arithmetic, deeper rings, a stream-K grid whose warps all end together (there was no tail for it
to remove), fewer splits of more than GMAX groups each (fewer warps streaming a weight lose more than the partials
cost), x loaded straight into registers a ring slot ahead instead of staged (slower almost everywhere).

Batch invariance: the split and P (and so every sum's order) come from (N, K, fmt) only; BT only sets how much x
is staged, which mma columns are live and how many column blocks a lane runs, and the columns of an mma are
independent; the row tiles per block, the ring depth and the register budget (RT / U, RT16 / U16 / MINB16 for
tiles of 16+) do not touch a warp's sums. So row m of y is bitwise the same whatever M is, in either form.
"""
from __future__ import annotations

import functools

import torch

from onepass.engine.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from onepass.kernels import int4_cuda, pdl

FORMATS = ("q4_0", "q4_1", "q4_k")           # the exact form
FOLD_FORMATS = FORMATS + ("q8_0",)           # the folded form: Q8_0's bytes become weights as the nibbles do
FMT_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q8_0": 3}
BTG = 32                       # sequences per batch tile: up to four blocks of the mma's n = 8
BT_CHOICES = (1, 2, 4, 8, 16, 32)
GMAX = 32                      # groups per split: x for BT = 32 (and its group sums) staged once in < 99 KB
ROWS_PER_TILE = 16             # the mma's m
NUM_SMS = int4_cuda.NUM_SMS
# launch shape: RT row tiles and P phases per block (KW = RT * P warps), U loads in flight per warp, for tiles of up
# to 8 sequences; RT16, U16 for tiles of 16 and 32. The split is the smallest count that keeps a split within
# GMAX groups and reaches TARGET_BLOCKS blocks (RT row tiles, one batch tile), unless SPLIT_K names it. The split
# and P fix the bits; RT and U do not (a warp's sums are its own), so RT16 / U16 may differ from RT / U.
# Defaults and MEASURED from an H200 sweep (torch 2.11, cupy 14.2) of 5 layouts x 2 splits at B = 1, 4, 8, 16,
# 32: one warp per row tile of 4-warp blocks, 4 groups in flight (RT 4, P 1, U 4) was the best or within 5% at
# B = 1 on 4 of 8 shapes; the entries are the others (us at B = 1 / 4 / 8 against the defaults'). For 16 and 32
# sequences, 16-warp blocks (RT16 16, U16 4) were the fastest on 7 of 8 shapes at B = 32 (5120x12288 Q4_0:
# 31.5 us against 46.9 with 8-warp blocks and 37.2 for bf16 cuBLAS). Rings of 8 groups spilled under the
# register cap (below) and lost everywhere.
RT, P, U = 4, 1, 4
RT16, U16 = 16, 4
MINB16 = 1          # tiles of 16+: blocks per SM the registers must allow (1: what the compiler takes)
TARGET_BLOCKS = 4 * NUM_SMS
MAX_SPLIT = 32
CONFIG_KEYS = ("RT", "P", "U", "MINB", "MT", "RT16", "U16", "MINB16", "MT16", "BTMAX", "SPLIT_K", "TARGET_BLOCKS")
MT_CHOICES = (1, 2, 4)  # the folded form's row tiles per warp (MT, MT16): tiles sharing each x fragment
MEASURED: dict[tuple[int, int, str], dict] = {
    (17408, 5120, "q4_0"): {"RT": 8, "SPLIT_K": 5},            # 21.1 / 22.7 / 24.1 vs 21.3 / 23.1 / 23.9
    (5120, 12288, "q4_0"): {"SPLIT_K": 12},                    # 16.0 / 17.6 / 19.0 vs 16.2 / 18.0 / 19.3
    (2048, 8192, "q4_0"): {"P": 2},                            # 8.0 / 8.4 / 8.7 vs 8.4 / 8.9 / 9.3
    (5120, 17408, "q4_k"): {"RT": 8, "SPLIT_K": 26},           # 29.1 / 33.2 / 33.6 vs 31.5 / 36.3 / 41.1
    (34816, 5120, "q4_k"): {"RT": 8},                          # 51.3 / 58.6 / 60.2 vs 54.0 / 63.0 / 74.5
    (10240, 5120, "q4_k"): {"RT": 8, "SPLIT_K": 7},            # 21.3 / 24.6 / 24.2 vs 22.2 / 25.1 / 28.2
    # the 27B's Q4_0 projections at up to 8 sequences: H200 probe of RT 2 / 4 / 8 x P 1 / 2 x U 2 / 4 / 6 x MINB 1 / 4
    # x 5 / 8 splits (int4_gemm's method at B = 1, partials deferred, late release), us against the default launch:
    # 16384x5120 16.10 / 18.40, 5120x6144 7.37 / 8.69; 34816x5120 30.73 / 31.67 and 14336x5120 14.36 / 15.13 (8
    # splits) too, but in the graphed step neither moved B = 1 or 8 (switch_ab, 27B Q4_0: 5.84 against 5.82 ms at B = 1,
    # within the rounds' spread): not taken. These two pay at B = 8, where the dispatch gives 5120x6144 this kernel
    # (kernels/int4_dispatch.py)
    (16384, 5120, "q4_0"): {"RT": 8, "U": 4, "SPLIT_K": 8},
    (5120, 6144, "q4_0"): {"RT": 8, "U": 6, "SPLIT_K": 6},
}
# The folded form's launch shapes (its U and U16 count quads of 4 groups). H200 sweep of 6 layouts on 10 shapes (the
# 27B hybrid's five Q4_K projections, five Q4_0), B = 1, 4, 8, 16, 32: 8-warp blocks with 2 quads in flight for tiles
# of up to 8 sequences, and 16-warp blocks (256 rows sharing the staged x) with one quad in flight and registers for
# 2 blocks per SM for 16 and 32, were the fastest or within ~10% almost everywhere (34816x5120 Q4_K: 41.5 / 59.2 /
# 61.5 / 91.4 us at B = 1 / 8 / 16 / 32, against 51.3 / 60.2 / 85.5 / 136.3 for the exact form). Bit-neutral.
FOLD_TILES = {f: {"RT": 8, "U": 2, "RT16": 16, "U16": 1, "MINB16": 2} for f in FOLD_FORMATS}
# Per shape, where another launch shape was faster (H200 sweeps against the defaults above). 32-warp blocks (512 rows
# sharing the staged x) for tiles of 16+, B = 16 / 32: the rest lost up to 12% with them (16384x5120 Q4_K B = 32:
# 55.9 against 52.1 us). Two row tiles per warp (MT, MT16: each x fragment read from shared memory feeds both
# tiles' mmas, 16% fewer instructions per group at B = 32), B = 1 / 8 / 16 / 32; they lost elsewhere (5120x6144
# Q4_K B = 32: 23.4 against 19.6 us). MT and RT (tiles of up to 8) set the rows per block and so, where SPLIT_K is
# not named, the split count: a per-shape constant, the same at every M.
# Registers for 4 blocks per SM (MINB 4: 64 per thread) for tiles of up to 8 sequences, bit-neutral, H200 sweep at
# B = 1 / 8: 5120x17408 Q4_K 22.4 / 27.3 us against 23.7 / 28.8, 5120x6144 11.7 / 14.1 against 12.9 / 14.9, 16384x5120
# 23.6 / 27.3 against 24.0 / 28.3, 14336x5120 20.0 / 25.8 against 20.3 / 26.5; within noise or slower on 34816x5120 Q4_K
# and the Q4_0 shapes.
# Re-swept at d75e6e9 (H200, cold weights, partials deferred as in the step, late release as in an engine of 1), B = 1:
# RT 2/4/8 x MT 1/2 x MINB 3/4 x 5-6 splits per shape; the entries below were within 0.25 us of the best on 34816x5120
# (36.6 us), 16384x5120 (19.1), 5120x17408 (19.4) and 5120x6144 (9.0), and 14336x5120 gained 0.6 us with 8 splits
# (16.6 against 17.2; not taken: 16 calls a step). B = 16 / 32 (RT16 4/8/16 x U16 1/2 x MINB16 1-3 x MT16 1/2, the
# same splits): the best shape beat these entries by up to 16% (17408x5120 Q4_0 B = 16: 28.4 against 33.8 us) but
# never the kernel the dispatch picks there (27.3, cuda_wgmma_x2). Why B = 1 is where it is (ncu at eb9811c, clocks
# locked by ncu, cold weights): 34816x5120 issues 0.61 instructions per scheduler per cycle with 3.5 active warps
# (124 registers: 4 blocks per SM, 25% theoretical occupancy), 5120x17408 0.67 with 6.8 (64 registers, 50%); DRAM at
# 42-46% of peak. More warps do not help: MINB 5 / 6 / 8 (fewer registers, the same splits and bits) were 0.3-2.3 us
# slower on all five 27B shapes (34816x5120 U1 MINB6 39.0 against 36.7), so the kernel is bound by the instructions
# it issues per weight, and a faster B = 1 needs fewer of them.
MEASURED_FOLD: dict[tuple[int, int, str], dict] = {
    (34816, 5120, "q4_k"): {"MT": 2, "RT": 4, "U": 2, "MINB": 3, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    #   B = 16 / 32: 61.2 / 83.2 us against 59.8 / 87.3 with 32 warps of one tile (59.5 / 88.9 against 61.8 / 94.6
    #   for those against 16 warps); tiles of up to 8 with two row tiles per warp in 4-warp blocks (the same 128 rows
    #   per block, so the same split and bits), registers for three blocks per SM: H200 sweep at e421dd5 with the
    #   GEMMs' late release (an engine of 1), B = 1: 37.0 us deferred / 38.1 with the reduce, against 39.0 / 40.2
    #   (MINB 4 alone: 37.5; the other launches and splits within 1 us of the default)
    (5120, 17408, "q4_k"): {"MINB": 4, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    #   33.3 / 43.1 us against 32.3 / 45.5 with 32 warps of one tile (32.3 / 45.4 against 33.6 / 49.0)
    (5120, 6144, "q4_k"): {"MINB": 4, "RT16": 32, "MINB16": 1},   # 15.2 / 20.0 against 15.5 / 21.3
    (16384, 5120, "q4_k"): {"MT": 2, "RT": 4, "U": 1, "MINB": 4, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    #   23.9 / 27.8 / 31.5 / 41.6 us against 22.2 / 31.3 / 35.9 / 51.6 (with RT 8); RT 4 (blocks of 128 rows, so 5
    #   splits of 32 groups instead of 8 of 20) at B = 1, H200 probe at aed2748: 20.7 us with the reduce, 19.3
    #   deferred, against 23.4 / 21.4 with RT 8 (U 1..4, MINB 2..4, MT 1, P 2 and other splits were slower)
    (17408, 5120, "q4_0"): {"MT": 2, "RT": 8, "U": 1, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    #   19.7 / 23.7 / 37.1 / 48.5 us against 21.7 / 31.5 / 34.4 / 50.8
    (5120, 17408, "q4_0"): {"MT": 2, "RT": 8, "U": 1, "MINB": 1, "SPLIT_K": 20},
    #   B = 1 / 8: 20.1 / 26.6 us against 21.1 / 25.9; then 20 splits of 28 groups against 17 of 32: 19.9 / 26.1 /
    #   32.1 / 45.3 us at B = 1 / 8 / 16 / 32 against 20.2 / 27.2 / 32.3 / 47.5. Then 8-warp blocks with the registers
    #   left to the compiler (the same split and MT, so the same bits), H200 probe at f893f08 of RT 2-16 x MINB 1-6 x U
    #   1-2 (int4_gemm's method, with the reduce): 17.53 / 20.16 us at B = 1 / 8 against 18.02 / 23.68 (RT 4, MINB 3)
    (5120, 12288, "q4_0"): {"MT": 2, "RT": 8, "U": 2, "MINB": 3, "SPLIT_K": 20},
    #   the same probe: 16-warp blocks, 14.51 / 16.24 us at B = 1 / 8 against 14.56 / 18.38 with 8 (the split named);
    #   then a split of its own (its own bits), H200 probe at bc51bf2 of 5-6 splits x MT 1-2 x RT 4-16 x MINB 1 / 3 x
    #   U 1-2 on the three large Q4_0 shapes: 20 splits, two row tiles per warp, 13.87 / 15.50 us against 14.63 /
    #   16.22 (12 splits, RT 16); 17408x5120 and 5120x17408 had nothing better than their entries
    (4096, 4096, "q4_0"): {"RT": 16, "U": 1, "SPLIT_K": 16},
    #   the same probe: 16-warp blocks, one quad in flight, 6.70 / 7.42 us against 7.38 / 8.09 (RT 8, U 2; split named)
    (14336, 5120, "q4_k"): {"SPLIT_K": 6, "MINB": 4},
    #   20.6 / 26.8 / 31.8 / 45.4 us against 21.4 / 28.3 / 33.7 / 49.0 (S = 5); MINB below
    (248320, 5120, "q4_k"): {"MT": 2, "U": 1, "MINB": 3},   # B = 1 / 8: 242.9 / 283.4 against 242.9 / 373.6 (same split)
    (576, 576, "q4_1"): {"RT16": 4},
    #   SmolLM2's output projection in 64-row blocks from 16 sequences (the same 5 splits). H200 probe at 4ed6ace, us
    #   per call with the split's reduce / deferred, B = 32 / 64 / 128: 4.5 / 4.6 / 5.3 and 3.3 / 3.2 / 3.9 against
    #   5.4 / 5.5 / 5.6 and 4.2 / 4.2 / 4.3 (dequantize + cuBLAS 5.7). SmolLM2's other shapes lose somewhere with
    #   smaller blocks (960x576 at B = 128: 6.3 against 5.8; 3072x576 and 576x1536 at 64 and 128), and one split
    #   (no reduce) is slower on all four (576x576 at B = 128: 8.6 us at best).
    # Q8_0 (a 32-byte record per group and row: a ring slot holds twice the bytes, so one quad in flight is often
    # enough). H200 sweep at 68d54b5 (a probe with int4_gemm's method: graphed calls over
    # rotated weights, PDL, the reduce; RT 2/4/8 x U 1-3 x MINB 1/3/4 x MT 1/2 for tiles of up to 8, then RT16 4-16 x
    # U16 1-2 x MINB16 1-2 x MT16 1-2 with that split), us at B = 1 / 8 and B = 16 / 32 against the default launch.
    # The 5120x17408, 17408x5120 keep it (28.6 / 31.7, 39.4 / 56.9 us; 29.2 / 35.3, 42.2 / 59.7).
    (5120, 12288, "q8_0"): {"RT16": 8, "MT16": 2},                 # B = 16 / 32: 33.1 / 42.3 against 32.8 / 47.3
    (4096, 4096, "q8_0"): {"U": 1, "RT16": 8, "MT16": 2},          # 9.0 / 9.6, 12.2 / 15.2 against 11.3 / 11.2
    (2048, 8192, "q8_0"): {"U": 1, "RT16": 8, "MT16": 2},          # 9.1 / 9.7, 12.5 / 15.0 against 11.4 / 12.2
    (3072, 2048, "q8_0"): {"RT": 4, "MINB": 3, "MT": 2, "RT16": 4, "MT16": 2, "MINB16": 1},   # the same split:
    #   5.8 / 6.3, 8.1 / 10.6 against 6.1 / 6.4, 8.9 / 11.2
    (16384, 2048, "q8_0"): {"U": 1, "MT16": 2, "MINB16": 1},       # 13.4 / 17.7, 19.1 / 23.1 against 15.0 / 17.5
    (2048, 2048, "q8_0"): {"U": 3, "MT": 2, "RT16": 8, "U16": 2, "MINB16": 1, "MT16": 2},   # the same split: 4.6 /
    #   5.7, 6.7 / 8.1 against 4.9 / 5.7, 6.9 / 8.7
    # the folded form keeps the rule's split where MEASURED names one for the exact form only (the 27B's Q4_0
    # launches above): the same bits as before those entries
    (16384, 5120, "q4_0"): {"TARGET_BLOCKS": TARGET_BLOCKS},
    (5120, 6144, "q4_0"): {"TARGET_BLOCKS": TARGET_BLOCKS},
}
# The 27B's Q4_0 shapes keep the default launch: H200 probe at f79e859 (int4_gemm's method, with the reduce, late
# release; MT 1-2 x RT 4-16 x U 1-2 x MINB 1-4, the split following them, and each Q4_K entry above), best us at
# B = 1 against the default fold launch and the exact form: 34816x5120 33.1 (34.5; exact 32.3), 16384x5120 17.6 in
# MT 2, RT 4, U 2, MINB 4 (20.0; 19.6; the dispatch's ws 18.5), 14336x5120 16.8 (17.8; 16.0), 5120x6144 9.6 (9.6-10.0),
# the LM head 199.4 in MT 2, U 2, MINB 3 (208.2; 218.8). Where the exact form or ws is not already faster, about 0.05
# ms of a 5.9 ms B = 1 step in all: not taken.
# The latency launch of the folded form (the dispatch's "cuda_mma_fold_lat"): for shapes of a few microseconds at 32 to
# 128 sequences, where the default launch's many splits (TARGET_BLOCKS blocks at one batch tile) leave a second launch
# adding S x M x N fp32 partials, and its 32-sequence tiles one warp a long chain of mmas. Here the fewest splits that
# keep a split within GMAX groups (one for K <= 1024), a ring of 4 quads in flight per warp from the start (U, U16:
# a split of K = 576 is 5 quads, of 576x1536's 3 splits 4), and batch tiles of at most BTMAX = 16 sequences (twice the
# warps, each weight dequantized once per tile: cheap where the weight is small and stays in L2). Its own split, so
# its own bits; batch-invariant like the default launch (the split comes from (N, K, fmt) alone).
# H200 probe at b66e7ff (int4_gemm's method: graphed calls over rotated weights, PDL on; us at B = 32 / 64 / 128,
# against dequantize + cuBLAS in the same process): 960x576 Q4_1 4.71 / 4.82 / 5.35 (4.85 / 5.82 / 5.88), 576x576
# 4.63 / 4.64 / 4.64 (5.71 / 5.74 / 5.78), 3072x576 5.52 / 6.02 / 8.58 (6.69 / 6.78 / 6.96), 576x1536 in 3 splits 6.53 /
# 6.47 / 7.09 (7.23 / 7.30 / 7.41), 2048x2048 Q4_0 in 4 splits 6.89 at B = 32 (9.95). Slower than the default launch at
# B = 1 and 8 on every one of these shapes (576x576: 2.85 / 3.13 us against 2.46 / 2.57): a variant of its own, not a
# replacement. Not enough at 128 sequences where the weight is larger (3072x576 8.2 us at best against 7.0,
# 2048x2048 13.8 against 10.6: from there the wgmma kernels' tiles of 128 sequences do better; 3072x576 again at
# 660af4f with two row tiles per warp, 16 or 32 rows of blocks, rings of 2 or 4: 7.80 us at best against 6.96; at
# c2102e3 RT16 2-16 x U16 2 / 4 x MINB16 1 / 2 x BTMAX 16 / 32 x MT16 1 / 2: 7.78 at best, RT16 16, U16 2).
# Nor does a split of its own help the large shapes at 16 sequences (the B = 16 target): H200 probe at
# 660af4f, 1 / 2 / 3 times the fewest splits x RT16 4-16 x MT16 1-2 x U16 1-4 x MINB16 1-2 in batch tiles of 16, best
# 32.6 / 30.2 / 20.7 us on 17408x5120 / 5120x17408 / 5120x12288 Q4_0 against cuda_wgmma_x2's 29.1 / 26.1 / 20.1.
LATENCY = {"RT": 4, "U": 4, "MINB": 1, "MT": 1, "RT16": 8, "U16": 4, "MINB16": 1, "MT16": 1, "BTMAX": 16}
MEASURED_LAT: dict[tuple[int, int, str], dict] = {
    (960, 576, "q4_1"): {"RT16": 4},        # B = 32 / 64 / 128: 4.71 / 4.82 / 5.35 us against 4.96 / 5.18 / 5.16 (RT16 8)
    (576, 576, "q4_1"): {"RT16": 4},        # 4.63 / 4.64 / 4.64 against 5.07 / 5.08 / 5.07
    (576, 1536, "q4_1"): {"SPLIT_K": 3},    # 6.53 / 6.47 / 7.09 against 7.14 / 7.31 / 7.55 with 2 splits
    (2048, 2048, "q4_0"): {"SPLIT_K": 4},   # B = 32 / 64: 6.89 / 9.22 against 8.83 / 9.61 with 2 splits
    (3072, 2048, "q4_0"): {"SPLIT_K": 4},   # 9.11 / 11.71 against 10.37 / 14.13
}


def latency_config(N: int, K: int, fmt: str) -> dict:
    """The latency launch's config for (N, K, fmt): LATENCY, the fewest splits, then MEASURED_LAT's entry."""
    return {**LATENCY, "SPLIT_K": max(1, _cdiv(K // GROUP, GMAX)), **MEASURED_LAT.get((N, K, fmt), {})}


SMEM_LIMIT = 99 * 1024    # dynamic shared memory per block: what sm_86 and up allow
MAX_WARPS = 32            # warps per block (1024 threads)

MMA_COMMON = pdl.CUDA_HELPERS + r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

// FMT 0 q4_0, 1 q4_1, 2 q4_k, 3 q8_0 (folded form only); BT batch tile (<= 32); X_F16: x, y fp16 (else bf16); OUT32: y fp32 (the split-K
// workspace, or an fp32 output); RT row tiles and P phases per block; U loads in flight per warp; GMAX groups
// per split at most.
#define KW (RT * P)
#define NB ((BT + 7) / 8)                       /* the mma's 8-column blocks per tile */
#define NRAW (FMT == 2 ? 3 : FMT == 1 ? 2 : 1)   /* per row: q4_0 {d}; q4_1 {d, m}; q4_k {d, dmin, sc | mn << 8} */
#define XROW (GMAX * 16 + 16)                   /* u32 words per staged x row (+16: LDS.128 without conflicts) */
#define XR (BT % 8 ? BT + 1 : BT)               /* staged rows: BT, and a row of zeros for the mma's spare columns */
// blocks per SM the registers must allow: up to 8 sequences and a ring of up to 4 groups, 56 registers a thread
// (1792 a warp: ~36 warps of weight loads in flight per SM; unbounded, NVRTC took 63); otherwise MINB (the
// launch's MINB16 for tiles of 16+, the folded form's MINB for smaller ones: 1 leaves the compiler free)
#define MIN_BLOCKS (!FOLD && BT <= 8 && U <= 4 ? (65536 / 1792) / KW : MINB)
// dynamic shared memory, in this order (kernels/int4_mma.py's smem_bytes is the same sum)
#define XS_BYTES (XR * XROW * 4)                                 /* xs[XR][XROW] */
#define XSUMS ((FMT == 1 || FMT == 2) && !FOLD)  /* the min term needs x's group sums (not when folded) */
#if FMT == 3 && !FOLD
#error "q8_0 has the folded form only"
#endif
#define XP_BYTES (XSUMS ? (BT * 4 + XR) * GMAX * 4 : 0)          /* xpart[BT][GMAX][4], xsum[XR][GMAX] */
#define SMEM_TOTAL (XS_BYTES + XP_BYTES + (P - 1) * RT * 32 * MT * 4 * NB * 4)   /* + red[P - 1][RT][32][MT * 4 * NB] */

#ifndef ONEPASS_HOST_EMU
__device__ __forceinline__ float h2f(u16 v) {
    float f; asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v)); return f;
}
__device__ __forceinline__ u16 f32_to_x(float f) {
    u16 r;
#if X_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
__device__ __forceinline__ float x_to_f32(u32 v16) {
#if X_F16
    return h2f((u16)v16);
#else
    return __int_as_float(v16 << 16);
#endif
}
__device__ __forceinline__ u32 ld_word(const u32* p) {       // weights: read once, keep L1 for x
    u32 r; asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r; asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p)); return r;
}
// 16 bytes global -> shared, asynchronously (bytes = 0: zero fill, nothing read)
__device__ __forceinline__ void cp_async16_s(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ uint4 ld_w16(const uint4* p) {   // weights, 16 bytes: read once, keep L1 for x
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint4 ld_x16(const uint4* p) {
    uint4 r; asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel)); return r;
}
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 r; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {   // packed 16-bit a * b + c (exact here)
    u32 r;
#if X_F16
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
#endif
    return r;
}
// f rounded to x's dtype, in both halves of a packed pair
__device__ __forceinline__ u32 pack2(float f) {
    u32 r;
#if X_F16
    asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
#endif
    return r;
}
// D = A (16 x 16, row) * B (16 x 8, col) + C, fp32 accumulation
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if X_F16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
#endif
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// the 16-bit pattern whose value is 2^7 (bf16) or 2^10 (fp16) with the unit in the low 4 bits; the fma's
// addend takes that power (and q4_0's 8) back off
#if X_F16
#define MAGIC 0x64006400u
#define ONE2 0x3C003C00u
#define NEGOFF (FMT == 0 ? 0xE408E408u : 0xE400E400u)   /* -(1024 + 8), -1024 */
#else
#define MAGIC 0x43004300u
#define ONE2 0x3F803F80u
#define NEGOFF (FMT == 0 ? 0xC308C308u : 0xC300C300u)   /* -(128 + 8), -128 */
#endif

// nibbles s and s + 4 of w as a packed pair of exact integers (q4_0: q - 8)
#if X_F16
// fp16's 10-bit mantissa also holds a nibble at bits 4-7 of a half (its unit then 16, taken off by the fma's 1/16):
// one shift per word (w >> 8, shared by s = 2, 3) instead of bf16's three; the same integers, so the same bits.
// H200 probe at 4060f6f (int4_gemm's method, fp16 x, the folded form, us at B = 1 this / three shifts): 5120x17408
// Q4_0 18.01 / 18.20, 34816x5120 Q4_K 36.77 / 37.93, 5120x17408 Q4_K 20.31 / 20.80 (SASS per quad: 285 / 315, 692 / 753)
#define SIXTEENTH2 0x2C002C00u
#define NEGOFF_HI (FMT == 0 ? 0xD480D480u : 0xD400D400u)   /* -(64 + 8), -64 */
__device__ __forceinline__ u32 nib_pair(u32 w, int s) {
    const u32 v = s >= 2 ? w >> 8 : w;
    return (s & 1) ? fma2(and_or(v, 0x00F000F0u, MAGIC), SIXTEENTH2, NEGOFF_HI)
                   : fma2(and_or(v, 0x000F000Fu, MAGIC), ONE2, NEGOFF);
}
#else
__device__ __forceinline__ u32 nib_pair(u32 w, int s) {
    return fma2(and_or(s == 0 ? w : w >> (4 * s), 0x000F000Fu, MAGIC), ONE2, NEGOFF);
}
#endif

struct Slot {                  // one group's loads for the lane's two rows (g, g + 8)
    u32 wa, wb;                // word t of each row's record
    u32 ra[NRAW], rb[NRAW];    // raw scale bits per row
};

// Where the lane's next group comes from: row a's word t and raw bits, stepped by P groups per load. Row b is
// 8 rows on: a constant offset when N16 (N % 16 == 0, every model shape), else its own pointers (rows past N
// re-read row N - 1). q4_k's d and dmin are per super-block: s, m point at row a's column and g picks the row.
struct Cursor {
    const u32* w;
    const u16 *s, *m, *u;      // q4_0 {d}; q4_1 {d, m}; q4_k {d, dmin, sub (sc | mn << 8)}
#if !N16
    const u32* wb;
    const u16 *sb, *mb, *ub;
#endif
    int g;
};
#if N16
#define ROW_B(c, f, rows) ((c).f + 8 * (rows))
#else
#define ROW_B(c, f, rows) ((c).f##b)
#endif

__device__ __forceinline__ void load_slot(Slot& sl, Cursor& c, int N) {
    const int step = P * N;
    sl.wa = ld_word(c.w);
    sl.wb = ld_word(ROW_B(c, w, 4));
    c.w += step * 4;
#if !N16
    c.wb += step * 4;
#endif
#if FMT == 2
    const int so = (c.g >> 3) * N;
    sl.ra[0] = c.s[so]; sl.rb[0] = ROW_B(c, s, 1)[so];
    sl.ra[1] = c.m[so]; sl.rb[1] = ROW_B(c, m, 1)[so];
    sl.ra[2] = c.u[0]; sl.rb[2] = ROW_B(c, u, 1)[0];
    c.u += step;
#if !N16
    c.ub += step;
#endif
#else
    sl.ra[0] = c.s[0]; sl.rb[0] = ROW_B(c, s, 1)[0];
    c.s += step;
#if !N16
    c.sb += step;
#endif
#if FMT == 1
    sl.ra[1] = c.m[0]; sl.rb[1] = ROW_B(c, m, 1)[0];
    c.m += step;
#if !N16
    c.mb += step;
#endif
#endif
#endif
    c.g += P;
}

// a byte of r (sel 0x7440: byte 0, 0x7441: byte 1) as a float, exactly: one prmt puts it under the exponent of
// 2^23 (where its unit is 1), one fadd takes 2^23 off (an I2F is a quarter-rate instruction)
__device__ __forceinline__ float byte_f32(u32 r, u32 sel) {
    return __int_as_float(prmt(r, 0x4B000000u, sel)) - 8388608.0f;
}

// the group's scale (and for q4_1 / q4_k its min term's factor) from one row's raw bits, in fp32 (exact)
__device__ __forceinline__ float slot_scale(const u32 (&r)[NRAW]) {
#if FMT == 2
    return h2f((u16)r[0]) * byte_f32(r[2], 0x7440u);
#else
    return h2f((u16)r[0]);
#endif
}
__device__ __forceinline__ float slot_min(const u32 (&r)[NRAW]) {
#if FMT == 2
    return -(h2f((u16)r[1]) * byte_f32(r[2], 0x7441u));
#elif FMT == 1
    return h2f((u16)r[1]);
#else
    return 0.0f;
#endif
}

// one group: per 8-column block c, two mmas on exact integers (x from the staged row xr[c], this lane's 16 bytes
// of group gi; the zero row where the lane's column is past the tile), then the group's scale and, q4_1 / q4_k,
// its min term (sums xs2[.][gi] of the lane's two columns, the zero row's past the tile) in fp32.
__device__ __forceinline__ void apply_slot(float (&acc)[MT][4 * NB], const Slot& sl, const u32* const (&xr)[NB],
                                           const float* const (&xs2)[2 * NB], int gi, int t) {
    u32 a_lo[4], a_hi[4];
    a_lo[0] = nib_pair(sl.wa, 0); a_lo[1] = nib_pair(sl.wb, 0);
    a_lo[2] = nib_pair(sl.wa, 1); a_lo[3] = nib_pair(sl.wb, 1);
    a_hi[0] = nib_pair(sl.wa, 2); a_hi[1] = nib_pair(sl.wb, 2);
    a_hi[2] = nib_pair(sl.wa, 3); a_hi[3] = nib_pair(sl.wb, 3);
    const float sa = slot_scale(sl.ra), sb = slot_scale(sl.rb);
#if FMT != 0
    const float ca = slot_min(sl.ra), cb = slot_min(sl.rb);
#endif
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xr[c] + (gi * 4 + t) * 4);
        const u32 b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma16816(d, a_lo, b_lo);
        mma16816(d, a_hi, b_hi);
        float* ac = acc[0] + 4 * c;
        ac[0] = __fmaf_rn(sa, d[0], ac[0]);
        ac[1] = __fmaf_rn(sa, d[1], ac[1]);
        ac[2] = __fmaf_rn(sb, d[2], ac[2]);
        ac[3] = __fmaf_rn(sb, d[3], ac[3]);
#if FMT != 0
        const float x0 = xs2[2 * c][gi], x1 = xs2[2 * c + 1][gi];
        ac[0] = __fmaf_rn(ca, x0, ac[0]);
        ac[1] = __fmaf_rn(ca, x1, ac[1]);
        ac[2] = __fmaf_rn(cb, x0, ac[2]);
        ac[3] = __fmaf_rn(cb, x1, ac[3]);
#endif
    }
}

// 8 staged x values of one word, k = 8w + 0..7 as pairs (0,1) (2,3) (4,5) (6,7) -> (0,4) (1,5) (2,6) (3,7): the pairs
// nib_pair makes of the weights
__device__ __forceinline__ uint4 pair_order(const uint4 v) {
    return make_uint4(prmt(v.x, v.z, 0x5410u), prmt(v.x, v.z, 0x7632u), prmt(v.y, v.w, 0x5410u),
                      prmt(v.y, v.w, 0x7632u));
}

#if FOLD
// The folded form works on quads of 4 consecutive groups: lane (g, t) owns group 4j + t of quad j, all 16 bytes of
// its record for rows g and g + 8 (one 16-byte load each), and its scale and offset. The quad's four words p = 0..3
// feed four mma pairs; in pair p every lane gives word p of its own group, so an mma's k range spans the quad's 4
// groups (x is staged in that order) -- possible because the scales are applied to the weights before the mma.
// Per group that is a quarter of the loads and of the scale work of the exact form.
struct QSlot {                 // one quad's loads for the lane's group: rows (g, g + 8) of each of the MT tiles
    uint4 wa[MT], wb[MT];
#if FMT == 3
    uint4 wa2[MT], wb2[MT];    // q8_0: a group's record is 32 bytes, weights 16..31 here
#endif
    u32 ra[MT][NRAW], rb[MT][NRAW];
};
// Where a quad's instructions go (nvcc 13.0 offline, sm_90, at 660af4f; the B = 1 launches of MEASURED_FOLD): the
// loop over one quad of 5120x17408 Q4_0 (MT 2: 16 words) issues 315, of them LOP3 64, HFMA2 64, HMUL2 64 and SHF 49
// (the nibbles: 77%), HMMA 16, LDG 8, LDS 4, and ~30 of address arithmetic (64-bit products and shifts per load);
// 34816x5120 Q4_K 753. Keeping each lane's record index as a running 32-bit count (one wide multiply-add per load)
// cut that to 312 and 729, and raised 5120x17408 Q4_K from 405 to 411 (constants reloaded under its register cap):
// 1-3% at most of an issue-bound loop, not kept.
struct QCursor {               // the lane's next group; in tile m row b is db[m] rows after row a (8, or fewer past N)
    const uint4* w;
    const u16 *s, *m, *u;
    int na[MT], db[MT], g;
};

__device__ __forceinline__ void load_quad(QSlot& sl, QCursor& c, int N, int g_end) {
    const int g = min(c.g, g_end - 1);          // past the split (its last quad): a valid group, whose x is zero
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const i64 e = (i64)g * N + c.na[mt];
        const int db = c.db[mt];
#if FMT == 3
        sl.wa[mt] = ld_w16(c.w + 2 * e); sl.wa2[mt] = ld_w16(c.w + 2 * e + 1);
        sl.wb[mt] = ld_w16(c.w + 2 * (e + db)); sl.wb2[mt] = ld_w16(c.w + 2 * (e + db) + 1);
#else
        sl.wa[mt] = ld_w16(c.w + e);
        sl.wb[mt] = ld_w16(c.w + e + db);
#endif
#if FMT == 2
        const i64 so = (i64)(g >> 3) * N + c.na[mt];
        sl.ra[mt][0] = c.s[so]; sl.rb[mt][0] = c.s[so + db];
        sl.ra[mt][1] = c.m[so]; sl.rb[mt][1] = c.m[so + db];
        sl.ra[mt][2] = c.u[e]; sl.rb[mt][2] = c.u[e + db];
#else
        sl.ra[mt][0] = c.s[e]; sl.rb[mt][0] = c.s[e + db];
#if FMT == 1
        sl.ra[mt][1] = c.m[e]; sl.rb[mt][1] = c.m[e + db];
#endif
#endif
    }
    c.g += 4 * P;
}

// a quad's scale and offset per row, rounded to x's dtype and packed in pairs (q4_0: -0, so q * s rounds once)
struct QScales { u32 sa[MT], sb[MT], ca[MT], cb[MT]; };
__device__ __forceinline__ QScales quad_scales(const QSlot& sl) {
    QScales q;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#if defined(READY_SCALES) && READY_SCALES
        // int4_wgmma_ws's ready words (scale | offset << 16), already rounded: each half into both halves of a pair
        q.sa[mt] = prmt(sl.ra[mt][0], 0u, 0x1010u); q.sb[mt] = prmt(sl.rb[mt][0], 0u, 0x1010u);
        q.ca[mt] = prmt(sl.ra[mt][0], 0u, 0x3232u); q.cb[mt] = prmt(sl.rb[mt][0], 0u, 0x3232u);
#else
        q.sa[mt] = pack2(slot_scale(sl.ra[mt])); q.sb[mt] = pack2(slot_scale(sl.rb[mt]));
#if FMT != 0
        q.ca[mt] = pack2(slot_min(sl.ra[mt])); q.cb[mt] = pack2(slot_min(sl.rb[mt]));
#else
        q.ca[mt] = 0x80008000u; q.cb[mt] = 0x80008000u;
#endif
#endif
    }
    return q;
}
#if FMT == 3
// q8_0: weights s and s + 4 of 8p..8p+7 (byte s of words 2p and 2p + 1) as a packed pair of exact integers, the same
// pairs nib_pair makes of a 4-bit word, so x is staged alike. A byte's low 7 bits r go under MAGIC (128 + r, or
// 1024 + r in fp16) and its sign bit into the addend: -128 or -256 (-1024 or -1152), so the fma leaves r - 128 h = q.
__device__ __forceinline__ u32 byte_pair(u32 lo, u32 hi, int s) {
    const u32 v = prmt(lo, hi, (u32)(s | s << 4 | (4 + s) << 8 | (4 + s) << 12));   // byte s of lo, of hi: one a half
    return fma2(and_or(v, 0x007F007Fu, MAGIC), ONE2, and_or(v, 0x00800080u, MAGIC | 0x80008000u));
}
#define WEIGHT_PAIR(w, w2, s) byte_pair(w, w2, s)
#else
#define WEIGHT_PAIR(w, w2, s) nib_pair(w, s)
#endif
// word p of the lane's group (q8_0: words 2p, 2p + 1) as the A fragment of k16 step 2p + h (mma.m16n8k16's layout,
// which is also a warp's part of wgmma's m64 A): the weights q * s + c, one packed fma per pair; h = 0 takes pairs
// (0,4) (1,5), h = 1 (2,6) (3,7)
__device__ __forceinline__ void quad_half(const QSlot& sl, const QScales& q, int p, int mt, int h, u32 (&a)[4]) {
#if FMT == 3
    const uint4 va = p < 2 ? sl.wa[mt] : sl.wa2[mt], vb = p < 2 ? sl.wb[mt] : sl.wb2[mt];
    const u32 wa = p & 1 ? va.z : va.x, wa2 = p & 1 ? va.w : va.y;
    const u32 wb = p & 1 ? vb.z : vb.x, wb2 = p & 1 ? vb.w : vb.y;
#else
    const u32 wa = p == 0 ? sl.wa[mt].x : p == 1 ? sl.wa[mt].y : p == 2 ? sl.wa[mt].z : sl.wa[mt].w;
    const u32 wb = p == 0 ? sl.wb[mt].x : p == 1 ? sl.wb[mt].y : p == 2 ? sl.wb[mt].z : sl.wb[mt].w;
#endif
    a[0] = fma2(WEIGHT_PAIR(wa, wa2, 2 * h), q.sa[mt], q.ca[mt]); a[1] = fma2(WEIGHT_PAIR(wb, wb2, 2 * h), q.sb[mt], q.cb[mt]);
    a[2] = fma2(WEIGHT_PAIR(wa, wa2, 2 * h + 1), q.sa[mt], q.ca[mt]);
    a[3] = fma2(WEIGHT_PAIR(wb, wb2, 2 * h + 1), q.sb[mt], q.cb[mt]);
}
// both k16 steps of word p
__device__ __forceinline__ void quad_word(const QSlot& sl, const QScales& q, int p, int mt, u32 (&a_lo)[4],
                                          u32 (&a_hi)[4]) {
    quad_half(sl, q, p, mt, 0, a_lo);
    quad_half(sl, q, p, mt, 1, a_hi);
}
#endif
"""

MMA_KERNEL = r"""
#if FOLD
// quad j: the weights q * s + c (scale and offset rounded to x's dtype, one packed fma per pair), then per word p
// and 8-column block two mmas per row tile accumulating straight into acc (the tiles share each x fragment read
// from shared memory); no fp32 scaling, no group sums of x
__device__ __forceinline__ void apply_quad(float (&acc)[MT][4 * NB], const QSlot& sl, const u32* const (&xr)[NB],
                                           int j, int t) {
    const QScales q = quad_scales(sl);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        u32 a_lo[MT][4], a_hi[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) quad_word(sl, q, p, mt, a_lo[mt], a_hi[mt]);
#pragma unroll
        for (int c = 0; c < NB; ++c) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xr[c] + ((4 * j + p) * 4 + t) * 4);
            const u32 b_lo[2] = {xv.x, xv.y}, b_hi[2] = {xv.z, xv.w};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float (&ac)[4] = *reinterpret_cast<float (*)[4]>(acc[mt] + 4 * c);
                mma16816(ac, a_lo[mt], b_lo);
                mma16816(ac, a_hi[mt], b_hi);
            }
        }
    }
}
#endif

#if FOLD
#define APPLY(acc, sl, j) apply_quad(acc, sl, xr, j, t)
#define LOAD(sl) load_quad(sl, cur, N, g_lo + ng)
#define XSLOT(e) (((e) & ~15) | (((e) & 3) << 2) | (((e) >> 2) & 3))
#else
#define APPLY(acc, sl, gi) apply_slot(acc, sl, xr, xs2, gi, t)
#define LOAD(sl) load_slot(sl, cur, N)
#define XSLOT(e) (e)
#endif

extern "C" __global__ void __launch_bounds__(KW * 32, MIN_BLOCKS)
w4a16_mma(const u16* __restrict__ x, const u32* __restrict__ qw, const u16* __restrict__ sc,
          const u16* __restrict__ mn, const u16* __restrict__ sub, void* __restrict__ y,
          int sxm, int sym, int sys, int M, int N, int G, int gps, int n_bt, int n_nt)
{
#ifdef ONEPASS_HOST_EMU
    unsigned char* smem = g_smem;
#else
    extern __shared__ __align__(16) unsigned char smem[];
#endif
    u32 (*xs)[XROW] = reinterpret_cast<u32 (*)[XROW]>(smem);
#if XSUMS
    float (*xpart)[GMAX][4] = reinterpret_cast<float (*)[GMAX][4]>(smem + XS_BYTES);
    float (*xsum)[GMAX] = reinterpret_cast<float (*)[GMAX]>(smem + XS_BYTES + BT * GMAX * 16);
#endif
#if P > 1
    float (*red)[RT][32][MT * 4 * NB] = reinterpret_cast<float (*)[RT][32][MT * 4 * NB]>(smem + XS_BYTES + XP_BYTES);
#endif

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, t = lane & 3;
    const int rt = warp % RT, ph = warp / RT;
    int pid = blockIdx.x;                       // batch tile fastest: blocks sharing weights run together
    const int bt = pid % n_bt; pid /= n_bt;
    const int nt = pid % n_nt;
    const int s = pid / n_nt;
    const int m0 = bt * BT;
    const int n0 = (nt * RT + rt) * 16 * MT;             // the warp's MT tiles of 16 rows
    const int g_lo = s * gps;
    const int ng = min(G, g_lo + gps) - g_lo;   // groups of this split
#if FOLD
    const int nu = (ng + 3) >> 2;               // quads of this split (only a last split may end in a partial one)
#else
    const int nu = ng;
#endif
    const int ni = nu > ph ? (nu - ph + P - 1) / P : 0;   // units (groups, or quads) of this warp: ph + i * P

    // 1. the first U units' loads, before x is staged
#if FOLD
    QCursor cur;
    {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int na = min(n0 + 16 * mt + g8, N - 1);
            cur.na[mt] = na;
            cur.db[mt] = min(n0 + 16 * mt + g8 + 8, N - 1) - na;    // rows past N re-read a valid row
        }
        cur.g = g_lo + 4 * ph + t;
        cur.w = reinterpret_cast<const uint4*>(qw);
        cur.s = sc; cur.m = mn; cur.u = sub;
    }
    QSlot ring[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < ni) load_quad(ring[u], cur, N, g_lo + ng);
    }
#else
    Cursor cur;
    {
        const int g0 = g_lo + ph, na = min(n0 + g8, N - 1);
        const i64 ia = (i64)g0 * N + na;
        cur.w = qw + ia * 4 + t;
        cur.g = g0;
#if FMT == 2
        cur.s = sc + na; cur.m = mn + na; cur.u = sub + ia;
#else
        cur.s = sc + ia; cur.m = FMT == 1 ? mn + ia : nullptr; cur.u = nullptr;
#endif
#if !N16
        const int nb = min(n0 + g8 + 8, N - 1);                    // rows past N re-read a valid row
        const i64 ib = (i64)g0 * N + nb;
        cur.wb = qw + ib * 4 + t;
#if FMT == 2
        cur.sb = sc + nb; cur.mb = mn + nb; cur.ub = sub + ib;
#else
        cur.sb = sc + ib; cur.mb = FMT == 1 ? mn + ib : nullptr; cur.ub = nullptr;
#endif
#endif
    }
    Slot ring[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < ni) load_slot(ring[u], cur, N);
    }
#endif

    // PDL: the weights above are constant, so they may load before the kernel before this one has flushed; x and
    // the outputs wait for it
    pdl_wait();

    // 2. x[m0 .. m0 + BT, split's K range) -> shared memory, 8 values per item: every item's 16 bytes copied
    //    at once (cp.async: in flight together, no registers held beside the weight ring; rows past M and the
    //    zero row b = BT are zero-filled), then each thread puts its own items in the mma's k-slot order
    //    Folded: item e = 16j + 4t + p (word p of group 4j + t) goes to slot 16j + 4p + t, the order the quads'
    //    mmas read; a partial last quad's missing groups are zero.
    const int items = XR * nu * (FOLD ? 16 : 4), row_items = nu * (FOLD ? 16 : 4);
    {
        int b = 0, e = threadIdx.x;                                // item i = b * row_items + e
        for (int i = threadIdx.x; i < items; i += KW * 32) {
            while (e >= row_items) { e -= row_items; ++b; }
            const bool live = b < BT && m0 + b < M && (e >> 2) < ng;
            const u16* src = x + (i64)(live ? m0 + b : 0) * sxm + (i64)g_lo * 32 + (live ? e * 8 : 0);
            cp_async16_s(smem_addr(&xs[b][XSLOT(e) * 4]), src, live ? 16 : 0);
            e += KW * 32;
        }
        cp_async_commit();
        cp_async_wait_all();
    }
    {
        int b = 0, e = threadIdx.x;
        for (int i = threadIdx.x; i < items; i += KW * 32) {
            while (e >= row_items) { e -= row_items; ++b; }
            uint4* slot = reinterpret_cast<uint4*>(&xs[b][XSLOT(e) * 4]);
            const uint4 v = *slot;
            *slot = pair_order(v);
#if XSUMS
            // the item's 8 values summed in k order; the group's 4 items are added in word order below
            float p = x_to_f32(v.x & 0xFFFFu);
            p += x_to_f32(v.x >> 16);
            p += x_to_f32(v.y & 0xFFFFu);
            p += x_to_f32(v.y >> 16);
            p += x_to_f32(v.z & 0xFFFFu);
            p += x_to_f32(v.z >> 16);
            p += x_to_f32(v.w & 0xFFFFu);
            p += x_to_f32(v.w >> 16);
            if (b < BT) xpart[b][e >> 2][e & 3] = p;
#endif
            e += KW * 32;
        }
    }
    __syncthreads();
#if XSUMS
    for (int i = threadIdx.x; i < XR * ng; i += KW * 32) {
        const int b = i / ng, gi = i - b * ng;
        xsum[b][gi] = b < BT ? ((xpart[b][gi][0] + xpart[b][gi][1]) + xpart[b][gi][2]) + xpart[b][gi][3] : 0.0f;
    }
    __syncthreads();
#endif

    // 3. the warp's groups in order: full rounds of the ring (each slot refilled right after use), then the
    //    last partial round from the loads already in flight
    float acc[MT][4 * NB];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) acc[mt][j] = 0.0f;
    }
    const u32* xr[NB];
    const float* xs2[2 * NB];
#pragma unroll
    for (int c = 0; c < NB; ++c) {
        const int b = 8 * c + g8;                                  // the lane's B column
        xr[c] = &xs[b < BT ? b : BT][0];
#pragma unroll
        for (int h = 0; h < 2; ++h) {                              // the lane's D columns
            const int bd = 8 * c + 2 * t + h;
#if XSUMS
            xs2[2 * c + h] = &xsum[bd < BT ? bd : BT][0];
#else
            xs2[2 * c + h] = nullptr;                              // no min term
#endif
        }
    }
    int i = 0;
    for (; i + U <= ni; i += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            APPLY(acc, ring[u], ph + (i + u) * P);
            if (i + u + U < ni) LOAD(ring[u]);                    // warp-uniform
        }
    }
    pdl_release();                              // every weight load issued
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (i + u < ni) APPLY(acc, ring[u], ph + (i + u) * P);
    }

    // 4. the phases' sums in phase order, by phase 0; lane (g, t) holds rows g, g + 8 of each tile x sequences
    //    8c + 2t, + 1
#if P > 1
    if (ph > 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) red[ph - 1][rt][lane][mt * 4 * NB + j] = acc[mt][j];
        }
    }
    __syncthreads();
    if (ph != 0) return;
#pragma unroll
    for (int q = 0; q < P - 1; ++q) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int j = 0; j < 4 * NB; ++j) acc[mt][j] += red[q][rt][lane][mt * 4 * NB + j];
        }
    }
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < 4 * NB; ++j) {
            const int n = n0 + 16 * mt + g8 + ((j & 3) >= 2 ? 8 : 0), b = 8 * (j >> 2) + 2 * t + (j & 1), m = m0 + b;
            if (n < N && b < BT && m < M) {
#if OUT32
                reinterpret_cast<float*>(y)[(i64)s * sys + (i64)m * sym + n] = acc[mt][j];
#else
                reinterpret_cast<u16*>(y)[(i64)m * sym + n] = f32_to_x(acc[mt][j]);
#endif
            }
        }
    }
}
"""
MMA_SOURCE = MMA_COMMON + MMA_KERNEL


def available() -> bool:
    """Whether the kernel can run here: a CUDA device of compute capability >= 8.0 (mma.sync bf16) and an
    NVRTC binding (int4_cuda's)."""
    if not int4_cuda.available():
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def supports(fmt: str, fold: bool = False) -> bool:
    """Whether the exact form (or, fold=True, the folded form) takes weights of this format."""
    return fmt in (FOLD_FORMATS if fold else FORMATS)


SOURCE_DEFINES = 12


def source(fmt: str, bt: int, x_f16: bool, out32: bool, rt: int, p: int, u: int, n16: bool, fold: bool = False,
           minb: int = 1, mt: int = 1) -> str:
    """The full source of one instantiation: SOURCE_DEFINES #define lines, then MMA_SOURCE. n16: N % 16 == 0;
    fold: the folded form (scales folded into 16-bit weights, one fp32 accumulation across K); minb: blocks per
    SM the registers must allow (tiles of 16+); mt: row tiles of 16 per warp (folded form only)."""
    if mt != 1 and not fold:
        raise ValueError("int4_mma: several row tiles per warp (MT) only in the folded form")
    head = (f"#define FMT {FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n#define OUT32 {int(out32)}\n"
            f"#define RT {rt}\n#define P {p}\n#define U {u}\n#define GMAX {GMAX}\n#define N16 {int(n16)}\n"
            f"#define FOLD {int(fold)}\n#define MINB {minb}\n#define MT {mt}\n")
    return head + MMA_SOURCE


@functools.lru_cache(maxsize=None)
def _kernel(fmt: str, bt: int, x_f16: bool, out32: bool, rt: int, p: int, u: int, n16: bool, fold: bool, minb: int,
            mt: int, device: torch.device):
    how = int4_cuda._compiler()
    if how is None:
        raise RuntimeError("int4_mma: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return int4_cuda._Kernel(source(fmt, bt, x_f16, out32, rt, p, u, n16, fold, minb, mt), "w4a16_mma", how, device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_config(N: int, K: int, fmt: str, config: dict | None = None, fold: bool = False) -> dict:
    """{"RT", "P", "U", "RT16", "U16", "MINB16"} and one of "SPLIT_K" / "TARGET_BLOCKS": the defaults,
    MEASURED[(N, K, fmt)], for the folded form FOLD_TILES[fmt] and MEASURED_FOLD[(N, K, fmt)] (tiles of 16+ only),
    then config (int4_cuda.layered_config)."""
    layers = ((MEASURED.get((N, K, fmt)), FOLD_TILES.get(fmt), MEASURED_FOLD.get((N, K, fmt)), config) if fold
              else (MEASURED.get((N, K, fmt)), config))
    out = int4_cuda.layered_config("int4_mma", (N, K, fmt), {"RT": RT, "P": P, "U": U, "RT16": RT16, "U16": U16,
                                                             "MINB": 1, "MINB16": MINB16, "MT": 1, "MT16": 1,
                                                             "BTMAX": BT_CHOICES[-1], "TARGET_BLOCKS": TARGET_BLOCKS},
                                     layers, CONFIG_KEYS)
    named = (MEASURED.get((N, K, fmt)), MEASURED_FOLD.get((N, K, fmt)) if fold else None, config)
    if not any("RT16" in (layer or {}) for layer in named):
        out["RT16"] = max(1, min(out["RT16"], 16 // out["P"]))       # a default within 16 warps
    if (not all(1 <= out[r] * out["P"] <= MAX_WARPS and 1 <= out[u] <= 16 for r, u in (("RT", "U"), ("RT16", "U16")))
            or min(out.values()) < 1 or out["MT"] not in MT_CHOICES or out["MT16"] not in MT_CHOICES
            or (not fold and (out["MT"], out["MT16"]) != (1, 1)) or out["BTMAX"] not in BT_CHOICES):
        raise ValueError(f"int4_mma: config {out} for {(N, K, fmt)}: need 1 <= RT * P <= {MAX_WARPS}, 1 <= U <= 16 (and "
                         f"RT16, U16 alike), MT and MT16 in {MT_CHOICES} (other than 1: folded form only), BTMAX in "
                         f"{BT_CHOICES}, positive values")
    return out


def smem_bytes(fmt: str, bt: int, rt: int, p: int, fold: bool = False, mt: int = 1) -> int:
    """Dynamic shared memory of one block (the kernel's SMEM_TOTAL): x staged (BT rows, and a row of zeros when
    BT is not a multiple of 8), its group sums (Q4_1 / Q4_K, not folded), the phases' sums."""
    xr = bt + 1 if bt % 8 else bt
    xs = xr * (GMAX * 16 + 16) * 4
    xsum = 0 if fmt in ("q4_0", "q8_0") or fold else (bt * 4 + xr) * GMAX * 4
    return xs + xsum + (p - 1) * rt * 32 * mt * 4 * _cdiv(bt, 8) * 4


@functools.lru_cache(maxsize=None)
def _split(G: int, n_nt: int, target: int | None, split_k: int | None) -> tuple[int, int]:
    if G == 0:
        return 1, 0
    lo = _cdiv(G, GMAX)                          # a split holds at most GMAX groups
    if split_k is not None:
        S = max(lo, min(split_k, G))
    else:
        S = lo
        while S < max(lo, MAX_SPLIT) and n_nt * S < target and _cdiv(G, S + 1) >= 4:
            S += 1
    gps = _cdiv(G, S)
    return _cdiv(G, gps), gps


def batch_tile(M: int, fmt: str, c: dict, fold: bool = False) -> int:
    """The smallest of BT_CHOICES holding M, the largest up to BTMAX above (more tiles over the grid), halved while
    a block would not fit in SMEM_LIMIT. Bit-neutral: an mma's columns are independent."""
    choices = [b for b in BT_CHOICES if b <= c.get("BTMAX", BT_CHOICES[-1])]
    bt = next((b for b in choices if M <= b), choices[-1])
    while bt > 8 and smem_bytes(fmt, bt, c["RT16"], c["P"], fold, c["MT16"] if fold else 1) > SMEM_LIMIT:
        bt //= 2
    return bt


def mma_config(M: int, N: int, K: int, fmt: str, config: dict | None = None, fold: bool = False) -> dict:
    """The launch for x [M, K]. The split and P (which fix the bits) come from (N, K, fmt) and config only; the
    row tiles per block and the ring depth are RT, U for tiles of up to 8 sequences and RT16, U16 above."""
    c = shape_config(N, K, fmt, config, fold)
    G = K // GROUP
    S, gps = _split(G, _cdiv(N, ROWS_PER_TILE * c["RT"] * (c["MT"] if fold else 1)), c.get("TARGET_BLOCKS"),
                    c.get("SPLIT_K"))
    if fold and G:                               # splits of whole quads (GMAX is a multiple of 4)
        gps = min(_cdiv(gps, 4) * 4, GMAX)
        S = _cdiv(G, gps)
    mt8 = c["MT"] if fold else 1
    if smem_bytes(fmt, 8, c["RT"], c["P"], fold, mt8) > SMEM_LIMIT:
        raise ValueError(f"int4_mma: RT={c['RT']} P={c['P']} needs {smem_bytes(fmt, 8, c['RT'], c['P'], fold, mt8)} B "
                         f"of shared memory (limit {SMEM_LIMIT})")
    bt = batch_tile(M, fmt, c, fold)
    rt, u, minb, mt = ((c["RT"], c["U"], c["MINB"] if fold else 1, mt8) if bt <= 8
                       else (c["RT16"], c["U16"], c["MINB16"], c["MT16"] if fold else 1))
    n_bt, n_nt = _cdiv(M, bt), _cdiv(N, ROWS_PER_TILE * rt * mt)
    return {"BT": bt, "RT": rt, "P": c["P"], "U": u, "MINB": minb, "MT": mt, "SPLIT_K": S, "groups_per_split": gps,
            "grid": n_bt * n_nt * S, "block": rt * c["P"] * 32, "n_bt": n_bt, "n_nt": n_nt,
            "smem": smem_bytes(fmt, bt, rt, c["P"], fold, mt), "workspace_floats": S * M * N if S > 1 else 0}


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None,
                      latency: bool = False) -> None:
    """Size the split-K workspace (shared with int4_cuda) for up to max_rows rows of these (N, K, fmt): the exact and
    the folded form's splits (a shape's folded split may be the larger, e.g. MEASURED_FOLD's 5120x12288); latency:
    the latency launch's splits (config on top, as in w4a16_mma)."""
    def plan(M, N, K, fmt):
        if latency:
            return mma_config(M, N, K, fmt, {**latency_config(N, K, fmt), **(config or {})}, fold=True)
        return max((mma_config(M, N, K, fmt, config, fold=f) for f in (False, True) if supports(fmt, f)),
                   key=lambda c: c["workspace_floats"])

    int4_cuda.reserve_splits(device, [s for s in shapes if supports(s[2], fold=True)], max_rows, plan)


def w4a16_mma(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
              config: dict | None = None, fold: bool = False, defer: bool = False, latency: bool = False):
    """y = x @ w^T for a packed Q4_0 / Q4_1 / Q4_K weight on tensor cores (module docstring). x [M, K] bf16 /
    fp16; out [M, N] of x's dtype or float32 (unit column stride), allocated when None. fold: the folded form,
    y = x @ unpack_folded(w, x.dtype)^T. latency: the folded form's latency launch (latency_config, its own split;
    config layered on top). defer: split-K partials returned unreduced (int4_cuda.run_packed)."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt, fold):
        raise ValueError(f"w4a16_mma: format {pw.fmt} not supported by the {'folded' if fold else 'exact'} form (only "
                         f"{FOLD_FORMATS if fold else FORMATS}); use the folded form or the Triton / CUDA-core kernel")
    if latency:
        if not fold:
            raise ValueError("w4a16_mma: the latency launch is the folded form's (fold=True)")
        config = {**latency_config(pw.N, pw.K, pw.fmt), **(config or {})}
    return int4_cuda.run_packed(
        "w4a16_mma", x, pw, out,
        plan=lambda M, N, K, fmt: mma_config(M, N, K, fmt, config, fold),
        kernel=lambda cfg, x_f16, out32, dev: _kernel(pw.fmt, cfg["BT"], x_f16, out32, cfg["RT"], cfg["P"], cfg["U"],
                                                      pw.N % 16 == 0, fold, cfg["MINB"], cfg["MT"], dev),
        # x is read in 16-byte pieces: unit column stride, rows 16-byte aligned
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16,
        words_per_pair=WORDS_PER_GROUP[pw.fmt], defer=defer)


__all__ = ["w4a16_mma", "available", "supports", "mma_config", "shape_config", "latency_config", "reserve_workspace",
           "MMA_SOURCE", "source", "MEASURED", "FORMATS",
           "FOLD_FORMATS"]
