"""Split-K partial sums handed to the next kernel instead of reduced by a launch of their own.

A GEMM that runs its K range as S splits writes S fp32 partials [S, M, N] and then launches a reduce that adds
them in split order, ((p0 + p1) + p2) + ..., and rounds once to the output dtype. Called with ``defer=True``
(kernels/gemm.linear, kernels/int4_gemm.w4a16_linear, the CUDA kernels through nvrtc.run_packed, the int4
dispatch) it returns the partials as a SplitSums instead, and the kernel that consumes the output -- the
residual add + RMSNorm (kernels/rmsnorm.py), SwiGLU (kernels/swiglu.py) -- loads each element's S partials, adds
them in the same order and rounds the same way (``split_sum``): it sees exactly the value the reduce would have
written, and the step saves the reduce's launch and the round trip of its output through memory.

The partials are views of the GEMM's shared split-K workspace: the consumer must run before the next GEMM that
uses that workspace (the fused decoders consume them before their next GEMM). A fused projection whose parts go to
different kernels hands each its columns (``cols``): the hybrid's q|k|v|z input projection feeds the conv ring
(kernels/gdn.py) its q|k|v partials and the gated norm its z partials.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton


@dataclass(frozen=True)
class SplitSums:
    ws: torch.Tensor          # [S, M, N] fp32, unit column stride (contiguous, or the column slice `cols` makes)
    out: torch.Tensor         # [M, N]: where the GEMM's own reduce would have written (its dtype, the rounding's)
    rne: bool = False         # round to nearest even by hand (Triton's interpreter, bf16), as that reduce does

    @property
    def shape(self) -> torch.Size:
        return self.ws.shape[1:]

    @property
    def splits(self) -> int:
        return self.ws.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    def reduce(self) -> torch.Tensor:
        """The reduce's result in torch (the definition, for tests): the splits added in order in fp32, rounded
        once (torch's casts round to nearest even, as the GPU's and the hand-rounded interpreter's do)."""
        acc = self.ws[0].clone()
        for s in range(1, self.splits):
            acc += self.ws[s]
        return acc.to(self.dtype)

    def cols(self, c0: int, c1: int) -> "SplitSums":
        """The partials of output columns c0 .. c1 - 1 (views: row stride and split stride stay the GEMM's)."""
        return SplitSums(self.ws[:, :, c0:c1], self.out[:, c0:c1], self.rne)

    def finish(self) -> torch.Tensor:
        """The deferred reduce after all, into `out`: for a consumer that cannot, or would not gain to, add the
        partials itself."""
        return splitk_reduce(self.ws, self.out, self.splits, self.rne, strides=(self.ws.stride(0), self.ws.stride(1)))


def split_args(sums: SplitSums | None) -> tuple[int, int, bool]:
    """A consumer kernel's launch values for its input: (split stride, SPLIT, RNE) of unreduced partials, or
    (0, 0, False) for a finished tensor (SPLIT 0: a plain load)."""
    return (0, 0, False) if sums is None else (sums.ws.stride(0), sums.splits, bool(sums.rne))


@triton.jit
def split_sum(p, stride_s, mask, SPLIT: tl.constexpr, like_ptr, RNE: tl.constexpr):
    """The value at p of partials laid stride_s apart, SPLIT of them: added in split order in fp32, rounded once to
    like_ptr's dtype (RNE: by hand, for the interpreter) -- the reduce kernels' own arithmetic."""
    acc = tl.load(p, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p + s * stride_s, mask=mask, other=0.0)
    return cast_out(acc, like_ptr, RNE)


__all__ = ["SplitSums", "split_args", "split_sum"]


@triton.jit
def cast_out(acc, y_ptr, RNE_BF16: tl.constexpr):
    """acc (fp32) -> y's dtype. RNE_BF16 (interpreter, bf16 out only): round to nearest even by hand,
    because the interpreter's fp32 -> bf16 cast truncates; compiled casts are already RNE."""
    if RNE_BF16:
        bits = acc.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(y_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["M"])
def splitk_reduce_kernel(ws_ptr, y_ptr, M, N, stride_ws, stride_wm, stride_ym, stride_yn,
                         SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         RNE_BF16: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # y = ((p0 + p1) + p2) + ... in fp32, then one rounding: a fixed order per element. Shared with the
    # int4 kernels (kernels/int4_gemm.py).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    p = ws_ptr + offs_m.to(tl.int64)[:, None] * stride_wm + offs_n[None, :]
    acc = tl.load(p, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p + s * stride_ws, mask=mask, other=0.0)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, cast_out(acc, y_ptr, RNE_BF16), mask=mask)


def splitk_reduce(ws: torch.Tensor, y: torch.Tensor, split: int, rne: bool = False,
                  strides: tuple[int, int] | None = None) -> torch.Tensor:
    """y [rows, N] (any strides) = the `split` fp32 partials in ws (split-major, each [rows, N] contiguous, or laid
    out by strides = (split stride, row stride) with unit column stride) added in split order and rounded once (rne:
    by hand, the interpreter's bf16); the launch every split-K GEMM ends with."""
    rows, N = y.shape
    s_split, s_row = strides or (rows * N, N)
    rbm, rbn = min(16, 1 << max(0, rows - 1).bit_length()), 256
    splitk_reduce_kernel[(-(-rows // rbm), -(-N // rbn))](
        ws, y, rows, N, s_split, s_row, y.stride(0), y.stride(1),
        SPLIT_K=split, BLOCK_M=rbm, BLOCK_N=rbn, RNE_BF16=rne, num_warps=4, **pdl.triton_opts(ws.device))
    return y


def run_splits(x: torch.Tensor, out: torch.Tensor, split: int, chunk: int, workspace, launch, defer: bool = False,
               rne: bool = False):
    """A split-K GEMM over x's rows, `chunk` rows at a time: launch(xs, ws, rows) writes the chunk's `split` fp32
    partials into ws (from workspace(device, numel)), and splitk_reduce adds them into out's rows. With defer and one
    chunk covering every row, the partials are handed back unreduced instead (kernels/splitk.py)."""
    M, N = out.shape
    ws = workspace(x.device, split * chunk * N)
    for r0 in range(0, M, chunk):
        rows = min(chunk, M - r0)
        launch(x[r0:r0 + rows], ws, rows)
        if defer and rows == M:
            return SplitSums(ws[:split * M * N].view(split, M, N), out, rne=rne)
        splitk_reduce(ws, out[r0:r0 + rows], split, rne)
    return out
