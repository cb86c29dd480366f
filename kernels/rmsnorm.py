"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, accumulated in fp32."""
import torch

from onepass.kernels.splitk import SplitSums, split_args, split_sum
from onepass.kernels.workspace import SplitKWorkspace
from onepass.kernels.x_image import XImage, check_image, image_args, image_offsets
from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: new_residual = residual + x (rounded to the residual's dtype, i.e.
    exactly torch's `residual + x`), normed = rms_norm(new_residual) * w in x's dtype. Pure: returns
    (normed, new_residual); the Triton version writes new_residual into `residual` in place."""
    new_res = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm_ref(new_res, weight, eps).to(x.dtype), new_res


# --------------------------------------------------------------------------------------------------
# Triton. Rows of up to ROW_MAX_D columns: one program per row, the whole row in registers. Wider rows: one program
# per CHUNK columns of a row (below). fp32 math; a row's arithmetic depends on D alone, never on how many rows there
# are, so results are bitwise batch invariant. No host sync; nothing is allocated when `out` is given (CUDA-graph
# safe; the chunked form's scratch is one buffer per device, reused by every launch).


@triton.jit
def _row_input(x_ptr, res_ptr, i0, i1, offs, mask, sx0, sx1, sr0, sr1, sxs,
               HAS_RES: tl.constexpr, SPLIT: tl.constexpr, RNE: tl.constexpr):
    """Columns offs of row (i0, i1) in fp32: x (SPLIT > 0: a GEMM's unreduced split-K partials, SPLIT of them sxs
    apart, summed as its reduce would have: kernels/splitk.py), plus the residual, which is updated in place."""
    if SPLIT > 0:
        x = split_sum(x_ptr + i0 * sx0 + i1 * sx1 + offs, sxs, mask, SPLIT, res_ptr, RNE)
    else:
        x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + offs, mask=mask, other=0.0)
    if HAS_RES:
        r_ptrs = res_ptr + i0 * sr0 + i1 * sr1 + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        h = (r.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)  # == torch's residual + x
        tl.store(r_ptrs, h, mask=mask)
        return h.to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, D, n_inner, eps,
                     sx0, sx1, sr0, sr1, so0, so1, sxs, img_ptr, img_q,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr = 0, RNE: tl.constexpr = False,
                     IMG_BT: tl.constexpr = 1, IMG_NB: tl.constexpr = 1, HAS_IMG: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # rows are (i0, i1) of a [n0, n_inner, D] view; each operand has its own two leading strides
    row = tl.program_id(0).to(tl.int64)
    i0 = row // n_inner
    i1 = row % n_inner
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    xf = _row_input(x_ptr, res_ptr, i0, i1, offs, mask, sx0, sx1, sr0, sr1, sxs, HAS_RES, SPLIT, RNE)
    ms = tl.sum(xf * xf, axis=0) / D
    rstd = 1.0 / tl.sqrt(ms + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * rstd) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + i0 * so0 + i1 * so1 + offs, y, mask=mask)
    if HAS_IMG:     # the next GEMM's staged x too (kernels/x_image.py; rows are i0 then)
        tl.store(img_ptr + image_offsets(i0, offs, img_q, IMG_BT, IMG_NB), y, mask=mask)


@triton.jit
def _rms_norm_chunk_kernel(x_ptr, res_ptr, w_ptr, out_ptr, ss_ptr, cnt_ptr, D, n_inner, eps,
                           sx0, sx1, sr0, sr1, so0, so1, sxs, img_ptr, img_q,
                           HAS_RES: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, NC_P2: tl.constexpr,
                           ROW_BLOCK: tl.constexpr,
                           SPLIT: tl.constexpr = 0, RNE: tl.constexpr = False, IMG_BT: tl.constexpr = 1,
                           IMG_NB: tl.constexpr = 1, HAS_IMG: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # program (row, c): columns c*CHUNK.. of the row -- its split-K partials summed, the residual added and stored --
    # and their sum of squares into ss[row, c]. The row's last program to arrive (a per-row ticket, acq_rel: every
    # other chunk's residual and ss are visible to it) adds the NC sums in one fixed tree, normalizes the whole row
    # and leaves the ticket at zero for the next launch. Why: the 27B's 5120-column rows with 12-23 split-K partials
    # are ~0.25-0.5 MB a row; one program per row streamed them through one SM.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i0 = row // n_inner
    i1 = row % n_inner
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < D
    xf = _row_input(x_ptr, res_ptr, i0, i1, offs, mask, sx0, sx1, sr0, sr1, sxs, HAS_RES, SPLIT, RNE)
    tl.store(ss_ptr + row * NC + c, tl.sum(xf * xf, axis=0))
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
    if ticket == NC - 1:
        tl.store(cnt_ptr + row, 0)
        parts = tl.arange(0, NC_P2)
        ss = tl.load(ss_ptr + row * NC + parts, mask=parts < NC, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + eps)
        if HAS_RES:
            src = res_ptr + i0 * sr0 + i1 * sr1      # the row's new residual, every chunk's
        else:
            src = x_ptr + i0 * sx0 + i1 * sx1
        o = tl.arange(0, ROW_BLOCK)             # the whole row in one load (a loop of chunks ran one L2 trip each)
        m = o < D
        v = tl.load(src + o, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
        y = ((v * rstd) * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + i0 * so0 + i1 * so1 + o, y, mask=m)
        if HAS_IMG:
            tl.store(img_ptr + image_offsets(i0, o, img_q, IMG_BT, IMG_NB), y, mask=m)


def _rows_view(t: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """(n0, n_inner, stride0, stride1) describing t's rows as a 2-level grid; t's last dim must be unit
    stride. Handles [D], [R, D] and [A, B, D] with any leading strides (e.g. heads of a fused qkv row);
    more leading dims must merge into two without a copy."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride {t.stride(-1)})")
    if t.dim() == 1:
        return 1, 1, 0, 0
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() > 3:
        try:
            t = t.view(-1, t.shape[-2], t.shape[-1])
        except RuntimeError as e:
            raise ValueError(f"{name}: leading dims {tuple(t.shape[:-2])} cannot be merged without a copy") from e
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 2 if block <= 1024 else 4 if block <= 4096 else 8 if block <= 8192 else 16


# Rows wider than ROW_MAX_D go in chunks of CHUNK columns (_rms_norm_chunk_kernel), whatever the row count (the
# bits follow D alone): one program per row would stream a wide row's partials through one SM. (why these widths:
# kernels/PROBES.md, kernels/rmsnorm.py: ROW_MAX_D and CHUNK)
# A one-program row reads all S partials of its row; with few rows and more than SPLIT_ROW_BYTES of partials a row, the
# GEMM's own reduce (spread over many programs) runs first instead. (why: kernels/PROBES.md, kernels/rmsnorm.py:
# SPLIT_ROW_BYTES)
ROW_MAX_D = 4096
CHUNK = 512
SPLIT_ROW_BYTES = 64 * 1024
SPLIT_MIN_ROWS = 16
_SS = SplitKWorkspace()                                  # ss[row, chunk]
_TICKETS = SplitKWorkspace(torch.int32, zeroed=True)    # per row; the kernel leaves them zero
MIN_ROWS = 8192                                         # scratch rows reserved at once (prefill steps included)


def _launch_rms_norm(x, residual, w, eps, out, image: XImage | None = None):
    sums = x if isinstance(x, SplitSums) else None
    D = (sums.shape if sums is not None else x.shape)[-1]
    chunked = D > ROW_MAX_D
    if sums is not None:
        wide = not chunked and sums.shape[0] < SPLIT_MIN_ROWS and sums.splits * sums.shape[1] * 4 > SPLIT_ROW_BYTES
        if residual is None or sums.dtype != residual.dtype or wide:
            x, sums = sums.finish(), None    # the GEMM's reduce first, then the plain path
        else:
            x = sums.ws[0]
    if w.shape != (D,) or not w.is_contiguous():
        raise ValueError(f"weight must be contiguous [{D}], got {tuple(w.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=sums.dtype if sums is not None else x.dtype, device=x.device)
    if out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    n0, n1, sx0, sx1 = _rows_view(x, "x")
    _, _, so0, so1 = _rows_view(out, "out")
    has_res = residual is not None
    if has_res:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        _, _, sr0, sr1 = _rows_view(residual, "residual")
    else:
        residual, sr0, sr1 = x, 0, 0  # unused (HAS_RES=False)
    rows = n0 * n1
    if image is not None:
        if out.dim() != 2:
            raise ValueError(f"an image is of [M, K] rows; the norm's output is {tuple(out.shape)}")
        check_image(image, rows, D, out.dtype, "rms_norm")
    if rows == 0:
        return out
    s_split, split, rne = split_args(sums)
    img, img_q, img_bt, img_nb, has_img = image_args(image, out)
    args = (D, n1, float(eps), sx0, sx1, sr0, sr1, so0, so1, s_split, img, img_q)
    opts = dict(HAS_RES=has_res, SPLIT=split, RNE=rne, IMG_BT=img_bt, IMG_NB=img_nb, HAS_IMG=has_img)
    if chunked:
        nc = triton.cdiv(D, CHUNK)
        ss = _SS.get(x.device, max(rows, MIN_ROWS) * nc)
        tickets = _TICKETS.get(x.device, max(rows, MIN_ROWS))
        _rms_norm_chunk_kernel[(rows, nc)](x, residual, w, out, ss, tickets, *args, CHUNK=CHUNK, NC=nc,
                                           NC_P2=triton.next_power_of_2(nc), ROW_BLOCK=triton.next_power_of_2(D),
                                           num_warps=_num_warps(triton.next_power_of_2(D)), **opts,
                                           **pdl.triton_opts(x.device))
    else:
        BLOCK = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows,)](x, residual, w, out, *args, BLOCK=BLOCK, num_warps=_num_warps(BLOCK), **opts,
                                  **pdl.triton_opts(x.device))
    return out


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                    image: XImage | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x ([D], [R, D], [R, H, D] with any leading strides, e.g. per-head
    q/k norm where rows = heads). Output in out's dtype (default x's). image: [R, D] rows only; the output
    is also stored into it (kernels/x_image.py: the next ws GEMM's staged x)."""
    return _launch_rms_norm(x, None, w, eps, out, image)


def add_rms_norm_triton(x: torch.Tensor | SplitSums, residual: torch.Tensor, w: torch.Tensor, eps: float,
                        out: torch.Tensor | None = None,
                        image: XImage | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (in the residual's dtype), then normed = rms_norm(residual) * w.
    Returns (normed, residual). `out` must not alias x or residual. x may be a GEMM's unreduced split-K partials
    (kernels/splitk.py): they are summed in the kernel, the same bits as reducing them first. image: as
    rms_norm_triton's."""
    normed = _launch_rms_norm(x, residual, w, eps, out, image)
    return normed, residual
