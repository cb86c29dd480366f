"""The runtime every CUDA C++ kernel of onepass is compiled and launched through: NVRTC (CuPy's RawModule, or
torch's own binding), launches on torch's current stream with programmatic dependent launch (kernels/pdl.py), and
the host path the CUDA W4A16 kernels share (kernels/int4_mma.py, int4_wgmma.py, int4_wgmma_ws.py): argument checks,
copies, the split-K workspace and its reduce kernel (kernels/cuda/splitk_reduce.cu), the stream-K flags.

Interop: no copies. torch tensors are passed as raw device pointers (data_ptr()), and the launch goes to torch's
current stream (cupy.cuda.ExternalStream, or cuLaunchKernelEx with PDL on), so it is CUDA-graph capturable; nothing
is allocated when ``out`` is given and the split-K workspace is reserved (an eager call of the same or a larger
shape, or the kernels' ``reserve_workspace``, through ``reserve_splits``).

CuPy stays optional: importing this module never fails. ``available()`` says whether the kernels can run: CuPy
(RawModule/NVRTC) first, else torch's own NVRTC binding (torch.cuda._compile_kernel, a private API present since
torch 2.8; ``ONEPASS_INT4_CUDA_COMPILER=cupy|torch`` forces one, ``off`` turns the CUDA kernels off). A kernel that
names its target (sm_90a: the wgmma kernels) compiles through torch's binding. Without either,
kernels/int4_dispatch.py runs the Triton kernel. The sources use no CUDA headers (conversions in inline PTX), so they
compile the same under both. Each module compiles its kernels lazily and caches them for the process.
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

NUM_SMS = 132                 # H200; a constant so the split rules (and so the bits) are machine-independent
_DTYPES = (torch.bfloat16, torch.float16)

CUDA_DIR = Path(__file__).parent / "cuda"   # the kernels' C++ (package data onepass.kernels.cuda)


def cuda_text(name: str) -> str:
    """The C++ text of kernels/cuda/<name>, exactly as stored (the modules read theirs once, at import)."""
    return (CUDA_DIR / name).read_text(encoding="utf-8")


# the split-K reduce (kernels/cuda/splitk_reduce.cu): reduce_source() puts its #define lines and pdl.CUDA_HELPERS
# before it
REDUCE_SOURCE = cuda_text("splitk_reduce.cu")
REDUCE_DEFINES = 2


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
    """Whether the CUDA kernels can be compiled and run here (a CUDA device and an NVRTC binding)."""
    return _compiler() is not None


def compiler() -> str:
    return _compiler() or "none"


class _Kernel:
    """One compiled kernel, launched on torch's current stream with raw pointers. Compiled once per setting of
    pdl.gemm_release() (the source's PDL_RELEASE) and of the launch's `evict` (the source's WEIGHT_EVICT: weights
    loaded as L2 evict-first, int4_wgmma_ws), read at launch (for a CUDA graph: at capture)."""

    def __init__(self, src: str, name: str, how: str, device: torch.device, arch: str | None = None):
        """arch: a target to name (e.g. "90a" for wgmma; torch's binding only); None: the device's own."""
        if arch is not None:
            assert how == "torch", "nvrtc: a named target compiles through torch's NVRTC binding"
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


def reduce_source(x_f16: bool, out32: bool) -> str:
    """The split-K reduce's full source: REDUCE_DEFINES #define lines, pdl.CUDA_HELPERS, then REDUCE_SOURCE."""
    return f"#define X_F16 {int(x_f16)}\n#define OUT32 {int(out32)}\n" + pdl.CUDA_HELPERS + REDUCE_SOURCE


@functools.lru_cache(maxsize=None)
def _reduce_kernel(x_f16: bool, out32: bool, device: torch.device) -> _Kernel:
    """The split-K reduce for this output (format- and shape-free), compiled once per process."""
    how = _compiler()
    if how is None:
        raise RuntimeError("nvrtc: no CUDA device or no NVRTC binding (install cupy-cuda12x/13x)")
    return _Kernel(reduce_source(x_f16, out32), "w4a16_splitk_reduce", how, device)


# --------------------------------------------------------------------------------------------------
# configuration and workspaces shared by the kernels

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


_SPLITK = SplitKWorkspace()
# stream-K tiles' tickets (int4_wgmma), zero between launches; like the split-K workspace, one buffer per device:
# launches on one stream at a time (the engine's), never two streams at once
_FLAGS = SplitKWorkspace(torch.int32, zeroed=True)


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
    """The host path shared by the CUDA W4A16 kernels (kernels/int4_mma.py, int4_wgmma.py, int4_wgmma_ws.py), whose
    kernels take the
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
    r = _reduce_kernel(x_f16, out32, dev)
    r(_cdiv(M * N, 256), 256, [ws, out, sym, M, N, S], dev)
    return out


__all__ = ["NUM_SMS", "CUDA_DIR", "cuda_text", "available", "compiler", "layered_config", "reserve_splits",
           "run_packed", "reduce_source", "REDUCE_SOURCE"]
