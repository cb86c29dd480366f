"""A projection: one GEMM (or a few) over the rows of weights that share an input, written into one buffer, with the
two things a fused decoder's projections do beyond `x @ W^T`: a split-K GEMM may hand its partials unreduced to the
kernel that consumes its output (kernels/splitk.py), and the kernel that makes x may also write x's staged image for
the GEMM (kernels/x_image.py), which then skips its staging launch. Both fused decoders build every projection
of a layer as one of these, so the layer reads as the math:

    h = norm(res, image=qkv.image(h));  qkv(h, out)
"""
from __future__ import annotations

import contextlib

import torch

from onepass.kernels.backend import StepKernels
from onepass.kernels.errors import GGUFError
from onepass.kernels.quant_pack import PackedWeight, unpack_ref
from onepass.kernels.splitk import SplitSums


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)  # PackedWeight (kernels/quant_pack.py)


def _fusable(a, b) -> bool:
    """Whether two projection weights can share one GEMM: dense of one dtype, or packed of one format and K."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape[1] == b.shape[1])
    return type(a) is type(b) and getattr(a, "fmt", None) == getattr(b, "fmt", None) and a.shape[1] == b.shape[1]


def _fuse(parts: list):
    """Row concatenation of projection weights (torch tensors, or PackedWeights of one format)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts).contiguous()
    from onepass.kernels.quant_pack import cat_rows

    try:
        return cat_rows(parts)
    except GGUFError:
        return None


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for Projection's concurrent parts (CUDA-graph capture follows the fork)."""
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return s


class Projection:
    """One GEMM over several weights' rows, writing one [R, sum(N)] buffer. Adjacent weights that can be
    fused are (dense ones always; packed ones of one format); the rest get a GEMM each into column slices
    of the buffer (e.g. packed q|k|v|z beside the tiny dense beta|alpha rows).

    On a GPU the small dense slices of a packed projection run on a side stream beside the packed GEMM (forked
    after x is written, joined before the buffer is read): in the step's chain a launch of their own costs more
    than their bytes (kernels/PROBES.md, engine/projection.py). Only dense parts beside a packed main part go
    there, so the side stream's GEMMs (kernels/gemm.py's split-K workspace) never meet another dense GEMM."""

    concurrent = True   # class switch (probes compare with it off)

    def __init__(self, parts: list, kernels: StepKernels, dequant_mixed: torch.dtype | None = None):
        """parts: the weights, in the output's column order. dequant_mixed: weights that cannot share one GEMM
        (packed of different formats, or packed beside dense) are dequantized to this dtype and fused, instead of
        run as separate GEMMs."""
        self.k = kernels
        if dequant_mixed is not None and not all(_fusable(parts[0], p) for p in parts[1:]):
            parts = [torch.cat([unpack_ref(p).to(dequant_mixed) if isinstance(p, PackedWeight) else p
                                for p in parts]).contiguous()]
        self.width = sum(int(p.shape[0]) for p in parts)
        groups = [[parts[0]]]
        for p in parts[1:]:
            if _fusable(groups[-1][-1], p):
                groups[-1].append(p)
            else:
                groups.append([p])
        self.weights = []
        for g in groups:
            fused = _fuse(g)
            self.weights.extend([fused] if fused is not None else g)
        cols, col = [], 0
        for w in self.weights:
            cols.append((col, col + int(w.shape[0])))
            col += int(w.shape[0])
        self.cols = cols
        big = max(range(len(self.weights)), key=lambda i: _nbytes(self.weights[i]))
        side = [i for i in range(len(self.weights)) if i != big]
        # a side stream only for dense parts beside a packed main GEMM (see the class docstring)
        self.main, self.side = (big, side) if side and not isinstance(self.weights[big], torch.Tensor) and all(
            isinstance(self.weights[i], torch.Tensor) for i in side) else (None, [])

    def image(self, x: torch.Tensor):
        """Where the kernel making x should also write it (k.x_image: the only or main GEMM's staged x,
        kernels/x_image.py), or None. Asked just before that kernel runs, and passed to the call as x_image."""
        w = self.weights[0] if len(self.weights) == 1 else None if self.main is None else self.weights[self.main]
        return None if w is None else self.k.x_image(x, w)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, defer: bool = False, x_image=None):
        """x @ W^T into out; defer: the only GEMM, or the main one beside dense side parts, may hand back its
        split-K partials unreduced (kernels/splitk.py) for the next kernels to add. A main GEMM's partials cover
        its columns only, self.cols[self.main]; the side parts are written into out as always. x_image: image(x),
        written by the kernel that made x (the only or main GEMM then skips its staging launch)."""
        k = self.k
        if len(self.weights) == 1:
            return k.linear(x, self.weights[0], out=out, defer=defer, x_image=x_image)
        if self.main is not None:
            concurrent = self.concurrent and x.is_cuda
            if concurrent:
                main = torch.cuda.current_stream(x.device)
                side = _side_stream(x.device)
                side.wait_stream(main)            # x is written
            with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
                for i in self.side:
                    c0, c1 = self.cols[i]
                    k.linear(x, self.weights[i], out=out[:, c0:c1])
            c0, c1 = self.cols[self.main]
            y = k.linear(x, self.weights[self.main], out=out[:, c0:c1], defer=defer, x_image=x_image)
            if concurrent:
                main.wait_stream(side)            # every slice is written before the buffer is read
            return y if isinstance(y, SplitSums) else out
        for w, (c0, c1) in zip(self.weights, self.cols):  # unfusable parts: one GEMM each, into column slices
            k.linear(x, w, out=out[:, c0:c1])
        return out

    def main_cols(self) -> tuple[int, int] | None:
        """The columns a deferred call's partials cover (None: no main GEMM beside side parts)."""
        return None if self.main is None else self.cols[self.main]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(w) for w in self.weights)


