"""Split-K partial sums handed to the next kernel instead of reduced by a launch of their own.

A GEMM that runs its K range as S splits writes S fp32 partials [S, M, N] and then launches a reduce that adds
them in split order, ((p0 + p1) + p2) + ..., and rounds once to the output dtype. Called with ``defer=True``
(kernels/gemm.linear, kernels/int4_gemm.w4a16_linear, the CUDA kernels through int4_cuda.run_packed, the int4
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

from onepass.kernels.gemm import cast_out, splitk_reduce
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
