"""W4A16 projection for large batches on sm_90's warpgroup MMA, y[M, N] = x[M, K] @ w[N, K]^T, the folded weights
of kernels/quant_pack.py (Q4_0 / Q4_1 / Q4_K, and Q8_0 through int4_mma's 32-byte records) kept packed; CUDA C++
compiled at run time for sm_90a (torch's NVRTC binding; wgmma needs the "a" target, which CuPy's binding does not
name).

Definition: x @ unpack_folded(w, x.dtype)^T, fp32 accumulation, like kernels/int4_mma.py's folded form.

Why: from 64 sequences up a projection is bound by the tensor cores, not by HBM, and each weight must be
dequantized once per block of as many sequences as possible. The mma.sync kernel (int4_mma) serves a batch tile
of at most 32 and stages x for a whole split in shared memory, so B = 128 re-reads and re-dequantizes every
weight four times; Triton's W4A16 kernel (int4_gemm) dequantizes once per 128 sequences but sends the tile
through shared memory to reach the wgmma's register layout. Here the weights go from the load straight into
the wgmma's A registers.

The kernel
  Rows: a block is WGS warpgroups, each owning MT m64 tiles of weight rows (64 MT WGS rows per block); in each
  tile warp r of the warpgroup gives rows 16r .. 16r + 15 as mma.m16n8k16's A fragment, which is also its part
  of wgmma's m64 A operand. The fragments are int4_mma's folded ones (quad_word): lane (g, t) loads the whole
  16-byte record of group 4j + t of quad j for rows g and g + 8, and word p of it becomes the A operand of two
  k16 steps (nibble pairs (0,4) (1,5), then (2,6) (3,7)): per pair one packed fma makes the exact integers and
  one more applies the group's scale and offset.
  Sequences: a batch tile of BT (8 .. 128) is the wgmma's N extent: x is the B operand, read by the wgmma
  from shared memory through a descriptor. It streams through a ring of STAGES quads (BT rows x 128 weights of
  K each, two K-major atoms of 64 k with the 128-byte swizzle): cp.async copies each 16-byte piece (row b,
  word p of the quad's group q) to where its k16 step reads it, and the thread that copied it then puts the
  values in the A fragments' k order in
  place (pair_order and a 4 x 4 transpose of its four pieces) -- no other thread touches them.
  Per quad: wait for its copies, reorder, fence.proxy.async, one barrier, refill the ring two quads on (the
  stage the quad before last used: every warpgroup's wgmma_wait<1> has retired those reads by this barrier),
  then per word p one commit group of 2 MT wgmmas (m64 n BT k16, A from registers), waiting for the previous
  word's group only, so the next word's dequantization overlaps the tensor cores.
  Splits: the K range is cut into SPLIT_K splits of whole quads; partials go to nvrtc's split-K workspace and
  its reduce (or to the consumer, defer=True), in split order.
  Stream-K: with more row tiles than one wave of blocks (34816x5120: 136 tiles of 256 rows on 132 SMs; the LM
  heads), whole tiles in a second wave would leave most SMs idle. Instead TARGET_BLOCKS blocks take equal ranges
  of the tiles' quads, tile-major; a range is at least a tile long, so a tile is shared by at most two blocks,
  which meet through a per-tile ticket: the first leaves its fp32 partial in the workspace, the second adds it
  (one commutative addition) and stores the tile.

Batch invariance: every output element is the chain of its split's k16 steps in quad, word order, then the
splits added in order 0..S-1 (stream-K: the two chains of a shared tile added); the split, the stream-K ranges,
WGS and MT come from (N, K, fmt) alone. M moves only BT (the wgmma's
N extent, whose columns are independent) and the grid, so row m of y is bitwise the same whatever M is (the GPU
tests compare rows across BT; the same assumption as int4_gemm's wgmma tiles).

Where the time goes (kernels/PROBES.md has the measurements): it was the fastest int4 kernel on most shapes at 64 and
128 sequences, yet still well behind bf16 cuBLAS; the split decides much of it (a block runs a whole split, so the
splits fill one wave; stream-K where the row tiles exceed one wave). ncu finds its warps waiting on their own weight
loads and on the per-quad barrier, with the tensor pipe mostly idle: kernels/int4_wgmma_ws.py, which feeds both
operands through shared memory from a producer warpgroup, took its place from 64 sequences up.
"""
from __future__ import annotations

import functools

import torch

from onepass.kernels.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from onepass.kernels import int4_mma, nvrtc

FORMATS = int4_mma.FOLD_FORMATS   # its loads and fragments are int4_mma's folded form's, Q8_0 included
BT_CHOICES = (8, 16, 32, 64, 128)   # the wgmma's N extent; more sequences run over the grid
NUM_SMS = nvrtc.NUM_SMS
SMEM_LIMIT = 227 * 1024             # dynamic shared memory per block on sm_90 (opt-in)
MAX_SPLIT = 32
MIN_QUADS_PER_SPLIT = 4             # >= 512 weights of K per split
CONFIG_KEYS = ("WGS", "MT", "U", "STAGES", "MINB", "SWZ", "SK", "SK_HALVE", "SPLIT_K", "TARGET_BLOCKS")
# WGS warpgroups x MT m64 tiles per block; U quads of weight loads in flight per warp; STAGES quads of x in the
# ring (>= 3: a stage is refilled two quads after its wgmmas were issued); MINB blocks per SM the registers must
# allow (0: auto_minb); SWZ: x staged with the 128-byte swizzle. TARGET_BLOCKS: the split reaches this many blocks
# (one batch tile). SK: with more row tiles than TARGET_BLOCKS (and no SPLIT_K named), stream-K: TARGET_BLOCKS
# blocks share the tiles' K steps evenly instead of a second, mostly idle wave of whole tiles. SK_HALVE: where
# tiles of two m64 fill more than half of TARGET_BLOCKS but not all, tiles of one m64 (twice as many) for stream-K.
# The split, the stream-K ranges and so the bits follow from (N, K, fmt, config); MINB, U, STAGES and SWZ do not
# change a bit, so MINB may follow the batch tile. Default: two warpgroups of two m64 tiles (256 rows, one block per
# SM; why: kernels/PROBES.md, kernels/int4_wgmma.py: DEFAULTS).
DEFAULTS = {"WGS": 2, "MT": 2, "U": 1, "STAGES": 4, "MINB": 0, "SWZ": 1, "SK": 1, "SK_HALVE": 0,
            "TARGET_BLOCKS": NUM_SMS}
# per format, over DEFAULTS: Q8_0's ring slot holds twice the bytes of a 4-bit one, so one m64 tile per warpgroup
# keeps the 128-sequence tile's registers (two tiles' accumulators are 128 of its 255)
FORMAT_DEFAULTS = {"q8_0": {"MT": 1}}
MEASURED: dict[tuple[int, int, str], dict] = {}
# No entries: smaller tiles do not rescue the small weights at 32-128 sequences, where the folded latency launch and
# dequantize + cuBLAS stay faster: x's 128 rows pass the ring behind block barriers (why: kernels/PROBES.md,
# kernels/int4_wgmma.py: MEASURED).
# the dispatch's "cuda_wgmma_x2": two blocks per SM below 128 sequences, splits and stream-K sized for them (why:
# kernels/PROBES.md, kernels/int4_wgmma.py: X2). Different splits: its bits differ from the default's, so an engine
# takes one or the other for every M.
X2 = {"TARGET_BLOCKS": 2 * NUM_SMS, "SK_HALVE": 1}

# the C++ (kernels/cuda/): the part int4_wgmma_ws shares (its /*WGMMA_RS*/ line: common_text), the kernel
WG_COMMON = nvrtc.cuda_text("int4_wgmma_common.cuh")
WG_KERNEL = nvrtc.cuda_text("int4_wgmma.cu")

SOURCE_DEFINES = 15


def _wgmma_rs_text(nb: int) -> str:
    """wgmma_rs(d, a, desc, add): d[4 nb] = (add ? d : 0) + A (64 x 16; this warp's 16 rows in a, mma.m16n8k16's A
    layout) times the 16 x 8nb slice of x that desc names: one warpgroup-wide wgmma.mma_async m64n(8nb)k16, A from
    registers, scale-d = add, B K-major."""
    n = 4 * nb
    d = ", ".join(f"%{i}" for i in range(n))
    a = ", ".join(f"%{n + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, %{n + 5}, 0; wgmma.mma_async.sync.aligned.m64n{8 * nb}k16.f32.\" WG_T "
           f"\".\" WG_T \" {{{d}}}, {{{a}}}, %{n + 4}, p, 1, 1, 0; }}")
    return (f"__device__ __forceinline__ void wgmma_rs(float (&d)[{n}], const u32 (&a)[4], unsigned long long desc, "
            f"int add) {{\n"
            f'    asm volatile("{asm}"\n'
            f"                 : {outs}\n"
            f'                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(add));\n}}\n')


def source(fmt: str, bt: int, x_f16: bool, out32: bool, wgs: int, mt: int, u: int, stages: int, minb: int = 1,
           swz: int = 1, sk: bool = False) -> str:
    """The full source of one instantiation: SOURCE_DEFINES #define lines, then int4_mma's common device code
    (the folded form's loads and fragments), WG_COMMON and WG_KERNEL."""
    head = (f"#define FMT {int4_mma.FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n"
            f"#define OUT32 {int(out32)}\n#define RT {4 * wgs}\n#define P 1\n#define U {u}\n#define GMAX 32\n"
            f"#define N16 1\n#define FOLD 1\n#define MINB {minb}\n#define MT {mt}\n#define STAGES {stages}\n"
            f"#define SWZ {swz}\n#define SK {int(sk)}\n")
    assert head.count("\n") == SOURCE_DEFINES
    return head + int4_mma.MMA_COMMON + common_text(bt) + WG_KERNEL


def common_text(bt: int) -> str:
    """WG_COMMON with its wgmma for a batch tile of bt (kernels/int4_wgmma_ws.py builds on it too)."""
    return WG_COMMON.replace("/*WGMMA_RS*/", _wgmma_rs_text(_cdiv(bt, 8)))


def available() -> bool:
    """Whether the kernel can run here: an sm_90 device (wgmma needs the sm_90a target) and torch's NVRTC
    binding (it names the target exactly)."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and hasattr(torch.cuda, "_compile_kernel"))


def supports(fmt: str) -> bool:
    return fmt in FORMATS


@functools.lru_cache(maxsize=None)
def _kernel(fmt: str, bt: int, x_f16: bool, out32: bool, wgs: int, mt: int, u: int, stages: int, minb: int,
            swz: int, sk: bool, device: torch.device):
    if not available():
        raise RuntimeError("int4_wgmma: needs an sm_90 GPU and torch.cuda._compile_kernel")
    return nvrtc._Kernel(source(fmt, bt, x_f16, out32, wgs, mt, u, stages, minb, swz, sk), "w4a16_wgmma", "torch",
                             device, arch="90a")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def shape_config(N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """DEFAULTS, then MEASURED[(N, K, fmt)], then config (nvrtc.layered_config), checked."""
    out = nvrtc.layered_config("int4_wgmma", (N, K, fmt), DEFAULTS,
                                   (FORMAT_DEFAULTS.get(fmt), MEASURED.get((N, K, fmt)), config), CONFIG_KEYS)
    if out["WGS"] not in (1, 2) or out["MT"] not in (1, 2) or not 1 <= out["U"] <= 4 or not 3 <= out["STAGES"] <= 6 \
            or not 0 <= out["MINB"] <= 4 or out["SWZ"] not in (0, 1) or out["SK"] not in (0, 1) \
            or out["SK_HALVE"] not in (0, 1) \
            or out.get("TARGET_BLOCKS", 1) < 1:
        raise ValueError(f"int4_wgmma: config {out} for {(N, K, fmt)}: need WGS and MT in (1, 2), 1 <= U <= 4, "
                         f"3 <= STAGES <= 6, 0 <= MINB <= 4, SWZ, SK and SK_HALVE in (0, 1), TARGET_BLOCKS >= 1")
    return out


def smem_bytes(bt: int, stages: int) -> int:
    """The block's dynamic shared memory (the kernel's SMEM_TOTAL): STAGES quads of x for 8 * ceil(BT / 8) rows."""
    return stages * 8 * 256 * _cdiv(bt, 8)


def split(G: int, n_nt: int, c: dict) -> tuple[int, int]:
    """(S, groups per split): SPLIT_K splits if named, else the most (each >= MIN_QUADS_PER_SPLIT quads) whose
    n_nt * S blocks still fit in TARGET_BLOCKS, one wave of the blocks the SMs hold at once: a block runs a
    whole split, so a second wave of a few blocks costs as much as the first (the fewest splits reaching
    TARGET_BLOCKS lost: kernels/PROBES.md, kernels/int4_wgmma.py). Splits of whole quads."""
    Q = _cdiv(G, 4)
    if c.get("SPLIT_K"):
        S = max(1, min(int(c["SPLIT_K"]), Q))
    else:
        S = 1
        while (S < MAX_SPLIT and n_nt * (S + 1) <= c["TARGET_BLOCKS"]
               and _cdiv(Q, S + 1) >= MIN_QUADS_PER_SPLIT):
            S += 1
    gps = _cdiv(Q, S) * 4
    return _cdiv(G, gps), gps


def auto_minb(bt: int, target_blocks: int) -> int:
    """MINB 0: blocks per SM the registers must allow, by batch tile (bit-neutral). Two at tiles of up to 32,
    whose accumulators leave room; at 64 only when the launch has two blocks per SM to hide the cap (one block
    capped at 128 registers is slower); one at 128, where capped, its 128 accumulators spill (why: kernels/PROBES.md,
    kernels/int4_wgmma.py: auto_minb)."""
    if bt <= 32:
        return 2
    return 2 if bt == 64 and target_blocks >= 2 * NUM_SMS else 1


def wg_config(M: int, N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """The launch for x [M, K]: the split (or stream-K) from (N, K, fmt) and config only; BT the smallest of
    BT_CHOICES holding M (128, over the grid, above). Stream-K ("workers" > 0): that many blocks per batch tile
    share the row tiles' K steps, a partial tile's fp32 sum through the workspace (a slice of rows x BT floats per
    tile) and two flags per tile ("flag_ints")."""
    c = shape_config(N, K, fmt, config)
    target = c.get("TARGET_BLOCKS", NUM_SMS)
    n_nt = _cdiv(N, 64 * c["MT"] * c["WGS"])
    stream_k = c["SK"] and not c.get("SPLIT_K")
    if stream_k and c["SK_HALVE"] and c["MT"] == 2 and target // 2 < n_nt <= target:
        c["MT"] = 1
        n_nt = _cdiv(N, 64 * c["WGS"])
    G = K // GROUP
    workers = target if stream_k and n_nt > target else 0
    S, gps = (1, _cdiv(G, 4) * 4) if workers else split(G, n_nt, c)
    bt = next((b for b in BT_CHOICES if M <= b), BT_CHOICES[-1])
    smem = smem_bytes(bt, c["STAGES"])
    if smem > SMEM_LIMIT:
        raise ValueError(f"int4_wgmma: BT={bt} STAGES={c['STAGES']} needs {smem} B of shared memory "
                         f"(limit {SMEM_LIMIT})")
    n_bt = _cdiv(M, bt)
    minb = c["MINB"] or auto_minb(bt, target)
    return {"BT": bt, "WGS": c["WGS"], "MT": c["MT"], "U": c["U"], "STAGES": c["STAGES"], "MINB": minb, "SWZ": c["SWZ"],
            "SPLIT_K": S, "groups_per_split": gps, "workers": workers,
            "grid": n_bt * (workers or n_nt * S), "block": 128 * c["WGS"], "n_bt": n_bt, "n_nt": n_nt,
            "smem": smem,
            "workspace_floats": n_bt * n_nt * 64 * c["MT"] * c["WGS"] * bt if workers else (S * M * N if S > 1 else 0),
            "flag_ints": 2 * n_bt * n_nt if workers else 0}


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None) -> None:
    """Size the split-K workspace (nvrtc's, shared) for up to max_rows rows of these (N, K, fmt)."""
    nvrtc.reserve_splits(device, [s for s in shapes if supports(s[2])], max_rows,
                             lambda M, N, K, fmt: wg_config(M, N, K, fmt, config))


def w4a16_wgmma(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
                config: dict | None = None, defer: bool = False):
    """y = x @ unpack_folded(w, x.dtype)^T for a packed Q4_0 / Q4_1 / Q4_K / Q8_0 weight (module docstring).
    x [M, K] bf16 / fp16; out [M, N] of x's dtype or float32 (unit column stride), allocated when None. defer:
    split-K partials returned as a kernels.splitk.SplitSums."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt):
        raise ValueError(f"w4a16_wgmma: format {pw.fmt} not supported (only {FORMATS}); use the Triton kernel")
    return nvrtc.run_packed(
        "w4a16_wgmma", x, pw, out,
        plan=lambda M, N, K, fmt: wg_config(M, N, K, fmt, config),
        kernel=lambda cfg, x_f16, out32, dev: _kernel(pw.fmt, cfg["BT"], x_f16, out32, cfg["WGS"], cfg["MT"], cfg["U"],
                                                      cfg["STAGES"], cfg["MINB"], cfg["SWZ"], cfg["workers"] > 0, dev),
        # x is read in 16-byte pieces: unit column stride, rows 16-byte aligned
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16,
        words_per_pair=WORDS_PER_GROUP[pw.fmt], defer=defer)


__all__ = ["w4a16_wgmma", "available", "supports", "wg_config", "shape_config", "reserve_workspace", "source",
           "MEASURED", "FORMATS", "WG_COMMON", "WG_KERNEL", "common_text"]
