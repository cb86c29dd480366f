"""W4A16 projection on sm_90's wgmma with a producer warpgroup: y[M, N] = x[M, K] @ w[N, K]^T for the folded Q4_0 /
Q4_1 / Q4_K / Q8_0 weights of kernels/quant_pack.py, the same arithmetic as kernels/int4_wgmma.py (same split, same k16
chain per element: with the same split its output is bitwise cuda_wgmma's) with the operands fed differently.

Why: int4_wgmma's warps load their own weights from global memory into registers and stage x through a ring with a
block barrier per quad; ncu finds them waiting on those loads (long scoreboard stalls) with the tensor pipe mostly
idle. Here warpgroup 0 only moves data: its one thread issues bulk copies (cp.async.bulk,
completed on an mbarrier) of each quad's weights, scales and x into a ring of STAGES stages in shared memory,
several quads ahead; the consumer warpgroups wait on the stage's barrier, read their fragments with 16-byte
shared loads, dequantize and issue the wgmmas, and give the stage back through a second barrier once their
wgmmas have read it. No block-wide barrier in the K loop. A 256-row tile goes to four consumer warpgroups of one
m64 tile (CWG 4, the default; setmaxnreg: producer 24, consumers 112 registers) or two of two (CWG 2: 40 / 232,
and the only form for tiles of 128 rows); four give the schedulers twice the warps to issue from. In batch tiles of
up to MMA_MAX_BT sequences the consumers issue mma.sync instead of wgmma (CMMA: the same A fragments, x's B fragments
read by ldmatrix from the same stage, each warp on its own; the same bits), two warpgroups by default.

A bulk copy moves bytes as they lie, so x goes through the ring already in the order and swizzle the wgmma reads
(int4_wgmma's stage: pair_order, the 4 x 4 transpose of a unit's pieces, the 128-byte swizzle): a staging kernel
(wg_stage_x, one launch before the GEMM, M x K x 2 bytes read and written) writes that image per (batch tile, quad) into
a workspace. The staging launch triggers its dependent at entry (PDL, kernels/pdl.py): the GEMM launches while x is
staged and its producer issues the first stages' weight copies before it waits. In the fused decode steps the kernel
that makes x (the residual add + RMSNorm, SwiGLU, the gated norm, the sigmoid gate) writes that image itself where
image_for gives one (kernels/x_image.py), and the GEMM (x_image=) runs without the staging launch. The weights' records
of one group for the tile's 256 rows are 4 KB contiguous in the packed layout ([G, N] records): one copy per group,
padded by 32 bytes in shared memory so the 8 lanes of a quarter-warp (rows g, g + 1 of the 4 groups of a quad) hit
distinct banks; the scales likewise, 512 bytes a row.

Stage (BT = 128, Q4_K): x 32 KB + weights 16.1 KB + the ready scale words 4.1 KB (ready scales; the raw scales took
3.1), rounded to 1 KB; four stages fill 212 KB. Q8_0's records are 32 bytes (a group's 8 KB for 256 rows), so three of
its 67 KB stages fit.
Needs N % 8 == 0 and 16-byte aligned scale arrays (bulk copies move multiples of 16 bytes from 16-byte aligned
addresses); elsewhere w4a16_wgmma_ws runs int4_wgmma's kernel, which computes the same bits.

Accumulators: a split-K build that zeroes its accumulators inside the consumers' K loop makes ptxas serialize every
wgmma of the kernel (its warning C7515: each wgmma waits for the one before). In batch tiles of FRESH_MIN_BT (128:
more than 64 sequences) a segment's first quad writes the accumulators instead (wgmma scale-d 0; no C7515), which pays
there and not in smaller tiles; tests/test_int4_wgmma_ws.py checks the offline sm_90a build wherever nvcc is found.

X_IN_GEMM, in batch tiles of up to X_IN_GEMM_MAX_BT = 8 sequences: no staging launch; the producer warpgroup's warps
1-3 load x, put it in the ring's order and store it into each stage, each arriving on the stage's barrier after a
proxy fence, while thread 0 copies only weights and never waits for the kernel before. It gives int4_wgmma's bits
(the emulator and the GPU tests).

Where the time goes (kernels/PROBES.md has the measurements): the consumers bound the kernel, not the copies. At
16-32 sequences a call on the 27B's projections is a fixed part (about twice as long with stream-K; a reduce launch
adds to it where the partials are not left to the next kernel, and so does x's staging launch) plus streaming at
well below the copy ceiling, and the time follows the consumers' instruction count (most of it dequantizing) at a
steady issue rate; at 128 sequences the warpgroup-aligned waits join in. Built, measured and not kept: one commit
group per two or four words (or per k16 step, which keeps the wgmmas pipelined at 128 sequences:
STEP_GROUPS_MIN_BT), tensor-map copies, fewer ring stages, consumers reading the next quad ahead, wgmma groups left in
flight, two consumer warpgroups at 64-128 sequences, batch tiles of 64 at 128, x staged in the GEMM above 8 sequences,
Q4_K's scales made by the producer warpgroup's idle warps (slower steps, however they waited); made once per weight
instead (ready scales), they pay. Nor are the copies the bound at 32-128 sequences: without x's (or the weights')
copies a call is hardly faster.
"""
from __future__ import annotations

import functools
import weakref

import torch

from onepass.kernels.quant_pack import GROUP, WORDS_PER_GROUP, PackedWeight
from onepass.kernels import int4_mma, int4_wgmma, nvrtc, pdl
from onepass.kernels.workspace import SplitKWorkspace

FORMATS = int4_mma.FOLD_FORMATS   # the folded form's: a Q8_0 stage holds 32-byte records
SMEM_LIMIT = int4_wgmma.SMEM_LIMIT
MAX_STAGES = 8
# setmaxnreg: a block's warps trade registers among themselves, so the producer's 128 x (168 - 40) given back
# must cover the consumers' 256 x (232 - 168) (168: the kernel's count at one 384-thread block per SM). One block per
# SM only: two blocks per SM hung or spilled, and lost in the steps (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py:
# REGS).
# With four consumer warpgroups (CWG 4, 640 threads; the launch bound allows 96 registers each): 128 x (96 - 24)
# given back cover 512 x (112 - 96).
REGS = {2: (40, 232), 4: (24, 112)}         # consumer warpgroups -> (producer, consumer) registers
# with X_IN_GEMM the stagers hold a unit's four pieces and walk the segments: with four consumer warpgroups 56 for
# the producer and 104 for the consumers (128 x (96 - 56) given back cover 512 x (104 - 96)); fewer for the producer
# spill (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: REGS_X_IN_GEMM)
REGS_X_IN_GEMM = {2: (40, 232), 4: (56, 104)}
# the tiles: two m64 per warpgroup; halved to one where that turns a wave of a few tiles into stream-K over all the
# SMs (17408x5120: 68 tiles of 256 rows on 132 SMs; why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: DEFAULTS)
DEFAULTS = {"SK_HALVE": 1}
# four consumer warpgroups of one m64 tile on the 256-row tiles (same bits as two of two): twice the warps to issue
# from, faster at every batch probed (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: DEFAULT_CWG)
DEFAULT_CWG = 4
# the dispatch's "cuda_wgmma_ws_t128": tiles of 128 rows, one m64 for each of two consumer warpgroups. Twice the row
# tiles, so half the split: fewer fp32 partials written and added where many sequences make them large (a split of S
# leaves S x M x N floats). Its own split, so its own bits. It pays on some shapes from 64 sequences and loses below
# (two consumer warpgroups hide less latency than four) (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: T128).
T128 = {"MT": 1, "CWG": 2}
# per shape, on top of T128 (int4_dispatch.ws_variant_config): splits of their own on the small shapes where no int4
# kernel matched dequantize + cuBLAS at 128 sequences (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: MEASURED_T128)
MEASURED_T128: dict[tuple[int, int, str], dict] = {(2048, 2048, "q4_0"): {"SPLIT_K": 6},
                                                   (2048, 2048, "q8_0"): {"SPLIT_K": 6}}
SOURCE_DEFINES = int4_wgmma.SOURCE_DEFINES
STAGE_TRIGGER = True   # the staging launch triggers its GEMM at entry (module switch: probes compare it off)
# x staged inside the GEMM by the producer warpgroup's warps 1-3 (loaded from x, put in the ring's order and stored
# into each stage, completed on the stage's barrier by their arrivals) instead of by the wg_stage_x launch
# (module switch for every batch tile; off). Three warps restaging x for every stage cost more than one launch once a
# tile holds more than a few sequences, so only batch tiles of up to X_IN_GEMM_MAX_BT sequences read x in the GEMM
# (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: X_IN_GEMM_MAX_BT).
X_IN_GEMM = False
X_IN_GEMM_MAX_BT = 8
# batch tiles from which a segment's first quad writes the accumulators (wgmma scale-d 0) instead of the consumers
# zeroing them inside the K loop, which makes ptxas serialize every wgmma (module docstring; why: kernels/PROBES.md,
# kernels/int4_wgmma_ws.py: FRESH_MIN_BT)
FRESH_MIN_BT = 128
# the consumers on mma.sync (CMMA; config "MMA") in batch tiles of up to MMA_MAX_BT sequences, two consumer warpgroups
# of two m64 tiles (MMA_CWG: each x fragment then feeds two tiles' mmas); wgmma above. The same bits either way (the
# same products and k16 order per element). From 16 sequences mma.sync loses, more the more sequences: the tensor work
# per sequence is what grows, and wgmma does it at a higher rate. The ring's depth is not what limits these tiles
# (why: kernels/PROBES.md, kernels/int4_wgmma_ws.py: MMA_MAX_BT).
MMA_MAX_BT = 8
MMA_CWG = 2
# batch tiles from which the consumers commit their wgmmas one k16 step at a time (int4_wgmma's WG_STEP_GROUPS, the
# same wgmmas in the same order: the same bits) instead of a word's two steps together. At 128 sequences four
# consumer warpgroups of 112 registers then keep their wgmmas pipelined, where with a word's two steps ptxas
# serialized them (its C7512; tests/test_int4_wgmma_ws.py checks the offline build). Yet the pipelining buys little:
# the other warpgroups' wgmmas had been filling the tensor pipe, and the graphed step is slower with it (why:
# kernels/PROBES.md, kernels/int4_wgmma_ws.py: STEP_GROUPS_MIN_BT). So off (a module switch for probes: a batch
# tile's size from which it applies).
STEP_GROUPS_MIN_BT = 1 << 30
# The producer's weight and scale copies enter L2 as evict-first in a launch of one batch tile (each weight byte read
# once; several batch tiles re-read them), so the stream does not push out x's staged image, which every row tile's
# block reads, nor the partials around the call. The same bits. The same hint on the mma kernels' register loads
# (ld.global.nc ... L2::cache_hint) made them slower: not used there (why: kernels/PROBES.md,
# kernels/int4_wgmma_ws.py: WEIGHT_EVICT_FIRST). Module switch (probes compare it off).
WEIGHT_EVICT_FIRST = True
# Q4_K in batch tiles that stage x outside the GEMM (above X_IN_GEMM_MAX_BT): the ring carries each (group, row)'s
# scale and offset ready-made (ready_words: d * sc and -(dmin * mn), rounded to x's dtype, one word), made once per
# weight and dtype, instead of the raw d, dmin and 6-bit (sc, mn) bytes, which every consumer lane turned into the
# same two values. The same values, so the same bits; 4 bytes a (group, row) copied instead of 3, and 4 more held per
# (group, row) beside the raw scales, which every other kernel reads.
# Module switch (probes compare it off).
_READY = weakref.WeakKeyDictionary()           # PackedWeight -> {x's dtype: its ready words}
_XSTAGED = SplitKWorkspace(dtype=torch.uint8)   # x in the ring's image, per device (graphs keep the old one)

# the C++ (kernels/cuda/): helpers put before int4_wgmma's common part; the kernels wg_stage_x, w4a16_wgmma_ws
WS_PRELUDE = nvrtc.cuda_text("int4_wgmma_ws_prelude.cuh")
WS_KERNEL = nvrtc.cuda_text("int4_wgmma_ws.cu")


def source(fmt: str, bt: int, x_f16: bool, out32: bool, stages: int, swz: int = 1, sk: bool = False,
           mt: int = 2, cwg: int = 2, x_in_gemm: bool | None = None, mma: bool = False, fresh: bool | None = None,
           step_groups: bool | None = None, ready: bool | None = None) -> str:
    """One instantiation: int4_wgmma's SOURCE_DEFINES lines (cwg consumer warpgroups of MT m64 tiles), then
    int4_mma's common code, the block's shape, WS_PRELUDE, int4_wgmma's common part and WS_KERNEL. mma: the
    consumers on mma.sync (CMMA) instead of wgmma. fresh / step_groups (FRESH_WRITE, WG_STEP_GROUPS): by default
    from FRESH_MIN_BT and STEP_GROUPS_MIN_BT; ready (the sub argument then points at ready_words):
    by default ready_scales(fmt, x_in_gemm)."""
    fresh = bt >= FRESH_MIN_BT if fresh is None else fresh
    step_groups = bt >= STEP_GROUPS_MIN_BT if step_groups is None else step_groups
    head = int4_wgmma.source(fmt, bt, x_f16, out32, cwg, mt, 1, stages, 1, swz, sk).split("\n", SOURCE_DEFINES)
    x_in_gemm = X_IN_GEMM if x_in_gemm is None else x_in_gemm
    ready = ready_scales(fmt, x_in_gemm) if ready is None else ready
    if ready and fmt != "q4_k":
        raise ValueError(f"int4_wgmma_ws: ready scale words are for Q4_K, not {fmt}")
    # before int4_mma's common code, whose quad_scales then spreads the ready words
    defines = "\n".join(head[:SOURCE_DEFINES]) + f"\n#define READY_SCALES {int(bool(ready))}\n"
    producer, consumer = REGS_X_IN_GEMM[cwg] if x_in_gemm else REGS[cwg]
    regs = (f"#define CWG {cwg}                                   /* consumer warpgroups; warpgroup 0 produces */\n"
            f"#define PRODUCER_REGS {producer}\n#define CONSUMER_REGS {consumer}\n#define X_IN_GEMM {int(x_in_gemm)}\n"
            f"#define STAGE_TRIGGER {int(STAGE_TRIGGER)}\n#define FRESH_WRITE {int(fresh and not mma)}\n"
            f"#define CMMA {int(mma)}\n#define WG_STEP_GROUPS {int(step_groups and not mma)}\n")
    return defines + int4_mma.MMA_COMMON + regs + WS_PRELUDE + int4_wgmma.common_text(bt) + WS_KERNEL


available = int4_wgmma.available


def supports(fmt: str) -> bool:
    return fmt in FORMATS


def aligned(pw: PackedWeight) -> bool:
    """Whether the bulk copies can read this weight: rows a multiple of 8 (2-byte scale rows of 16-byte multiples)
    and every array 16-byte aligned."""
    arrays = [a for a in (pw.qweight, pw.scales, pw.mins, pw.sub) if a is not None]
    return pw.N % 8 == 0 and all(a.data_ptr() % 16 == 0 for a in arrays)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stage_bytes(bt: int, fmt: str, mt: int = 2, ready: bool = False) -> int:
    """One ring stage (WS_STAGE): x for the batch tile, 4 groups of the tile's 128 MT rows' records, the scale rows
    (ready: 4 rows of ready words instead)."""
    nb, rows = _cdiv(bt, 8), 128 * mt
    nsr = {"q4_0": 4, "q4_1": 8, "q4_k": 6, "q8_0": 4}[fmt]
    rb = 4 * WORDS_PER_GROUP[fmt]                 # a record's bytes
    scales = 4 * (rows * 4 + 32) if ready else nsr * (rows * 2 + 16)
    raw = 8 * 256 * nb + 4 * (rows * rb + 32) + scales
    return _cdiv(raw, 1024) * 1024


def ready_scales(fmt: str, x_in_gemm: bool) -> bool:
    """Whether a build reads ready-made Q4_K scale words: the launch policy's ready_scales (kernels/pdl.py), and not in
    the batch tiles that stage x in the GEMM, where a call streams its weight once and the extra byte a (group, row)
    would cost more than it saves."""
    return pdl.current().ready_scales and fmt == "q4_k" and not x_in_gemm


def free_ready() -> None:
    """Drop every ready scale word made so far (they are made again at a weight's next call that reads them)."""
    _READY.clear()


def ready_bytes(device: torch.device | str | None = None) -> int:
    """Bytes the ready scale words made so far hold (on device, or on every device)."""
    dev = None if device is None else torch.device(device)
    return sum(t.numel() * t.element_size() for per in list(_READY.values()) for t in per.values()
               if dev is None or (t.device.type, t.device.index or 0) == (dev.type, dev.index or 0))


def ready_words(pw: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A Q4_K weight's scale and offset per (group, row) as the kernel applies them: d * sc and -(dmin * mn) in fp32,
    each rounded to dtype (x's), scale in the low half of an int32 word and offset in the high half, [G, N]. Made on
    the weight's device at the first call (cached per weight and dtype)."""
    if pw.fmt != "q4_k":
        raise ValueError(f"int4_wgmma_ws: ready scale words are Q4_K's, not {pw.fmt}'s")
    per = _READY.setdefault(pw, {})
    if dtype not in per:
        G = pw.K // GROUP
        d = pw.scales.float().repeat_interleave(8, dim=0)[:G]        # a super-group's d for its 8 groups
        dmin = pw.mins.float().repeat_interleave(8, dim=0)[:G]
        sub = pw.sub.float()                                          # [G, N, 2]: sc, mn
        pair = torch.stack([d * sub[..., 0], -(dmin * sub[..., 1])], dim=-1).to(dtype)   # the kernel's rounding
        per[dtype] = pair.view(torch.int32).reshape(G, pw.N).contiguous()
    return per[dtype]


def wg_equivalent(config: dict | None = None) -> dict:
    """The int4_wgmma config whose split, stream-K and tiles this kernel's config runs (so its bits): two
    warpgroups, DEFAULTS, then config (without STAGES and CWG, this kernel's own)."""
    c = {k: v for k, v in {**DEFAULTS, **(config or {})}.items() if k not in ("STAGES", "CWG", "MMA", "READY")}
    return {**c, "WGS": 2, "MT": c.get("MT", 2)}


def ws_config(M: int, N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """int4_wgmma's launch for wg_equivalent(config) (its split or stream-K, tiles and batch tile: the same bits),
    with this kernel's block and ring: STAGES (config) or as many as fit. The tile's 128 MT rows go to two consumer
    warpgroups of MT m64 tiles, or with CWG 4 (config; tiles of 256 rows only) to four of one ("CWG", "WG_MT").
    MMA (config, else batch tiles of up to MMA_MAX_BT): the consumers on mma.sync, MMA_CWG of them by default.
    READY (config, default 1): 0 keeps Q4_K's raw scales where ready_scales would give the ring ready words
    ("ready")."""
    cfg = int4_wgmma.wg_config(M, N, K, fmt, wg_equivalent(config))
    mma = int((config or {}).get("MMA", cfg["BT"] <= MMA_MAX_BT))
    if mma not in (0, 1):
        raise ValueError(f"int4_wgmma_ws: MMA={mma}: 0 (wgmma consumers) or 1 (mma.sync consumers)")
    cwg = int((config or {}).get("CWG", MMA_CWG if mma else DEFAULT_CWG))
    if cwg not in REGS:
        raise ValueError(f"int4_wgmma_ws: CWG={cwg}: two or four consumer warpgroups")
    if cfg["MT"] == 1:
        cwg = 2                                 # tiles of 128 rows: one m64 per warpgroup already
    x_in = X_IN_GEMM or cfg["BT"] <= X_IN_GEMM_MAX_BT
    if (config or {}).get("READY", 1) not in (0, 1):
        raise ValueError(f"int4_wgmma_ws: READY={config['READY']}: 0 (raw Q4_K scales) or 1 (ready words)")
    ready = ready_scales(fmt, x_in) and (config or {}).get("READY", 1) == 1
    sb = stage_bytes(cfg["BT"], fmt, cfg["MT"], ready)
    fit = min(MAX_STAGES, (SMEM_LIMIT - 16) // (sb + 16))
    stages = int((config or {}).get("STAGES") or fit)
    if not 2 <= stages <= fit:
        raise ValueError(f"int4_wgmma_ws: STAGES={stages} for BT={cfg['BT']} {fmt}: 2..{fit} stages of {sb} B fit")
    quads, nb = _cdiv(K // GROUP, 4), _cdiv(cfg["BT"], 8)
    # the staging launch: one thread per unit (row, word: four 16-byte pieces) of each (batch tile, quad); the image
    cfg.update(MMA=mma, STAGES=stages, MINB=1, smem=stages * (sb + 16) + 16, block=128 * (cwg + 1), stage_bytes=sb,
               CWG=cwg, WG_MT=cfg["MT"] * 2 // cwg, quads=quads, stage_units=cfg["n_bt"] * quads * 32 * nb,
               x_staged=0 if x_in else cfg["n_bt"] * quads * 8 * 256 * nb, x_in_gemm=x_in, ready=int(ready))
    return cfg


@functools.lru_cache(maxsize=None)
def _kernels(fmt: str, bt: int, x_f16: bool, out32: bool, stages: int, sk: bool, mt: int, cwg: int,
             device: torch.device, x_in_gemm: bool = False, mma: bool = False, fresh: bool = False,
             step_groups: bool = False, ready: bool = False):
    if not available():
        raise RuntimeError("int4_wgmma_ws: needs an sm_90 GPU and torch.cuda._compile_kernel")
    src = source(fmt, bt, x_f16, out32, stages, 1, sk, mt, cwg, x_in_gemm, mma, fresh, step_groups, ready)
    return (nvrtc._Kernel(src, "wg_stage_x", "torch", device, arch="90a"),
            nvrtc._Kernel(src, "w4a16_wgmma_ws", "torch", device, arch="90a"))


class _StagedLaunch:
    """run_packed's kernel: x into the ring's image first (wg_stage_x), then the GEMM reading that image; with
    `image` (kernels/x_image.py: the kernel before x wrote it there) the GEMM alone."""

    def __init__(self, cfg: dict, kernels, image=None):
        self.cfg, (self.stage, self.gemm), self.image = cfg, kernels, image

    def __call__(self, grid: int, block: int, args: list, device: torch.device, shared_mem: int = 0) -> None:
        evict = WEIGHT_EVICT_FIRST and self.cfg["n_bt"] == 1
        if self.cfg.get("x_in_gemm"):           # compiled with X_IN_GEMM: the GEMM reads x itself
            self.gemm(grid, block, args, device, shared_mem, evict=evict)
            return
        if self.image is not None:
            self.gemm(grid, block, [self.image.buf, *args[1:]], device, shared_mem, evict=evict)
            return
        x, sxm, M, G = args[0], args[6], args[9], args[11]     # run_packed's argument order
        c = self.cfg
        xs = _XSTAGED.get(device, c["x_staged"])
        self.stage(_cdiv(c["stage_units"], 256), 256, [x, xs, sxm, M, G, c["quads"], c["stage_units"]], device)
        self.gemm(grid, block, [xs, *args[1:]], device, shared_mem, evict=evict)


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None) -> None:
    """The split-K workspace, the stream-K flags and the staged-x buffer for up to max_rows rows (before graphs
    are captured)."""
    shapes = [s for s in shapes if supports(s[2])]
    nvrtc.reserve_splits(device, shapes, max_rows, lambda M, N, K, fmt: ws_config(M, N, K, fmt, config))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    need = max([ws_config(max_rows, n, k, f, config)["x_staged"] for n, k, f in shapes], default=0)
    if need:
        _XSTAGED.get(device, need)


def image_for(x: torch.Tensor, pw: PackedWeight, config: dict | None = None):
    """The kernels/x_image.XImage into which the kernel making x [M, K] can write this GEMM's staged x (so the GEMM
    skips its staging launch), or None: a weight the bulk copies cannot read, batch tiles that read x in the GEMM,
    or x not whole batch tiles and quads (the staging launch then zeroes the padding)."""
    from onepass.kernels.x_image import QUAD, XImage

    M, K = x.shape
    if not (x.is_cuda and supports(pw.fmt) and aligned(pw)) or K % QUAD:
        return None
    cfg = ws_config(M, pw.N, K, pw.fmt, config)
    if cfg["x_in_gemm"] or M % cfg["BT"]:
        return None
    buf = _XSTAGED.get(x.device, cfg["x_staged"])
    return XImage(buf[:cfg["x_staged"]].view(x.dtype), M, K, cfg["BT"])


def w4a16_wgmma_ws(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
                   config: dict | None = None, defer: bool = False, x_image=None):
    """y = x @ unpack_folded(w, x.dtype)^T for a packed Q4_0 / Q4_1 / Q4_K weight; bitwise int4_wgmma.w4a16_wgmma
    with wg_equivalent(config) (which runs instead where the bulk copies cannot read the weight, see aligned).
    x [M, K] bf16 / fp16; out [M, N] of x's dtype or float32, allocated when None; defer: split-K partials
    returned as a kernels.splitk.SplitSums. x_image: image_for(x, pw, config), already holding x's image (written
    by the kernel that made x): no staging launch."""
    if isinstance(pw, PackedWeight) and not supports(pw.fmt):
        raise ValueError(f"w4a16_wgmma_ws: format {pw.fmt} not supported (only {FORMATS}); use the Triton kernel")
    if isinstance(pw, PackedWeight) and not aligned(pw):
        return int4_wgmma.w4a16_wgmma(x, pw, out, config=wg_equivalent(config), defer=defer)
    planned = {}

    def plan(M, N, K, fmt):                     # once per call: the ready check below and run_packed share it
        if (M, N, K, fmt) not in planned:
            planned[(M, N, K, fmt)] = ws_config(M, N, K, fmt, config)
        return planned[(M, N, K, fmt)]

    sub = None
    if isinstance(pw, PackedWeight) and x.dim() == 2 and x.shape[1] == pw.K and \
            plan(x.shape[0], pw.N, pw.K, pw.fmt)["ready"]:
        have = _READY.get(pw, {}).get(x.dtype)
        if have is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
            # made inside a capture, the words would be filled only by the graph's replays: the raw build instead,
            # which computes the same bits (the warm-up before a capture makes them)
            config = {**(config or {}), "READY": 0}
            planned.clear()
        else:
            sub = have if have is not None else ready_words(pw, x.dtype)

    def launch(cfg, x_f16, out32, dev):
        if x_image is not None and (cfg["x_in_gemm"] or (x_image.M, x_image.K, x_image.BT, x_image.Q) != (
                x.shape[0], x.shape[1], cfg["BT"], cfg["quads"])):
            raise ValueError(f"w4a16_wgmma_ws: x_image of [{x_image.M}, {x_image.K}] in batch tiles of {x_image.BT} "
                             f"is not this call's (x {tuple(x.shape)}, BT {cfg['BT']}); take it from image_for")
        return _StagedLaunch(cfg, _kernels(pw.fmt, cfg["BT"], x_f16, out32, cfg["STAGES"], cfg["workers"] > 0,
                                           cfg["WG_MT"], cfg["CWG"], dev, cfg["x_in_gemm"], bool(cfg["MMA"]),
                                           cfg["BT"] >= FRESH_MIN_BT, cfg["BT"] >= STEP_GROUPS_MIN_BT,
                                           bool(cfg["ready"])), x_image)

    return nvrtc.run_packed(
        "w4a16_wgmma_ws", x, pw, out,
        plan=plan,
        kernel=launch,
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16,
        words_per_pair=WORDS_PER_GROUP[pw.fmt], defer=defer, sub=sub)


__all__ = ["w4a16_wgmma_ws", "image_for", "available", "supports", "aligned", "ws_config", "wg_equivalent",
           "ready_scales", "ready_words", "free_ready", "ready_bytes",
           "reserve_workspace", "source", "stage_bytes", "DEFAULTS", "T128", "MEASURED_T128", "WS_KERNEL"]
