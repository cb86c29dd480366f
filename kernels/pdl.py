"""Programmatic dependent launch (PDL, sm_90 and up): a step's kernels overlap their launch with the kernel
before them in the stream.

Why: a decode step at small B is hundreds of kernels, most of them a few microseconds long (norms, the GDN step,
gates, attention) between GEMVs. Launched plainly, every kernel is launched only after the one before it has
drained, so each boundary costs a full launch latency. With PDL the launch is processed ahead and the kernel's
blocks start the moment the previous kernel's blocks retire; the kernel then waits (griddepcontrol.wait) only
where it first touches memory that kernel may have written.

The contract every kernel launched with PDL keeps (the launch attribute alone would let it race):
  - it waits (griddepcontrol.wait: the previous kernel has completed and its writes are visible) before it reads
    anything but constant weights and before it writes anything at all; the int4 GEMMs issue their first weight
    loads before the wait;
  - with EARLY (ONEPASS_PDL_TRIGGER=1) it also triggers its dependents at entry (griddepcontrol.launch_dependents),
    so the next kernel may launch once every block of this one has started. Off by default: H200, same process,
    CUDA graphs, us per step with PDL off / on without the trigger / on with it: Llama-3.2-1B Q4_0 packed B = 1
    674 / 572 / 613, B = 32 990 / 898 / 1,071, B = 128 1,785 / 1,696 / 2,009; the 27B hybrid Q4_K B = 1 7,827 /
    7,316 / 7,303, B = 8 10,248 / 9,748 / 9,843, B = 128 34,317 / 33,916 / 34,450. Kernels resident early and
    waiting cost more than the weight loads they put in flight bought back.
The wait is transitive: a kernel completes only after its own wait returned, so everything earlier in the stream
is complete too. Kernels launched without the attribute (torch's, cuBLAS's) wait for their predecessor as always.
No deadlock: a dependent launches only after all of its predecessor's blocks are resident.

Switch: on wherever it can run (CUDA, sm_90+, a Triton that has gdc_wait, not the interpreter), off with
ONEPASS_PDL=0 or `set_enabled(False)` (engine.pdl). It is read when a kernel is launched (for a CUDA graph: at
capture); EARLY when this module is imported.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels.triton_compat import tl, triton

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
    return device.type == "cuda" and supported(device.index if device.index is not None else torch.cuda.current_device())


# EARLY: kernels also trigger their dependents at entry (measured slower, see above); without it a dependent launches
# when its predecessor completes, its launch processed ahead
EARLY = os.environ.get("ONEPASS_PDL_TRIGGER", "0") == "1"


def triton_opts(device: torch.device) -> dict:
    """Extra launch arguments for a Triton kernel that calls `enter(PDL)`: {} when PDL is off."""
    return {"PDL": 2 if EARLY else 1, "launch_pdl": True} if enabled(device) else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL kernel's first statement: (PDL == 2) let the next kernel launch, then wait for the previous one."""
    if PDL:
        if PDL == 2:
            gdc_launch_dependents()
        gdc_wait()


# The same two instructions for the CUDA C++ kernels (kernels/int4_*.py), no-ops on older targets and on the host
# emulator (and the trigger without EARLY); harmless when the kernel was launched without PDL.
CUDA_HELPERS = f"#define PDL_EARLY {int(EARLY)}\n" + r"""
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && PDL_EARLY
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"""


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
    """Launch CUfunction `func` (an int or a ctypes.c_void_p) on `stream` with PDL; args: tensors (passed as pointers) and ints (C int)."""
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
