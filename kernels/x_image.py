"""A ws GEMM's input written by the kernel before it, straight into the GEMM's staged image.

kernels/int4_wgmma_ws.py bulk-copies x into its ring as it lies, so x must first be put in the order and swizzle the
wgmma reads (the image: per (batch tile, quad of K), each row's weights' k pairs (j, j + 4), the 4 x 4 transpose of a
unit's pieces, the 128-byte swizzle). Its staging launch (wg_stage_x) does that before every GEMM; a step's chain pays
that launch 193 times at B = 32 on the 27B hybrid. Here the kernel that makes x (the residual add + RMSNorm, SwiGLU,
the hybrid's gated norm and sigmoid gate) stores each element once more, at its place in the image, and the GEMM skips
its staging launch: the same bytes, the same bits, one launch less per projection.

An image covers x [M, K] for a GEMM of batch tile BT: M a multiple of BT and K of 128 (whole tiles and quads, so no
element of the image is padding the staging launch would have zeroed). `XImage.offsets` (torch) and `image_offsets`
(Triton) give element (m, k)'s place in 16-bit units; both follow wg_stage_x (tests/test_x_image.py compares them with
its emulated output).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepass.kernels.triton_compat import tl, triton

QUAD = 128          # K per quad: four 32-weight groups


@dataclass(frozen=True)
class XImage:
    """Where the GEMM on x [M, K] (batch tile BT) reads its staged x: `buf`, 16-bit elements of x's dtype (a view of
    the ws kernel's staging workspace), at least `numel` of them."""
    buf: torch.Tensor
    M: int
    K: int
    BT: int

    def __post_init__(self):
        if self.M % self.BT or self.K % QUAD:
            raise ValueError(f"XImage: x [{self.M}, {self.K}] is not whole batch tiles of {self.BT} and quads of "
                             f"{QUAD}")
        if self.buf.dim() != 1 or self.buf.element_size() != 2 or self.buf.numel() < self.numel:
            raise ValueError(f"XImage: buf must be a 1-D 16-bit tensor of >= {self.numel} elements")

    @property
    def NB(self) -> int:
        return -(-self.BT // 8)

    @property
    def Q(self) -> int:
        return self.K // QUAD

    @property
    def numel(self) -> int:
        return (self.M // self.BT) * self.Q * 1024 * self.NB

    def offsets(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[M, K] int64: element (m, k)'s index in buf."""
        m = torch.arange(self.M, device=device).view(-1, 1)
        k = torch.arange(self.K, device=device).view(1, -1)
        return _offsets(m, k, self.BT, self.NB, self.Q)

    def write_ref(self, x: torch.Tensor) -> None:
        """The image of x [M, K] into buf (torch; what the producer kernels store)."""
        if tuple(x.shape) != (self.M, self.K):
            raise ValueError(f"XImage.write_ref: x {tuple(x.shape)}, the image is of [{self.M}, {self.K}]")
        self.buf[self.offsets(x.device).flatten()] = x.reshape(-1).to(self.buf.dtype)


def _offsets(m, k, BT, NB, Q):
    """Element (m, k)'s index (16-bit units) in the image: tile (m // BT, k // 128) of 1024 NB elements; in it row
    b = m % BT, unit word p = (k % 32) // 8 of group q = (k // 32) % 4, value j = k % 8 going to piece j % 4 as the
    low (j < 4) or high half of its word q; the piece's 16-byte chunk 4 (p & 1) + j % 4 swizzled by b & 7, in the
    64-k atom p >> 1. int4_wgmma's PIECE (SWZ 1) over 2."""
    b = m % BT
    p = (k % 32) // 8
    j = k % 8
    chunk = (4 * (p % 2) + j % 4) ^ (b % 8)
    tile = (m // BT) * Q + k // QUAD
    return tile * (1024 * NB) + (p // 2) * (NB * 512) + b * 64 + chunk * 8 + 2 * ((k // 32) % 4) + j // 4


@triton.jit
def image_offsets(m, k, Q, BT: tl.constexpr, NB: tl.constexpr):
    """_offsets in Triton (m, k int tensors broadcast together; the result int64)."""
    m = m.to(tl.int64)
    b = m % BT
    p = (k % 32) // 8
    j = k % 8
    chunk = ((4 * (p % 2) + j % 4) ^ (b % 8)).to(tl.int64)
    tile = (m // BT) * Q + k // 128
    return tile * (1024 * NB) + (p // 2) * (NB * 512) + b * 64 + chunk * 8 + 2 * ((k // 32) % 4) + j // 4


def image_args(image: XImage | None, x: torch.Tensor | None = None) -> tuple:
    """(buffer, Q, BT, NB, HAS_IMAGE) for a producer kernel's launch; a dummy pointer and zeros without an image."""
    if image is None:
        return (x, 0, 1, 1, False)
    return (image.buf, image.Q, image.BT, image.NB, True)


def check_image(image: XImage, rows: int, cols: int, dtype: torch.dtype, name: str) -> None:
    """A producer's image must be of its output's shape and dtype."""
    if (image.M, image.K) != (rows, cols) or image.buf.dtype != dtype:
        raise ValueError(f"{name}: the image is of [{image.M}, {image.K}] {image.buf.dtype}, the output "
                         f"[{rows}, {cols}] {dtype}")


__all__ = ["XImage", "image_offsets", "image_args", "check_image", "QUAD"]
