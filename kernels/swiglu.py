"""SwiGLU activation: silu(gate) * up."""
import torch
import torch.nn.functional as F

from onepass.kernels.splitk import SplitSums, split_args, split_sum
from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton
from onepass.kernels.x_image import XImage, check_image, image_args, image_offsets


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu_fused_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2F] (gate = first F columns, up = last F, the fused gate|up projection) -> [..., F]."""
    F_ = gate_up.shape[-1] // 2
    return swiglu_ref(gate_up[..., :F_], gate_up[..., F_:])


# --------------------------------------------------------------------------------------------------
# Triton: grid (rows, column blocks), elementwise in fp32: silu(g) = g / (1 + exp(-g)) as torch computes
# it. Elementwise, so trivially batch invariant; no host sync, no allocation when `out` is given.


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, F, s_gu, s_out, s_split, img_ptr, img_q, BLOCK: tl.constexpr,
                   SPLIT: tl.constexpr = 0, RNE: tl.constexpr = False, IMG_BT: tl.constexpr = 1,
                   IMG_NB: tl.constexpr = 1, HAS_IMG: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # SPLIT > 0: gate|up is a GEMM's unreduced split-K partials (kernels/splitk.py), summed here as its reduce would
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    if SPLIT > 0:
        g = split_sum(gu_ptr + row * s_gu + cols, s_split, mask, SPLIT, out_ptr, RNE).to(tl.float32)
        u = split_sum(gu_ptr + row * s_gu + F + cols, s_split, mask, SPLIT, out_ptr, RNE).to(tl.float32)
    else:
        g = tl.load(gu_ptr + row * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_out + cols, y, mask=mask)
    if HAS_IMG:     # the down projection's staged x too (kernels/x_image.py)
        tl.store(img_ptr + image_offsets(row, cols, img_q, IMG_BT, IMG_NB), y, mask=mask)


def swiglu_triton(gate_up: torch.Tensor | SplitSums, out: torch.Tensor | None = None,
                  image: XImage | None = None) -> torch.Tensor:
    """gate_up: [R, 2F] (last dim contiguous, any row stride) -> silu(gate) * up, [R, F] in out's dtype
    (default gate_up's). gate_up may be a GEMM's unreduced split-K partials (kernels/splitk.py): summed in the
    kernel, the same bits as reducing them first. image: the output stored into it too (kernels/x_image.py: the
    down projection's staged x)."""
    sums = gate_up if isinstance(gate_up, SplitSums) else None
    if sums is not None:
        if out is not None and out.dtype != sums.dtype:
            gate_up, sums = sums.finish(), None        # rounded to another dtype than out's: reduce first
        else:
            gate_up = sums.ws[0]
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or (gate_up.stride(1) != 1 and gate_up.shape[1] > 1):
        raise ValueError(f"gate_up must be [R, 2F] with a contiguous last dim, got {tuple(gate_up.shape)}")
    R, F_ = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((R, F_), dtype=sums.dtype if sums is not None else gate_up.dtype, device=gate_up.device)
    if out.shape != (R, F_) or (out.stride(1) != 1 and F_ > 1):
        raise ValueError(f"out must be [{R}, {F_}] with a contiguous last dim, got {tuple(out.shape)}")
    if image is not None:
        check_image(image, R, F_, out.dtype, "swiglu")
    if R == 0 or F_ == 0:
        return out
    BLOCK = min(256 if sums is not None else 1024, triton.next_power_of_2(F_))   # partials: more programs to read them
    s_split, split, rne = split_args(sums)
    img, img_q, img_bt, img_nb, has_img = image_args(image, out)
    _swiglu_kernel[(R, triton.cdiv(F_, BLOCK))](gate_up, out, F_, gate_up.stride(0), out.stride(0), s_split, img, img_q,
                                                 BLOCK=BLOCK, SPLIT=split, RNE=rne, IMG_BT=img_bt, IMG_NB=img_nb,
                                                 HAS_IMG=has_img,
                                                 num_warps=4 if BLOCK >= 512 else 1, **pdl.triton_opts(gate_up.device))
    return out
