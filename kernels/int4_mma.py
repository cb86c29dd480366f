"""W4A16 projection for small batches on tensor cores, y[M, N] = x[M, K] @ w[N, K]^T, in CUDA C++ compiled at
run time (through kernels/nvrtc.py, the NVRTC runtime), on the PackedWeight layout of kernels/quant_pack.py
(Q4_0 / Q4_1 / Q4_K; Q8_0 in the folded form only, see below).

Definition: kernels.int4_gemm.w4a16_linear_ref(x, pw, exact=True), i.e. x @ unpack_ref(w)^T with the file's
exact weights: every group's integer dot product is taken on the tensor cores and scaled in fp32.

Why: a CUDA-core kernel (the former "cuda" variant) spends ~3.5 instructions per weight per lane (nibble to fp32,
one FMA per sequence), so at B = 1 it is issue-bound long before HBM is, and its time grows with every sequence. Here a
warp's mma.sync m16n8k16 takes 16 rows x 16 weights x 8 sequences in one instruction; what is left on the
CUDA cores is turning nibbles into 16-bit integers (a shift, a mask-and-or and a packed fma per pair of
weights: 1.5 instructions per weight), the same for 1 and for 8 sequences, plus per group 2 mmas and 4 fp32
scalings per 8 sequences. Q4_K costs more per group than Q4_0: three 16-bit loads per row, and its 6-bit scale and
min made floats per group (instruction counts: kernels/PROBES.md, kernels/int4_mma.py).

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
  group's sum of x: the Definition's per-group formula, so it agrees with it to fp32 rounding.
  Block: RT row tiles x P phases = KW warps; phase p takes the split's groups p, p + P, ... in ascending
  order with a ring of U groups of loads in flight (a slot is refilled as soon as it is used); the phases'
  sums are added in phase order at the end; split-K partials go to a workspace and nvrtc's reduce kernel
  adds them in split order. x for the split's whole K range is staged before the loop, so the loop has no
  barrier; that bounds a split to GMAX groups.

The folded form (fold=True, the dispatch's "cuda_mma_fold"; definition: x @ unpack_folded(w, x.dtype)^T, see
kernels/quant_pack.py). Each group's scale and offset are rounded to x's dtype, one more packed fma per pair turns
the exact integers into the weights q * s + c, and the mmas accumulate into acc across the whole K range: no fp32
scaling per group and column block, and no group sums of x (Q4_1 / Q4_K), so nothing but x is staged.
It works on quads of 4 groups (apply_quad): each lane loads a whole 16-byte group record per row and that group's
scales, and an mma's k range spans the quad's 4 groups, so loads and scale work per group drop to a quarter, and
Q4_K needs far fewer instructions per group than in the exact form. Launch shapes of its own (FOLD_TILES); splits
of whole quads. Its bits differ from the exact form's (rounded weights), so it is a variant of its own. A warp may
own MT row tiles (MT, MT16; MEASURED_FOLD per shape): each x fragment it reads from shared memory then feeds MT
tiles' mmas, and each load round brings MT times the weight bytes, for fewer instructions per group and tile.

Q8_0 (FMT 3) has the folded form only. Its record is 32 bytes per group and row (two 16-byte loads); weights s and
s + 4 of 8p .. 8p + 7 are byte s of words 2p and 2p + 1, so one prmt makes the same pairs nib_pair makes of a 4-bit
word, and x is staged as for the nibbles. A byte's low 7 bits go under the exponent of 128 (fp16: 1024) and its sign
bit into the fma's addend (-128 or -256; -1024 or -1152): two lop3 and one packed fma give the exact q in -128..127,
the fold's fma then q * d rounded once (unpack_folded; d rounded to x's dtype first). Per pair one prmt more than a
nibble pair costs, for twice the bytes: fewer instructions per byte than Q4_0.

Where the time goes (kernels/PROBES.md has the probes behind each clause): at B = 1 a call is a streaming part plus
a fixed cost per call (x's staging, the split-K partials, the launch's ramp and tail). Q4_0 streams near the copy
ceiling; Q4_K more slowly, bound by the instructions it issues per weight (its scales among them) rather than by the
tensor pipe or by how many loads are in flight. Built, measured and not kept: weights through a shared-memory
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

from onepass.kernels.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from onepass.kernels import nvrtc, pdl

FORMATS = ("q4_0", "q4_1", "q4_k")           # the exact form
FOLD_FORMATS = FORMATS + ("q8_0",)           # the folded form: Q8_0's bytes become weights as the nibbles do
FMT_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q8_0": 3}
BTG = 32                       # sequences per batch tile: up to four blocks of the mma's n = 8
BT_CHOICES = (1, 2, 4, 8, 16, 32)
GMAX = 32                      # groups per split: x for BT = 32 (and its group sums) staged once in < 99 KB
ROWS_PER_TILE = 16             # the mma's m
NUM_SMS = nvrtc.NUM_SMS
# launch shape: RT row tiles and P phases per block (KW = RT * P warps), U loads in flight per warp, for tiles of up
# to 8 sequences; RT16, U16 for tiles of 16 and 32. The split is the smallest count that keeps a split within
# GMAX groups and reaches TARGET_BLOCKS blocks (RT row tiles, one batch tile), unless SPLIT_K names it. The split
# and P fix the bits; RT and U do not (a warp's sums are its own), so RT16 / U16 may differ from RT / U.
# The defaults: one warp per row tile of 4-warp blocks with 4 groups in flight for tiles of up to 8, 16-warp blocks
# for 16 and 32; deeper rings spill under the register cap (why: kernels/PROBES.md, kernels/int4_mma.py: RT, P, U).
RT, P, U = 4, 1, 4
RT16, U16 = 16, 4
MINB16 = 1          # tiles of 16+: blocks per SM the registers must allow (1: what the compiler takes)
TARGET_BLOCKS = 4 * NUM_SMS
MAX_SPLIT = 32
CONFIG_KEYS = ("RT", "P", "U", "MINB", "MT", "RT16", "U16", "MINB16", "MT16", "BTMAX", "SPLIT_K", "TARGET_BLOCKS")
MT_CHOICES = (1, 2, 4)  # the folded form's row tiles per warp (MT, MT16): tiles sharing each x fragment
# per shape, where another launch of the exact form was faster than the defaults (why: kernels/PROBES.md,
# kernels/int4_mma.py: MEASURED). The 27B's two Q4_0 entries pay at B = 8, where the dispatch gives 5120x6144 this
# kernel (kernels/int4_dispatch.py)
MEASURED: dict[tuple[int, int, str], dict] = {
    (17408, 5120, "q4_0"): {"RT": 8, "SPLIT_K": 5},
    (5120, 12288, "q4_0"): {"SPLIT_K": 12},
    (2048, 8192, "q4_0"): {"P": 2},
    (5120, 17408, "q4_k"): {"RT": 8, "SPLIT_K": 26},
    (34816, 5120, "q4_k"): {"RT": 8},
    (10240, 5120, "q4_k"): {"RT": 8, "SPLIT_K": 7},
    (16384, 5120, "q4_0"): {"RT": 8, "U": 4, "SPLIT_K": 8},
    (5120, 6144, "q4_0"): {"RT": 8, "U": 6, "SPLIT_K": 6},
}
# The folded form's launch shapes (its U and U16 count quads of 4 groups): 8-warp blocks with 2 quads in flight for
# tiles of up to 8 sequences, and 16-warp blocks (256 rows sharing the staged x) with one quad in flight and registers
# for 2 blocks per SM for 16 and 32 (why: kernels/PROBES.md, kernels/int4_mma.py: FOLD_TILES). Bit-neutral.
FOLD_TILES = {f: {"RT": 8, "U": 2, "RT16": 16, "U16": 1, "MINB16": 2} for f in FOLD_FORMATS}
# Per shape, where another launch shape was faster than FOLD_TILES (why: kernels/PROBES.md, kernels/int4_mma.py:
# MEASURED_FOLD): 32-warp blocks (512 rows sharing the staged x) for tiles of 16+; two row tiles per warp (MT, MT16:
# each x fragment read from shared memory feeds both tiles' mmas, fewer instructions per group); registers for 3 or 4
# blocks per SM (MINB) for tiles of up to 8, bit-neutral. MT and RT (tiles of up to 8) set the rows per block and so,
# where SPLIT_K is not named, the split count: a per-shape constant, the same at every M. Q8_0's ring slot holds twice
# the bytes (a 32-byte record per group and row), so one quad in flight is often enough.
MEASURED_FOLD: dict[tuple[int, int, str], dict] = {
    (34816, 5120, "q4_k"): {"MT": 2, "RT": 4, "U": 2, "MINB": 3, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    (5120, 17408, "q4_k"): {"MINB": 4, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    (5120, 6144, "q4_k"): {"MINB": 4, "RT16": 32, "MINB16": 1},
    (16384, 5120, "q4_k"): {"MT": 2, "RT": 4, "U": 1, "MINB": 4, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    #   RT 4: blocks of 128 rows, so 5 splits of 32 groups instead of 8 of 20
    (17408, 5120, "q4_0"): {"MT": 2, "RT": 8, "U": 1, "MT16": 2, "RT16": 16, "U16": 1, "MINB16": 1},
    (5120, 17408, "q4_0"): {"MT": 2, "RT": 8, "U": 1, "MINB": 1, "SPLIT_K": 20},
    #   20 splits of 28 groups instead of 17 of 32; 8-warp blocks with the registers left to the compiler
    (5120, 12288, "q4_0"): {"MT": 2, "RT": 8, "U": 2, "MINB": 3, "SPLIT_K": 20},
    #   a split of its own (its own bits), two row tiles per warp
    (4096, 4096, "q4_0"): {"RT": 16, "U": 1, "SPLIT_K": 16},
    #   16-warp blocks, one quad in flight
    (14336, 5120, "q4_k"): {"SPLIT_K": 6, "MINB": 4},
    (248320, 5120, "q4_k"): {"MT": 2, "U": 1, "MINB": 3},
    (576, 576, "q4_1"): {"RT16": 4},
    #   SmolLM2's output projection in 64-row blocks from 16 sequences (the same 5 splits)
    (5120, 12288, "q8_0"): {"RT16": 8, "MT16": 2},
    (4096, 4096, "q8_0"): {"U": 1, "RT16": 8, "MT16": 2},
    (2048, 8192, "q8_0"): {"U": 1, "RT16": 8, "MT16": 2},
    (3072, 2048, "q8_0"): {"RT": 4, "MINB": 3, "MT": 2, "RT16": 4, "MT16": 2, "MINB16": 1},   # the same split
    (16384, 2048, "q8_0"): {"U": 1, "MT16": 2, "MINB16": 1},
    (2048, 2048, "q8_0"): {"U": 3, "MT": 2, "RT16": 8, "U16": 2, "MINB16": 1, "MT16": 2},   # the same split
    # the folded form keeps the rule's split where MEASURED names one for the exact form only (the 27B's Q4_0
    # launches above): the same bits as before those entries
    (16384, 5120, "q4_0"): {"TARGET_BLOCKS": TARGET_BLOCKS},
    (5120, 6144, "q4_0"): {"TARGET_BLOCKS": TARGET_BLOCKS},
}
# The 27B's other Q4_0 shapes keep the default launch (why: kernels/PROBES.md, kernels/int4_mma.py: MEASURED_FOLD).
# The latency launch of the folded form (the dispatch's "cuda_mma_fold_lat"): for shapes of a few microseconds at 32 to
# 128 sequences, where the default launch's many splits (TARGET_BLOCKS blocks at one batch tile) leave a second launch
# adding S x M x N fp32 partials, and its 32-sequence tiles one warp a long chain of mmas. Here the fewest splits that
# keep a split within GMAX groups (one for K <= 1024), a ring of 4 quads in flight per warp from the start (U, U16:
# a split of K = 576 is 5 quads, of 576x1536's 3 splits 4), and batch tiles of at most BTMAX = 16 sequences (twice the
# warps, each weight dequantized once per tile: cheap where the weight is small and stays in L2). Its own split, so
# its own bits; batch-invariant like the default launch (the split comes from (N, K, fmt) alone). It is slower than
# the default launch at few sequences, so it is a variant of its own, not a replacement; at 128 sequences on the
# larger of these weights the wgmma kernels' tiles do better (why: kernels/PROBES.md, kernels/int4_mma.py: LATENCY).
LATENCY = {"RT": 4, "U": 4, "MINB": 1, "MT": 1, "RT16": 8, "U16": 4, "MINB16": 1, "MT16": 1, "BTMAX": 16}
# per shape, where another latency launch was faster (why: kernels/PROBES.md, kernels/int4_mma.py: MEASURED_LAT)
MEASURED_LAT: dict[tuple[int, int, str], dict] = {
    (960, 576, "q4_1"): {"RT16": 4},
    (576, 576, "q4_1"): {"RT16": 4},
    (576, 1536, "q4_1"): {"SPLIT_K": 3},
    (2048, 2048, "q4_0"): {"SPLIT_K": 4},
    (3072, 2048, "q4_0"): {"SPLIT_K": 4},
}


def latency_config(N: int, K: int, fmt: str) -> dict:
    """The latency launch's config for (N, K, fmt): LATENCY, the fewest splits, then MEASURED_LAT's entry."""
    return {**LATENCY, "SPLIT_K": max(1, _cdiv(K // GROUP, GMAX)), **MEASURED_LAT.get((N, K, fmt), {})}


SMEM_LIMIT = 99 * 1024    # dynamic shared memory per block: what sm_86 and up allow
MAX_WARPS = 32            # warps per block (1024 threads)

# the C++ (kernels/cuda/): the device code int4_wgmma and int4_wgmma_ws share (after pdl's helpers), the kernel
MMA_COMMON = pdl.CUDA_HELPERS + nvrtc.cuda_text("int4_mma_common.cuh")
MMA_KERNEL = nvrtc.cuda_text("int4_mma.cu")
MMA_SOURCE = MMA_COMMON + MMA_KERNEL


def available() -> bool:
    """Whether the kernel can run here: a CUDA device of compute capability >= 8.0 (mma.sync bf16) and an
    NVRTC binding (kernels/nvrtc.py)."""
    if not nvrtc.available():
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
    how = nvrtc._compiler()
    if how is None:
        raise RuntimeError("int4_mma: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return nvrtc._Kernel(source(fmt, bt, x_f16, out32, rt, p, u, n16, fold, minb, mt), "w4a16_mma", how, device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_config(N: int, K: int, fmt: str, config: dict | None = None, fold: bool = False) -> dict:
    """{"RT", "P", "U", "RT16", "U16", "MINB16"} and one of "SPLIT_K" / "TARGET_BLOCKS": the defaults,
    MEASURED[(N, K, fmt)], for the folded form FOLD_TILES[fmt] and MEASURED_FOLD[(N, K, fmt)] (tiles of 16+ only),
    then config (nvrtc.layered_config)."""
    layers = ((MEASURED.get((N, K, fmt)), FOLD_TILES.get(fmt), MEASURED_FOLD.get((N, K, fmt)), config) if fold
              else (MEASURED.get((N, K, fmt)), config))
    out = nvrtc.layered_config("int4_mma", (N, K, fmt), {"RT": RT, "P": P, "U": U, "RT16": RT16, "U16": U16,
                                                             "MINB": 1, "MINB16": MINB16, "MT": 1, "MT16": 1,
                                                             "BTMAX": BT_CHOICES[-1], "TARGET_BLOCKS": TARGET_BLOCKS},
                                     layers, CONFIG_KEYS)
    named = (MEASURED.get((N, K, fmt)), MEASURED_FOLD.get((N, K, fmt)) if fold else None, config)
    if not any("RT16" in (layer or {}) for layer in named):
        out["RT16"] = max(1, min(out["RT16"], 16 // out["P"]))       # a default within 16 warps
    if (not all(1 <= out[r] * out["P"] <= MAX_WARPS and 1 <= out[u] <= 16 for r, u in (("RT", "U"), ("RT16", "U16")))
            or min(out.values()) < 1 or out["MT"] not in MT_CHOICES or out["MT16"] not in MT_CHOICES
            or (not fold and (out["MT"], out["MT16"]) != (1, 1)) or out["BTMAX"] not in BT_CHOICES):
        raise ValueError(f"int4_mma: config {out} for {(N, K, fmt)}: need 1 <= RT * P <= {MAX_WARPS}, 1 <= U <= 16 "
                         f"(and RT16, U16 alike), MT and MT16 in {MT_CHOICES} (other than 1: folded form only), BTMAX "
                         f"in {BT_CHOICES}, positive values")
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
    """Size the split-K workspace (nvrtc's, shared) for up to max_rows rows of these (N, K, fmt): the exact and
    the folded form's splits (a shape's folded split may be the larger, e.g. MEASURED_FOLD's 5120x12288); latency:
    the latency launch's splits (config on top, as in w4a16_mma)."""
    def plan(M, N, K, fmt):
        if latency:
            return mma_config(M, N, K, fmt, {**latency_config(N, K, fmt), **(config or {})}, fold=True)
        return max((mma_config(M, N, K, fmt, config, fold=f) for f in (False, True) if supports(fmt, f)),
                   key=lambda c: c["workspace_floats"])

    nvrtc.reserve_splits(device, [s for s in shapes if supports(s[2], fold=True)], max_rows, plan)


def w4a16_mma(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
              config: dict | None = None, fold: bool = False, defer: bool = False, latency: bool = False):
    """y = x @ w^T for a packed Q4_0 / Q4_1 / Q4_K weight on tensor cores (module docstring). x [M, K] bf16 /
    fp16; out [M, N] of x's dtype or float32 (unit column stride), allocated when None. fold: the folded form,
    y = x @ unpack_folded(w, x.dtype)^T. latency: the folded form's latency launch (latency_config, its own split;
    config layered on top). defer: split-K partials returned unreduced (nvrtc.run_packed)."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt, fold):
        raise ValueError(f"w4a16_mma: format {pw.fmt} not supported by the {'folded' if fold else 'exact'} form (only "
                         f"{FOLD_FORMATS if fold else FORMATS}); use the folded form or the Triton kernel")
    if latency:
        if not fold:
            raise ValueError("w4a16_mma: the latency launch is the folded form's (fold=True)")
        config = {**latency_config(pw.N, pw.K, pw.fmt), **(config or {})}
    return nvrtc.run_packed(
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
