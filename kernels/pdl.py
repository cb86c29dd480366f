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
does, at every batch: its dependent is that GEMM, see kernels/int4_wgmma_ws.py), only late (below). Kernels resident
early and waiting (GEMMs above all) cost more at large B than the launch they hide, and where that happens depends
on the model, so the limit is per architecture (EARLY_MAX_BATCH_BY_ARCH): 32 for the dense decoders, 128 for the
hybrid (qwen35). Above 128 (not measured) every model triggers late. The CUDA GEMMs' late release on top of the early
trigger lost at 64 and 128 sequences.
Late release (engines of up to RELEASE_MAX_BATCH sequences): a CUDA GEMM block releases its dependents
(pdl_release: griddepcontrol.launch_dependents) once its last weight load is issued, and the split-K reduce at entry,
so the next kernel launches during the GEMM's tail instead of after it; the source is compiled once per setting
(nvrtc._Kernel), and the outputs are the same bits. Chains of one GEMM gain at few sequences but lose at many; in the
graphed steps, where a GEMM is followed by a norm or a gate rather than another GEMM, less is left, so the release
is on up to 8 sequences. Releasing from the tensor-core mma kernels (kernels/int4_mma.py) at every batch was mixed
and not kept.
Even with PDL a kernel boundary costs most of a microsecond, so a graphed step of many short kernels spends a
share of its time on boundaries alone however short its kernels are.
The measurements behind each of these choices: kernels/PROBES.md, kernels/pdl.py.
The wait is transitive: a kernel completes only after its own wait returned, so everything earlier in the stream
is complete too. Kernels launched without the attribute (torch's, cuBLAS's) wait for their predecessor as always.
No deadlock: a dependent launches only after all of its predecessor's blocks are resident.

Switch: on wherever it can run (CUDA, sm_90+, a Triton that has gdc_wait, not the interpreter), off with
ONEPASS_PDL=0 or engine.pdl=false. An engine's settings are a LaunchPolicy it puts in force around its launches
(`applied`); kernels read it when launched (for a CUDA graph: at capture).
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from onepass.kernels.triton_compat import tl, triton

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older triton, or none: PDL stays off (enter() is never compiled with PDL=True)
    gdc_launch_dependents = gdc_wait = None

@functools.lru_cache(maxsize=None)
def supported(device_index: int) -> bool:
    """Whether this device, driver and Triton can launch with PDL."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


EARLY_MAX_BATCH = 32   # the largest engine batch whose Triton kernels trigger early (why: kernels/PROBES.md)
EARLY_MAX_BATCH_BY_ARCH = {"qwen35": 128}   # architectures measured otherwise (module docstring)
RELEASE_MAX_BATCH = 8   # the largest engine batch whose CUDA GEMMs release their dependents late (module docstring)


def early_max_batch(arch: str | None = None) -> int:
    """The largest engine batch whose Triton kernels trigger early, for a model of this GGUF architecture."""
    return EARLY_MAX_BATCH_BY_ARCH.get(arch, EARLY_MAX_BATCH)


@dataclass(frozen=True)
class LaunchPolicy:
    """How kernels launch: PDL (None: on unless ONEPASS_PDL=0), the Triton kernels' early trigger, the CUDA GEMMs'
    late release, and whether packed Q4_K GEMMs read ready-made scale words (kernels/int4_wgmma_ws.py). An engine
    holds one and puts it in force around what it launches or captures (`with applied(policy):`); kernels read
    `current()` at launch, so a CUDA graph keeps the policy it was captured under."""

    pdl: bool | None = None
    early: bool = False
    release: bool = False
    ready_scales: bool = True

    @classmethod
    def for_engine(cls, pdl: bool, batch: int, arch: str | None = None, ready_scales: bool = True) -> LaunchPolicy:
        """An engine's: PDL as engine.pdl, the early trigger up to the architecture's measured batch
        (early_max_batch), the late release up to RELEASE_MAX_BATCH."""
        return cls(pdl, batch <= early_max_batch(arch), batch <= RELEASE_MAX_BATCH, ready_scales)

    def enabled(self, device: torch.device | None = None) -> bool:
        want = self.pdl if self.pdl is not None else os.environ.get("ONEPASS_PDL", "1") not in ("0", "false", "off")
        if not want:
            return False
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if device is None or device.type != "cuda":
            return False
        return supported(device.index if device.index is not None else torch.cuda.current_device())

    def mode(self, device: torch.device) -> int:
        """A run's metrics.pdl: 0 PDL off here; 1 on; 2 on, Triton kernels triggering early; 3 on, the CUDA GEMMs'
        late release; 4 on, both."""
        return 1 + int(self.early) + 2 * int(self.release) if self.enabled(device) else 0


_current: contextvars.ContextVar[LaunchPolicy] = contextvars.ContextVar("launch_policy", default=LaunchPolicy())


def current() -> LaunchPolicy:
    """The policy in force: the innermost `applied` one, else the default (PDL as ONEPASS_PDL, nothing early)."""
    return _current.get()


@contextlib.contextmanager
def applied(policy: LaunchPolicy):
    """Put `policy` in force for the block (this thread and context only)."""
    token = _current.set(policy)
    try:
        yield policy
    finally:
        _current.reset(token)


def enabled(device: torch.device | None = None) -> bool:
    return current().enabled(device)


def gemm_release() -> bool:
    return current().release


def mode(device: torch.device) -> int:
    return current().mode(device)


def triton_opts(device: torch.device) -> dict:
    """Extra launch arguments for a Triton kernel that calls `enter(PDL)`: {} when PDL is off."""
    return {"PDL": 2 if current().early else 1, "launch_pdl": True} if enabled(device) else {}


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
