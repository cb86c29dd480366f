"""W4A16 projection y[M, N] = x[M, K] @ w[N, K]^T in CUDA C++, on the PackedWeight layout of
kernels/quant_pack.py (Q4_0 / Q4_1 / Q4_K / Q8_0), compiled at run time through CuPy (RawModule, NVRTC).

Definition: kernels.int4_gemm.w4a16_linear_ref (x @ unpack_ref(w)^T in fp32, rounded once).

The kernel (the seed's BTG design, CUDA cores, fp32 arithmetic)
  A block of KW warps owns 32 weight rows (lane l = row n0 + l) and a tile of BT <= BTG = 8 sequences
  (rows of x); more sequences run over the grid, never over registers. Each lane carries BT fp32
  accumulators in registers. The block walks its K range in chunks of CG groups (32 * CG weights); warp w
  takes groups w, w + KW, ... of every chunk (UPW = CG / KW of them):
    1. weights stream one chunk ahead through UPW register slots per lane (a slot: one group's 16-byte
       words -- 32 bytes for Q8_0 -- and its scales' raw fp16 / 6-bit bits). A slot is refilled with the
       same group of the next chunk as soon as its group has been applied, so the next chunk's loads are
       in flight during this chunk's arithmetic and the next x staging, in the registers of one chunk. A
       warp's load reads 32 consecutive rows: 512 contiguous bytes. Scales are converted when used, so no
       instruction waits on a load issued in the same chunk;
    2. the block stages x[tile, chunk] once in shared memory as fp32 (and, for Q4_1 / Q4_K, the per-group
       sums of x);
    3. each weight group is turned into its exact integers once and applied to all BT sequences:
           P_g[b] = sum_k qq_k * x[b, k]          k ascending, fp32 fma     (qq = q - 8 for Q4_0)
           acc[b] = fma(s_g, P_g[b], acc[b])                                (s = d; Q4_K: d * sc)
           acc[b] = fma(c_g, X_g[b], acc[b])       Q4_1: c = m; Q4_K: c = -(dmin * mn); X_g = sum_k x[b, k]
       The integers: the field at bits [4s, 4s + 4) of a word (s < 4; the upper half after one shift per
       word) is OR-ed into the exponent of 2^(23 - 4s), where its unit is 1, and that power (+ 8 for Q4_0)
       is subtracted: one lop3 and one fadd per weight (bytes alike for Q8_0).
  The warps' sums are added in warp order at the end, then (split-K) the splits' fp32 partials in split
  order by a second kernel, and rounded once. So warp w of a split sums the groups g = g_lo + w (mod KW)
  in ascending order: the bits depend on KW and the split (count, boundaries), not on CG (a multiple of
  KW) nor on BT, since each sequence's accumulators are independent of the others.

  Launch shape per (N, K, fmt): KW, CG and the split (SPLIT_K, or TARGET_BLOCKS for the rule in
  split_rule) are the module defaults, overridden by MEASURED[(N, K, fmt)] (GPU sweeps), overridden by
  w4a16_cuda's ``config=`` (the sweep itself). None of it depends on M, so the kernel is batch-invariant:
  row m of y is bitwise the same whatever M is. Only CG may vary with BT: lowered to fit 48 KB of static
  shared memory (chunk_groups), which cannot change the bits. (The bits differ from the Triton kernel's,
  whose group sums run on tensor cores; kernels/int4_dispatch.py keeps one kernel per shape in its
  batch-invariant policy.)

  Cost model: the weight bytes are read once per BT sequences; the arithmetic is BT fp32 FMAs plus ~2
  dequantization instructions per weight on the CUDA cores, so the kernel is built for B <= 8, where the
  weight stream, not the tensor cores, decides the time. The tensor-core Triton kernel covers larger B.

Interop: no copies. torch tensors are passed as raw device pointers (data_ptr()), and the launch goes to
torch's current stream (cupy.cuda.ExternalStream), so it is CUDA-graph capturable; nothing is allocated
when ``out`` is given and the split-K workspace is reserved (an eager call of the same or a larger
shape, or ``reserve_workspace``).

CuPy stays optional: importing this module never fails. ``available()`` says whether the kernel can
run: CuPy (RawModule/NVRTC) first, else torch's own NVRTC binding (torch.cuda._compile_kernel, a private
API present since torch 2.8; ``ONEPASS_INT4_CUDA_COMPILER=cupy|torch`` forces one). Without either,
kernels/int4_dispatch.py runs the Triton kernel. The source uses no CUDA headers (conversions in inline
PTX), so it compiles the same under both. Kernels are compiled lazily, one per (format, BT, x dtype,
output kind, KW, CG), and cached for the process.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from onepass.kernels.quant_pack import GROUP, PackedWeight
from onepass.kernels import pdl
from onepass.kernels.workspace import SplitKWorkspace

try:  # optional dependency
    import cupy as _cupy  # type: ignore
except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
    _cupy = None

NUM_SMS = 132                 # H200; a constant so the split rule (and so the bits) is machine-independent
ROWS = 32                     # weight rows per block (one per lane)
BTG = 8                       # the largest batch tile: sequences whose accumulators a lane carries
BT_CHOICES = (1, 2, 4, 8)
# launch shape: these defaults, then MEASURED[(N, K, fmt)], then w4a16_cuda's config= (shape_config)
KW = 4                        # warps per block, splitting each chunk's groups
CG = 32                       # groups per chunk staged in shared memory (1024 weights of K)
TARGET_BLOCKS = 4 * NUM_SMS   # split-K until the grid holds ~4 blocks per SM at one batch tile
MAX_SPLIT = 16                # the rule's limits (an explicit SPLIT_K is only clamped to 1..G)
MIN_GROUPS_PER_SPLIT = 8
CONFIG_KEYS = ("KW", "CG", "SPLIT_K", "TARGET_BLOCKS")
# (N, K, fmt) -> some of CONFIG_KEYS. H200 sweep at B = 1 (torch 2.11, cupy 14.2; the defaults elsewhere):
# 8 warps and ~8 blocks per SM for the tall shapes, 16-group chunks for the medium ones.
MEASURED: dict[tuple[int, int, str], dict] = {
    (17408, 5120, "q4_0"): {"KW": 8, "TARGET_BLOCKS": 1056},      # 27.3 us vs 31.9 with the defaults
    (5120, 17408, "q4_k"): {"KW": 8, "TARGET_BLOCKS": 1056},      # 34.5 vs 46.2
    (34816, 5120, "q4_k"): {"KW": 8, "TARGET_BLOCKS": 1056},      # 55.7 vs 73.1
    (10240, 5120, "q4_k"): {"CG": 16},                            # 21.2 vs 27.7
    (5120, 6144, "q4_k"): {"CG": 16},                             # 15.0 vs 18.6
}
MAX_KW = 16
MAX_UPW = 16                  # CG / KW: register slots per lane (each 16 or 32 bytes of weights)
SMEM_LIMIT = 48 * 1024        # static shared memory of one block
FMT_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 2, "q8_0": 3}
_DTYPES = (torch.bfloat16, torch.float16)

CUDA_DIR = Path(__file__).parent / "cuda"   # the kernels' C++ (package data onepass.kernels.cuda)


def cuda_text(name: str) -> str:
    """The C++ text of kernels/cuda/<name>, exactly as stored (the modules read theirs once, at import)."""
    return (CUDA_DIR / name).read_text(encoding="utf-8")


# the kernel body (kernels/cuda/int4_cuda.cu): source() puts its #define lines and pdl.CUDA_HELPERS before it
CUDA_SOURCE = cuda_text("int4_cuda.cu")


def _compiler() -> str | None:
    """Which NVRTC binding compiles the kernels: "cupy", "torch" or None (the CUDA path is off)."""
    if not torch.cuda.is_available():
        return None
    want = os.environ.get("ONEPASS_INT4_CUDA_COMPILER", "").strip().lower()
    has_torch = hasattr(torch.cuda, "_compile_kernel")
    if want == "cupy":
        return "cupy" if _cupy is not None else None
    if want == "torch":
        return "torch" if has_torch else None
    if want in ("off", "none", "0"):
        return None
    if _cupy is not None:
        return "cupy"
    return "torch" if has_torch else None


def available() -> bool:
    """Whether the CUDA kernel can run here (a CUDA device and an NVRTC binding)."""
    return _compiler() is not None


def compiler() -> str:
    return _compiler() or "none"


def source(fmt: str, bt: int, x_f16: bool, out32: bool, kw: int | None = None, cg: int | None = None) -> str:
    """The full source for one instantiation (six #define lines, then CUDA_SOURCE); kw / cg default to KW / CG."""
    kw, cg = kw or KW, cg or CG
    head = (f"#define FMT {FMT_CODE[fmt]}\n#define BT {bt}\n#define X_F16 {int(x_f16)}\n#define OUT32 {int(out32)}\n"
            f"#define KW {kw}\n#define CG {cg}\n")
    return head + pdl.CUDA_HELPERS + CUDA_SOURCE


class _Kernel:
    """One compiled kernel, launched on torch's current stream with raw pointers. Compiled once per setting of
    pdl.gemm_release() (the source's PDL_RELEASE) and of the launch's `evict` (the source's WEIGHT_EVICT: weights
    loaded as L2 evict-first, int4_wgmma_ws), read at launch (for a CUDA graph: at capture)."""

    def __init__(self, src: str, name: str, how: str, device: torch.device, arch: str | None = None):
        """arch: a target to name (e.g. "90a" for wgmma; torch's binding only); None: the device's own."""
        if arch is not None:
            assert how == "torch", "int4_cuda: a named target compiles through torch's NVRTC binding"
        self.how, self.name, self._src, self._arch, self._device = how, name, src, arch, device
        self._fns: dict[tuple[bool, bool], object] = {}
        self._mods: list = []
        self._smem_set: dict[tuple[bool, bool], int] = {}
        self._streams: dict[int, object] = {}

    def _compile(self, key: tuple[bool, bool]):
        """The kernel for this (release, evict) setting, compiled on its first launch."""
        fn = self._fns.get(key)
        if fn is not None:
            return fn
        release, evict = key
        src = ("#define PDL_RELEASE 1\n" if release else "") + ("#define WEIGHT_EVICT 1\n" if evict else "") + self._src
        device = self._device
        if self._arch is not None:
            with torch.cuda.device(device):
                fn = torch.cuda._compile_kernel(src, self.name, compute_capability=self._arch)
        elif self.how == "cupy":
            with _cupy.cuda.Device(device.index or 0):
                mod = _cupy.RawModule(code=src, options=("--std=c++14",))
                fn = mod.get_function(self.name)
            self._mods.append(mod)
        else:
            with torch.cuda.device(device):
                fn = torch.cuda._compile_kernel(src, self.name)
        self._fns[key] = fn
        return fn

    def __call__(self, grid: int, block: int, args: list, device: torch.device, shared_mem: int = 0,
                 evict: bool = False) -> None:
        """Launch on torch's current stream; shared_mem: dynamic shared memory in bytes (above 48 KB the kernel's
        limit is raised once, as CUDA requires); evict: compiled with WEIGHT_EVICT defined (a source that reads it
        loads its weights as L2 evict-first)."""
        stream = torch.cuda.current_stream(device)
        on = pdl.enabled(device)
        key = (on and pdl.gemm_release(), bool(evict))
        fn = self._compile(key)
        if shared_mem > self._smem_set.get(key, 0) and shared_mem >= 48 * 1024:
            if self.how == "cupy":
                fn.max_dynamic_shared_size_bytes = shared_mem
            else:
                fn.set_shared_memory_config(shared_mem)
            self._smem_set[key] = shared_mem
        if on:   # every kernel of these modules keeps the PDL contract (kernels/pdl.py)
            func = fn.kernel.ptr if self.how == "cupy" else fn.func   # RawKernel -> Function
            pdl.launch_ex(func, grid, block, shared_mem, stream.cuda_stream, list(args))
        elif self.how == "cupy":
            import numpy as np

            ptr = stream.cuda_stream
            ext = self._streams.get(ptr)
            if ext is None:
                ext = self._streams[ptr] = _cupy.cuda.ExternalStream(ptr, device.index or 0)
            cargs = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else np.int32(a) for a in args)
            with _cupy.cuda.Device(device.index or 0), ext:
                fn((grid,), (block,), cargs, shared_mem=shared_mem)
        else:
            fn(grid=(grid, 1, 1), block=(block, 1, 1), args=list(args), shared_mem=shared_mem, stream=stream)


@functools.lru_cache(maxsize=None)
def _kernel(name: str, fmt: str, bt: int, x_f16: bool, out32: bool, kw: int, cg: int, device: torch.device) -> _Kernel:
    how = _compiler()
    if how is None:
        raise RuntimeError("int4_cuda: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return _Kernel(source(fmt, bt, x_f16, out32, kw, cg), name, how, device)


# --------------------------------------------------------------------------------------------------
# configuration: everything that fixes the bits comes from (N, K, fmt) alone

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layered_config(name: str, shape: tuple, base: dict, layers: tuple, keys: tuple) -> dict:
    """base, then each layer (MEASURED's entry, a call's config=; None skipped) replacing the keys it names; a
    layer naming one split key ("SPLIT_K" / "TARGET_BLOCKS") drops the other, naming both is an error."""
    out = dict(base)
    for layer in layers:
        if not layer:
            continue
        if set(layer) - set(keys) or {"SPLIT_K", "TARGET_BLOCKS"} <= set(layer):
            raise ValueError(f"{name}: config {layer} for {shape}: keys are {keys}, one split key")
        if "SPLIT_K" in layer or "TARGET_BLOCKS" in layer:
            out.pop("SPLIT_K", None)
            out.pop("TARGET_BLOCKS", None)
        out.update({k: int(v) for k, v in layer.items()})
    return out


def shape_config(N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """The launch shape of (N, K, fmt): {"KW", "CG"} and one of "SPLIT_K" / "TARGET_BLOCKS": the module
    defaults, MEASURED[(N, K, fmt)], then ``config`` (layered_config)."""
    out = layered_config("int4_cuda", (N, K, fmt), {"KW": KW, "CG": CG, "TARGET_BLOCKS": TARGET_BLOCKS},
                         (MEASURED.get((N, K, fmt)), config), CONFIG_KEYS)
    kw, cg = out["KW"], out["CG"]
    if not (1 <= kw <= MAX_KW and cg % kw == 0 and 1 <= cg // kw <= MAX_UPW) or min(out.values()) < 1:
        raise ValueError(f"int4_cuda: config {out} for {(N, K, fmt)}: need 1 <= KW <= {MAX_KW}, CG a positive "
                         f"multiple of KW with CG / KW <= {MAX_UPW}, a positive split value")
    return out


def _smem(bt: int, kw: int, cg: int) -> int:
    """Static shared memory of one block: xs, xsum, red."""
    return 4 * (bt * cg * 32 + bt * cg + max(kw - 1, 1) * bt * 32)


def chunk_groups(bt: int, kw: int, cg: int) -> int:
    """The CG compiled for batch tile bt: cg, lowered by multiples of kw until the block fits SMEM_LIMIT.
    Bit-neutral: warp w sums the groups g = g_lo + w (mod kw) of its split in ascending order whatever the
    chunk size, as long as it is a multiple of kw."""
    while cg > kw and _smem(bt, kw, cg) > SMEM_LIMIT:
        cg -= kw
    return cg


@functools.lru_cache(maxsize=None)
def _split(G: int, n_nt: int, target: int | None, split_k: int | None) -> tuple[int, int]:
    if G == 0:
        return 1, 0
    if split_k is not None:
        S = min(split_k, G)
    else:
        S = 1
        while S < MAX_SPLIT and n_nt * S < target and _cdiv(G, S + 1) >= MIN_GROUPS_PER_SPLIT:
            S += 1
    gps = _cdiv(G, S)
    return _cdiv(G, gps), gps


def split_rule(N: int, K: int, fmt: str, config: dict | None = None) -> tuple[int, int]:
    """(splits, groups per split). SPLIT_K: that many (at most G); TARGET_BLOCKS: the smallest S <= MAX_SPLIT
    whose grid (one batch tile) reaches it, keeping >= MIN_GROUPS_PER_SPLIT groups per split. S is then
    recomputed so that no split is empty."""
    c = shape_config(N, K, fmt, config)
    return _split(K // GROUP, _cdiv(N, ROWS), c.get("TARGET_BLOCKS"), c.get("SPLIT_K"))


def batch_tile(M: int) -> int:
    """BT: the smallest of 1/2/4/8 holding M (8 above: more tiles over the grid)."""
    return next((b for b in BT_CHOICES if M <= b), BTG)


def cuda_config(M: int, N: int, K: int, fmt: str, config: dict | None = None) -> dict:
    """The launch for x [M, K]. KW and the split come from (N, K, fmt) and config only, never from M; BT,
    the batch tiles and CG (bit-neutral, chunk_groups) may depend on M."""
    c = shape_config(N, K, fmt, config)
    S, gps = _split(K // GROUP, _cdiv(N, ROWS), c.get("TARGET_BLOCKS"), c.get("SPLIT_K"))
    bt, kw = batch_tile(M), c["KW"]
    n_bt, n_nt = _cdiv(M, bt), _cdiv(N, ROWS)
    return {"BT": bt, "KW": kw, "CG": chunk_groups(bt, kw, c["CG"]), "SPLIT_K": S, "groups_per_split": gps,
            "grid": n_bt * n_nt * S, "block": kw * 32, "n_bt": n_bt, "n_nt": n_nt,
            "workspace_floats": S * M * N if S > 1 else 0}


_SPLITK = SplitKWorkspace()
# stream-K tiles' tickets (int4_wgmma), zero between launches; like the split-K workspace, one buffer per device:
# launches on one stream at a time (the engine's), never two streams at once
_FLAGS = SplitKWorkspace(torch.int32, zeroed=True)


def reserve_workspace(device: torch.device | str, shapes, max_rows: int, config: dict | None = None) -> None:
    """Size the split-K workspace for up to max_rows rows of every (N, K, fmt) in shapes (before capture),
    with their MEASURED launch shapes, or ``config`` for all of them."""
    reserve_splits(device, shapes, max_rows, lambda M, N, K, fmt: cuda_config(M, N, K, fmt, config))


def reserve_splits(device: torch.device | str, shapes, max_rows: int, plan) -> None:
    """Grow the split-K workspace (shared by the CUDA kernels) and the stream-K flags to the largest need of
    max_rows rows of the (N, K, fmt) in shapes, plan(M, N, K, fmt) giving each launch's "workspace_floats" (and
    "flag_ints")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    plans = [plan(max_rows, n, k, f) for n, k, f in shapes]
    need = max([p["workspace_floats"] for p in plans], default=0)
    if need:
        _SPLITK.get(device, need)
    flags = max([p.get("flag_ints", 0) for p in plans], default=0)
    if flags:
        _FLAGS.get(device, flags)


# --------------------------------------------------------------------------------------------------
# host entry point

def run_packed(name: str, x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None, plan, kernel,
               x_needs_copy, words_per_pair: int, defer: bool = False, sub: torch.Tensor | None = None):
    """The host path shared by the CUDA W4A16 kernels (this one and kernels/int4_mma.py), whose kernels take the
    same arguments (x, qweight, scales, mins, sub, y, sxm, sym, sys, M, N, G, groups per split, n_bt, n_nt):
    argument checks, empty shapes, copies of x / out the kernel cannot read or write in place, then one launch
    and, split-K, the partials into the workspace and the split-order reduce. A stream-K plan ("workers" > 0,
    int4_wgmma) passes the workers where the groups per split go, plus the workspace and the flags, and its
    kernel writes out itself.
    plan(M, N, K, fmt) -> the launch dict; kernel(cfg, x_f16, out32, device) -> the compiled kernel;
    x_needs_copy(x) -> whether x must be made contiguous first; words_per_pair: the kernel's int32 index
    reaches G * N * words_per_pair. defer: with several splits, return the partials unreduced as a
    kernels.splitk.SplitSums (out is then not written) for the consumer to add. sub: what the kernel's sub argument
    points at instead of the weight's own (int4_wgmma_ws's ready Q4_K scale words)."""
    assert isinstance(pw, PackedWeight), f"{name}: pw must be a PackedWeight, got {type(pw).__name__}"
    assert x.dim() == 2 and x.shape[1] == pw.K, f"{name}: x {tuple(x.shape)} vs weight [{pw.N}, {pw.K}]"
    assert x.dtype in _DTYPES, f"{name}: x dtype {x.dtype} not supported (bf16 / fp16)"
    assert x.is_cuda and pw.qweight.device == x.device, f"{name}: x and the weight must be on one CUDA device"
    M, K = x.shape
    N = pw.N
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.dtype in (x.dtype, torch.float32), \
        f"{name}: out {tuple(out.shape)} {out.dtype}, expected {(M, N)} {x.dtype} or float32"
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if x_needs_copy(x):
        x = x.contiguous()
    if out.stride(1) != 1:
        return out.copy_(run_packed(name, x, pw, None, plan, kernel, x_needs_copy, words_per_pair, sub=sub))
    cfg = plan(M, N, K, pw.fmt)
    x_f16 = x.dtype == torch.float16
    out32 = out.dtype == torch.float32
    G = K // GROUP
    c = pw.mins if pw.mins is not None else pw.scales
    if sub is None:
        sub = pw.sub if pw.sub is not None else pw.scales
    assert sub.data_ptr() % 2 == 0, f"{name}: the kernel reads sub's (sc, mn) pairs as 16-bit words"
    assert G * N * words_per_pair < 2 ** 31, f"{name}: {G} x {N} (group, row) pairs overflow the kernel's int32 index"
    S, dev = cfg["SPLIT_K"], x.device
    sxm = x.stride(0) if M > 1 else K
    sym = out.stride(0) if M > 1 else N
    tail = [M, N, G, cfg.get("workers") or cfg["groups_per_split"], cfg["n_bt"], cfg["n_nt"]]
    if cfg.get("workers"):      # stream-K: the kernel finishes the shared tiles itself (ws, flags); defer moot
        ws, flags = _SPLITK.get(dev, cfg["workspace_floats"]), _FLAGS.get(dev, cfg["flag_ints"])
        kernel(cfg, x_f16, out32, dev)(cfg["grid"], cfg["block"], [x, pw.qweight, pw.scales, c, sub, out, sxm, sym, 0,
                                                                   *tail, ws, flags], dev, cfg.get("smem", 0))
        return out
    if S == 1:
        kernel(cfg, x_f16, out32, dev)(cfg["grid"], cfg["block"], [x, pw.qweight, pw.scales, c, sub, out, sxm, sym, 0,
                                                                   *tail], dev, cfg.get("smem", 0))
        return out
    ws = _SPLITK.get(dev, S * M * N)
    kernel(cfg, x_f16, True, dev)(cfg["grid"], cfg["block"], [x, pw.qweight, pw.scales, c, sub, ws, sxm, N, M * N,
                                                              *tail], dev, cfg.get("smem", 0))
    if defer:
        from onepass.kernels.splitk import SplitSums
        return SplitSums(ws[:S * M * N].view(S, M, N), out)
    r = _kernel("w4a16_splitk_reduce", "q4_0", 1, x_f16, out32, KW, CG, dev)   # format- and shape-free
    r(_cdiv(M * N, 256), 256, [ws, out, sym, M, N, S], dev)
    return out


def w4a16_cuda(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, *,
               config: dict | None = None, defer: bool = False):
    """y = x @ w^T for a packed weight with the CUDA kernel (module docstring). x [M, K] bf16/fp16 with
    unit column stride; out [M, N] (unit column stride) of x's dtype or float32, allocated when None.
    config: a launch shape overriding MEASURED / the defaults for this call (tuning sweeps; see shape_config)."""
    return run_packed(
        "w4a16_cuda", x, pw, out,
        plan=lambda M, N, K, fmt: cuda_config(M, N, K, fmt, config),
        kernel=lambda cfg, x_f16, out32, dev: _kernel("w4a16_cuda", pw.fmt, cfg["BT"], x_f16, out32, cfg["KW"],
                                                      cfg["CG"], dev),
        x_needs_copy=lambda x: x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]),
        words_per_pair=1, defer=defer)


__all__ = ["w4a16_cuda", "run_packed", "available", "compiler", "cuda_config", "shape_config", "split_rule",
           "reserve_workspace", "reserve_splits", "CUDA_SOURCE", "source", "BTG", "MEASURED"]
