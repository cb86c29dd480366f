"""Programmatic dependent launch (PDL, sm_90 and up): a step's kernels overlap their launch with the kernel
before them in the stream.

Why: a decode step at small B is hundreds of kernels, most of them a few microseconds long (norms, the GDN step,
gates, attention) between GEMVs. Launched plainly, every kernel is launched only after the one before it has
drained, so each boundary costs a full launch latency. With PDL the launch is processed ahead and the kernel's
blocks start the moment the previous kernel's blocks retire; the kernel then waits (griddepcontrol.wait) only
where it first touches memory that kernel may have written.

The contract every kernel launched with PDL keeps (the launch attribute alone would let it race): it waits
(griddepcontrol.wait: the previous kernel has completed and its writes are visible) before it reads anything but
constant weights and before it writes anything at all; the int4 GEMMs issue their first weight loads before it.
Early trigger: for engines of up to EARLY_MAX_BATCH sequences the Triton kernels also trigger their dependents at
entry (griddepcontrol.launch_dependents), so the next kernel -- often a GEMM -- launches once every block of this
one has started, instead of when it completes; the CUDA GEMMs never trigger early (the ws GEMM's x-staging launch
does, at every batch: its dependent is that GEMM, see kernels/int4_wgmma_ws.py), only late (below). H200, harness
runs (decode tok/s with PDL off / on / on with the Triton kernels triggering early / on with every kernel
triggering early):
Llama-3.2-1B Q4_0 packed B = 1 1,440 / 1,521 / 1,665 / 1,569, B = 32 31,376 / 32,656 / 32,647 / 28,676,
B = 128 69,737 / 71,165 / 69,111 / 62,277; the 27B hybrid Q4_K B = 1 126.8 / 130.1 / 136.2 / 135.8, B = 8 778 /
796 / 821 / 816, B = 128 3,713 (at the commit before PDL) / 3,745 / - / 3,713. Kernels resident early and waiting
(GEMMs above all) cost more at large B than the launch they hide. Above 32 again at e8d971c (H200 probe, graphed
steps, ms per step with the early trigger / without, the same tokens): the hybrid gains at 64 (bf16 state 14.48-14.67 /
14.98-15.27, fp32 state 16.21 / 16.59-16.90) and little at 128 (26.23-26.28 / 26.44-26.49); Llama-3.2-1B does not:
Q4_0 packed B = 64 1.090-1.093 / 1.092-1.097 (even), B = 128 1.432-1.438 / 1.359-1.363; with bf16 weights, whose
Triton GEMM triggers too, B = 64 1.372-1.375 / 1.202-1.206 and B = 128 1.572-1.574 / 1.420-1.421. So the limit is
per architecture (EARLY_MAX_BATCH_BY_ARCH): 32 for the dense decoders, 128 for the hybrid (qwen35), whose steps at
3b81d32 again gain from it (H200, 27B Q4_K, switch_ab on kernels.pdl._early, one process, the same tokens, ms per
step without / with: B = 64 16.579-16.609 / 15.943-15.967, B = 128 24.923-24.969 / 24.569-24.578). Above 128 (not
measured) every model triggers late. The CUDA GEMMs' late release (below) on top of it lost there (5acc4d6, the same
method, ms per step without / with: B = 64 15.922-15.927 / 16.041-16.059, B = 128 24.444-24.529 / 24.645-24.674).
Late release (engines of up to RELEASE_MAX_BATCH sequences): a CUDA GEMM block releases its dependents
(pdl_release: griddepcontrol.launch_dependents) once its last weight load is issued, and the split-K reduce at entry,
so the next kernel launches during the GEMM's tail instead of after it; the source is compiled once per setting
(nvrtc._Kernel), and the outputs are the same bits. H200 probe at bd12c9a, off / on in one job: int4_gemm-style
chains of one GEMM gain at 1-32 sequences (5120x17408 Q4_0, B = 1: 18.25 / 18.07 us, B = 16 ws 25.15 / 23.69;
2048x2048 B = 16 ws 8.97 / 7.02) but lose up to 18% at 128 (2048x2048 ws t128 11.48 / 14.04) and with the two-block
wgmma on the small shapes (4096x4096 B = 32 11.07 / 12.74). In the graphed steps, where a GEMM is followed by a norm
or a gate rather than another GEMM, less is left: the 27B hybrid B = 1 6.79 / 6.75 ms, B = 8 8.39 / 8.37, B = 32
11.42-11.60 / 11.48 (noise), B = 128 26.67-26.81 / 26.66-26.78; Llama-3.2-1B Q4_0 packed B = 1 0.570 / 0.566,
B = 32 0.938 / 0.952, B = 128 1.35 / 1.45. So the release is on up to 8 sequences. Releasing from the tensor-core
mma kernels (kernels/int4_mma.py) at every batch while the others keep the limit was tried too (H200 probe at d75e6e9,
int4_gemm's method, us per call without / with): it pays at 16 sequences (960x576 Q4_1 4.4 / 3.6, 3072x576 5.5 / 4.5,
4096x4096 Q4_0 10.7 / 9.3) but is mixed above (B = 32: 576x576 6.0 / 4.7, 2048x2048 7.6 / 8.5, 3072x576 6.4 / 6.9;
B = 128: 576x1536 9.1 / 8.1, 960x576 6.4 / 6.9), and so are the steps (switch_ab, one process, ms per step:
SmolLM2-135M shapes Q4_1 B = 32 0.954 / 0.973, B = 128 1.359 / 1.304; Llama-3.2-1B Q4_0 0.942 / 0.950 and 1.371 /
1.369): not kept.
What a boundary costs at the least (H200 probe at c2102e3, 2026-12-03: graphed chains of a trivial Triton kernel,
each loading and storing 512 floats a program, us per kernel with 1 / 10 / 132 programs): without PDL 1.00 / 1.04 /
1.16, with PDL 0.76 / 0.81 / 1.11, with PDL and the early trigger 0.84 / 0.78 / 0.84. So a graphed step of n
kernels spends about 0.8 n us on boundaries alone (the 27B hybrid at B = 1: 763 kernels, up to ~0.6 ms of a 5.8 ms
step) however short its kernels are.
The wait is transitive: a kernel completes only after its own wait returned, so everything earlier in the stream
is complete too. Kernels launched without the attribute (torch's, cuBLAS's) wait for their predecessor as always.
No deadlock: a dependent launches only after all of its predecessor's blocks are resident.

Switch: on wherever it can run (CUDA, sm_90+, a Triton that has gdc_wait, not the interpreter), off with
ONEPASS_PDL=0 or `set_enabled(False)` (engine.pdl); `configure(enabled, batch)` sets both from an engine's config.
Both are read when a kernel is launched (for a CUDA graph: at capture).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from onepass.kernels.triton_compat import tl, triton

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older triton, or none: PDL stays off (enter() is never compiled with PDL=True)
    gdc_launch_dependents = gdc_wait = None

_override: bool | None = None


def set_enabled(flag: bool | None) -> None:
    """Force PDL on (where supported) or off; None: back to the default (ONEPASS_PDL, on unless "0")."""
    global _override
    _override = flag


@functools.lru_cache(maxsize=None)
def supported(device_index: int) -> bool:
    """Whether this device, driver and Triton can launch with PDL."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(device: torch.device | None = None) -> bool:
    want = _override if _override is not None else os.environ.get("ONEPASS_PDL", "1") not in ("0", "false", "off")
    if not want:
        return False
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return False
    return supported(device.index if device.index is not None else torch.cuda.current_device())


EARLY_MAX_BATCH = 32   # the largest engine batch whose Triton kernels trigger early (measured at 1, 8, 32; 128 lost)
EARLY_MAX_BATCH_BY_ARCH = {"qwen35": 128}   # architectures measured otherwise (module docstring)
_early = False


def set_early(flag: bool) -> None:
    """Whether Triton kernels launched from now on trigger their dependents at entry."""
    global _early
    _early = bool(flag)


RELEASE_MAX_BATCH = 8   # the largest engine batch whose CUDA GEMMs release their dependents late (module docstring)
_release = False


def set_gemm_release(flag: bool) -> None:
    """Whether the CUDA GEMMs launched from now on let their dependents launch once their last weight loads are
    issued (and the split-K reduce at entry), instead of at completion."""
    global _release
    _release = bool(flag)


def gemm_release() -> bool:
    return _release


def early_max_batch(arch: str | None = None) -> int:
    """The largest engine batch whose Triton kernels trigger early, for a model of this GGUF architecture."""
    return EARLY_MAX_BATCH_BY_ARCH.get(arch, EARLY_MAX_BATCH)


def configure(on: bool, batch: int, arch: str | None = None) -> None:
    """An engine's setting: PDL on or off (engine.pdl), the early trigger from its batch and the model's
    architecture (early_max_batch), the GEMMs' late release from its batch too (RELEASE_MAX_BATCH)."""
    set_enabled(on)
    set_early(batch <= early_max_batch(arch))
    set_gemm_release(batch <= RELEASE_MAX_BATCH)


def mode(device: torch.device) -> int:
    """The runs' metrics.pdl: 0 PDL off here; 1 on; 2 on, Triton kernels triggering early; 3 on, the CUDA GEMMs'
    late release; 4 on, both."""
    return 1 + int(_early) + 2 * int(_release) if enabled(device) else 0


def triton_opts(device: torch.device) -> dict:
    """Extra launch arguments for a Triton kernel that calls `enter(PDL)`: {} when PDL is off."""
    return {"PDL": 2 if _early else 1, "launch_pdl": True} if enabled(device) else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's first statement: (PDL == 2) let the next kernel launch, then wait for the previous one."""
    if PDL:
        if PDL == 2:
            gdc_launch_dependents()
        gdc_wait()


# The wait for the CUDA C++ kernels (kernels/int4_*.py): a no-op on older targets, on the host emulator and when the
# kernel was launched without PDL. The GEMMs never trigger early, only release late (see above). The C++ is
# kernels/cuda/pdl.cuh (package data), read once here; the int4 modules put it before their own sources.
CUDA_HELPERS = (Path(__file__).parent / "cuda" / "pdl.cuh").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# cuLaunchKernelEx with the programmatic-serialization attribute, for kernels compiled through NVRTC (CuPy or
# torch's binding hand back a CUfunction; neither launches with attributes)

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID


class _AttrValue(ctypes.Union):
    _fields_ = [("flag", ctypes.c_int), ("pad", ctypes.c_char * 64)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def launch_ex(func, grid: int, block: int, shared_mem: int, stream: int, args: list) -> None:
    """Launch CUfunction `func` (an int or a ctypes.c_void_p) on `stream` with PDL; args: tensors (passed as
    pointers) and ints (C int)."""
    keep, ptrs = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, int):
            c = ctypes.c_int(a)
        else:
            raise TypeError(f"pdl.launch_ex: unsupported kernel argument {type(a).__name__}")
        keep.append(c)
        ptrs.append(ctypes.cast(ctypes.byref(c), ctypes.c_void_p))
    params = (ctypes.c_void_p * len(ptrs))(*ptrs)
    attr = _Attr(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.flag = 1
    cfg = _LaunchConfig(grid, 1, 1, block, 1, 1, shared_mem, ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
    lib = _libcuda()
    fn = func if isinstance(func, ctypes.c_void_p) else ctypes.c_void_p(func)
    err = lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None)
    if err != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernelEx failed ({err}): {msg.value.decode() if msg.value else 'unknown'}")
