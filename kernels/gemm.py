"""Projection GEMM y[M, N] = x[M, K] @ w[N, K]^T (bf16/fp16 in, fp32 accumulate, x's dtype out),
batch-invariant: row m of y is bitwise the same for the same x[m] whatever M is and whatever the
other rows hold, so B decode streams are bit-exact with a single-stream run.

Why it is batch-invariant
  Every output element is reduced over K in one fixed order that depends on (N, K) only:
    * BLOCK_K, BLOCK_N and the split-K count are chosen from (N, K) alone (``_shape_rule``);
    * one program walks its K blocks in ascending order, accumulating ``acc = dot(x_blk, w_blk^T, acc)``
      in fp32 from zero;
    * with split-K, split s owns the contiguous K blocks [s*kbs, (s+1)*kbs) and writes an fp32 partial;
      a second kernel sums the partials in split order 0, 1, ..., S-1 and rounds once to x's dtype;
    * no atomics; rows past M of a tile load zeros and columns past N re-read valid rows (index
      modulo N); neither is stored, and tensor-core rows are independent, so they cannot reach a stored row.
  Only BLOCK_M (and with it num_warps / num_stages, which do not touch the K order) depends on M:
  64 for M <= 64 (4 warps), 128 above (8 warps). Both issue the same Hopper instruction per 64 rows:
  compiled offline for sm_90 (triton 3.9), each K block of 64 is four chained
  wgmma.mma_async m64n{BLOCK_N}k16.f32.bf16.bf16 into the same fp32 accumulator, at either BLOCK_M,
  so rows should be bitwise equal across the switch. (BLOCK_M 16/32 would lower to mma.sync instead;
  the rule never picks them.) Outside the tensor cores there is no multiply (the epilogue is a cast,
  the split-K reduction plain adds), so FMA contraction settings cannot change the bits.
  That the two BLOCK_M give equal bits is still a hardware fact this file cannot prove on a CPU:
  tests/test_kernels_gemm.py has a GPU test that compares BLOCK_M 64 vs 128 bitwise. If it fails, pin one
  BLOCK_M: ``onepass.kernels.gemm.PIN_BLOCK_M = 64`` (or set the env var ``ONEPASS_GEMM_BLOCK_M=64`` before
  import). 64 costs little at large M and nothing at decode sizes.

Tile rule (``_shape_rule``; fixed table-free rule, no run-time autotuning, so every run and every
process picks the same configuration)
  BLOCK_K = 64 (16/32 only for K < 64).
  BLOCK_N = 128 when N >= 128 * 2 * NUM_SMS (LM heads: >= 2 waves of 128-wide tiles), else 64
            (fewer columns per tile -> more tiles to spread the weight stream over the SMs);
            capped at next_pow2(N) (>= 16) for small N.
  SPLIT_K   when cdiv(N, BLOCK_N) < NUM_SMS (narrow N, e.g. 2048 x 8192 has 32 tiles for 132 SMs):
            the smallest S in 1..8 that divides the K-block count, keeps >= 4 K blocks per split and
            gives cdiv(N, BLOCK_N) * S >= NUM_SMS; the largest such S if none reaches NUM_SMS.
  NUM_SMS is the constant 132 (H200), not read from the device, so the rule (and thus the bits) is
  the same on every machine.
  Split-K launches process at most SPLITK_M_CHUNK rows at a time, which bounds the fp32 workspace
  (S * chunk * N * 4 bytes, <= 32 MiB for the listed shapes); rows are independent, so chunking
  changes nothing numerically.

CUDA graphs: with ``out`` given nothing is allocated and nothing is read back to the host, provided
the split-K workspace is already large enough. It is one per-device buffer that only grows; any
eager call of the same or a larger shape (the usual warm-up before capture, which also compiles the
kernels) or ``reserve_workspace`` sizes it. A buffer replaced by a bigger one is kept alive, so a
captured graph never points at freed memory. The workspace assumes one stream uses it at a time.

CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported; slow:
tests only). There, the dot operands are upcast to fp32 first, because the interpreter (triton 3.9)
multiplies bf16 operands as their raw uint16 storage.
"""
from __future__ import annotations

import functools

import torch

from onepass.kernels import pdl
from onepass.kernels.splitk import run_splits
from onepass.kernels.triton_compat import tl, triton
from onepass.kernels.workspace import SplitKWorkspace, block_m_from_env

NUM_SMS = 132                 # H200; a constant so the config rule is machine-independent
BLOCK_K_DEFAULT = 64
MAX_SPLIT_K = 8
MIN_K_BLOCKS_PER_SPLIT = 4
WIDE_N = 128 * 2 * NUM_SMS    # N from which BLOCK_N = 128 (33792)
SPLITK_M_CHUNK = 512          # rows per split-K launch (bounds the workspace)
GROUP_M = 8                   # L2 swizzle: consecutive programs share weight tiles across M tiles
BLOCK_M_CHOICES = (16, 32, 64, 128)
SMALL_M = 64                  # M <= SMALL_M -> BLOCK_M 64, else 128



# Set to one of BLOCK_M_CHOICES to use that BLOCK_M for every M (the fallback if the GPU test finds
# rows differing across BLOCK_M). None: the M-dependent rule (64 for M <= 64, else 128).
PIN_BLOCK_M: int | None = block_m_from_env("ONEPASS_GEMM_BLOCK_M", BLOCK_M_CHOICES)

_DTYPES = (torch.bfloat16, torch.float16)


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition: x [M, K] @ w [N, K]^T in fp32, rounded once to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# kernels

# M is not specialized (Triton would otherwise compile M == 1 and M % 16 == 0 as separate variants):
# fewer kernel variants across batch sizes, fewer things for the invariance test to cover.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_ys,
                 KB_PER_SPLIT,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, W_EVICT: tl.constexpr,
                 UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)  # kernels/pdl.py
    # program -> (split, M tile, N tile); split outermost, GROUP_M swizzle inside a split
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    pid_s = pid // tiles
    t = pid % tiles
    per_group = GROUP_M * num_pid_n
    first_m = (t // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_m
    pid_n = (t % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N re-read valid rows (no mask on the weight loads); rows past M load zeros (masked: no memory
    # request), since re-reading a real row would put every padded lane on the same line and serialize the x loads
    # (kernels/PROBES.md, kernels/gemm.py). Neither is stored.
    row_ok = offs_m < M
    rows_x = tl.where(row_ok, offs_m, 0).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)

    kb_lo = pid_s * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    offs_k = kb_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):   # ascending K blocks: the one reduction order
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, eviction_policy=W_EVICT)
        else:
            k_ok = (kb * BLOCK_K + tl.arange(0, BLOCK_K)) < K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy=W_EVICT)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    y_ptrs = (y_ptr + pid_s.to(tl.int64) * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym
              + offs_n[None, :] * stride_yn)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# whether triton.jit produced interpreter objects (TRITON_INTERPRET=1 when triton was imported)
_INTERPRETED = type(_gemm_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------------------------------
# configuration

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# (N, K) -> (BLOCK_N, BLOCK_K, SPLIT_K), timed per shape (how: kernels/PROBES.md, kernels/gemm.py: MEASURED). The
# shapes are the projections of Llama-3.2-1B, Qwen3-1.7B and Qwen3-4B; any other shape takes the rule below. A table
# keyed by (N, K) alone keeps every row's reduction order independent of M.
MEASURED = {
    (3072, 2048): (64, 64, 2),
    (2048, 2048): (64, 64, 4),
    (16384, 2048): (128, 64, 1),
    (2048, 8192): (64, 64, 4),
    (128256, 2048): (128, 64, 1),
    (4096, 2048): (64, 64, 2),
    (12288, 2048): (128, 64, 1),
    (2048, 6144): (64, 64, 4),
    (151936, 2048): (128, 64, 1),
    (6144, 2560): (64, 128, 1),
    (2560, 4096): (64, 64, 2),
    (19456, 2560): (64, 64, 1),
    (2560, 9728): (128, 128, 4),
    (151936, 2560): (128, 64, 1),
}


@functools.lru_cache(maxsize=None)
def _shape_rule(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) from (N, K) only: everything that fixes the K reduction order."""
    if (N, K) in MEASURED and K % MEASURED[(N, K)][1] == 0:
        return MEASURED[(N, K)]
    block_k = BLOCK_K_DEFAULT if K >= BLOCK_K_DEFAULT else max(16, _next_pow2(K))
    block_n = 128 if N >= WIDE_N else 64
    block_n = min(block_n, max(16, _next_pow2(N)))
    n_tiles = _cdiv(N, block_n)
    k_blocks = _cdiv(K, block_k)
    split = 1
    if n_tiles < NUM_SMS:
        ok = [s for s in range(1, MAX_SPLIT_K + 1)
              if k_blocks % s == 0 and k_blocks // s >= MIN_K_BLOCKS_PER_SPLIT]
        if ok:
            enough = [s for s in ok if n_tiles * s >= NUM_SMS]
            split = enough[0] if enough else ok[-1]
    return block_n, block_k, split


def _resolve(M: int, N: int, K: int, override: dict | None = None) -> dict:
    if not override:   # the hot path: cached (PIN_BLOCK_M / SPLITK_M_CHUNK are part of the key)
        return _resolve_rule(M, N, K, PIN_BLOCK_M, SPLITK_M_CHUNK)
    return _build(M, N, K, override, PIN_BLOCK_M, SPLITK_M_CHUNK)


@functools.lru_cache(maxsize=4096)
def _resolve_rule(M: int, N: int, K: int, pin: int | None, m_chunk_max: int) -> dict:
    return _build(M, N, K, None, pin, m_chunk_max)


def _build(M: int, N: int, K: int, override: dict | None, pin: int | None, m_chunk_max: int) -> dict:
    block_n, block_k, split = _shape_rule(N, K)
    block_m = pin if pin is not None else (64 if M <= SMALL_M else 128)
    if override:
        unknown = set(override) - {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}
        assert not unknown, f"unknown gemm config keys {sorted(unknown)}"
        block_m = override.get("BLOCK_M", block_m)
        block_n = override.get("BLOCK_N", block_n)
        block_k = override.get("BLOCK_K", block_k)
        split = override.get("SPLIT_K", split)
    k_blocks = max(1, _cdiv(K, block_k))
    split = max(1, min(int(split), k_blocks))
    kb_per_split = _cdiv(k_blocks, split)
    split = _cdiv(k_blocks, kb_per_split)          # no empty splits
    m_chunk = min(M, m_chunk_max) if split > 1 else M
    num_warps = 8 if block_m >= 128 else 4        # 8 warps at 128 rows = two warpgroups of 64 rows
    cfg = {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
        "K_BLOCKS_PER_SPLIT": kb_per_split, "GROUP_M": GROUP_M,
        "num_warps": num_warps, "num_stages": 3 if (block_k >= 128 and block_m >= 128) else 4,  # shared-memory fit
        "m_chunk": m_chunk,
        "grid": _cdiv(max(m_chunk, 1), block_m) * _cdiv(N, block_n) * split,
        "workspace_bytes": 4 * split * m_chunk * N if split > 1 else 0,
    }
    if override:
        cfg["num_warps"] = override.get("num_warps", cfg["num_warps"])
        cfg["num_stages"] = override.get("num_stages", cfg["num_stages"])
    return cfg


def gemm_config(M: int, N: int, K: int) -> dict:
    """The tile configuration linear() uses for x [M, K] @ w [N, K]^T (for reports).

    BLOCK_N / BLOCK_K / SPLIT_K / K_BLOCKS_PER_SPLIT depend on (N, K) only; BLOCK_M, num_warps,
    num_stages and the grid also on M. ``grid`` counts programs of one launch of m_chunk rows."""
    return dict(_resolve(int(M), int(N), int(K)))


# --------------------------------------------------------------------------------------------------
# split-K workspace (one per device, grows, never freed while a graph may use it)

_SPLITK = SplitKWorkspace()
_workspace = _SPLITK.get


def workspace_numel(M: int, N: int, K: int) -> int:
    """fp32 elements of split-K workspace linear() needs for this shape (0 when it does not split)."""
    return gemm_config(M, N, K)["workspace_bytes"] // 4


def reserve_workspace(device: torch.device | str, shapes, max_rows: int) -> None:
    """Size the split-K workspace for up to ``max_rows`` rows of every (N, K) in ``shapes``, so later
    calls (e.g. during CUDA-graph capture) allocate nothing."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    need = max([workspace_numel(m, n, k) for n, k in shapes for m in (1, min(max_rows, SPLITK_M_CHUNK))],
               default=0)
    if need:
        _workspace(device, need)


# --------------------------------------------------------------------------------------------------
# host entry point

def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
           config: dict | None = None, defer: bool = False):
    """y = x @ w^T, batch-invariant (see the module docstring). x [M, K] and w [N, K] may have any
    strides (unit stride along K is the fast path); writes into ``out`` [M, N] (any strides) when given.
    ``config`` overrides the rule's tile choice (tests / tuning only: bits then follow the override).
    ``defer``: where K runs as several splits (one M chunk), return the partials unreduced as a
    kernels.splitk.SplitSums for the consumer to add (``out`` is then not written)."""
    assert x.dim() == 2 and w.dim() == 2, \
        f"linear: x must be [M, K] and w [N, K], got {tuple(x.shape)}, {tuple(w.shape)}"
    M, K = x.shape
    N, Kw = w.shape
    assert K == Kw, f"linear: x is [{M}, {K}] but w is [{N}, {Kw}]"
    assert x.dtype in _DTYPES, f"linear: x dtype {x.dtype} not supported (bf16 / fp16)"
    assert w.dtype == x.dtype, f"linear: w dtype {w.dtype} differs from x dtype {x.dtype}"
    assert w.device == x.device, f"linear: w on {w.device}, x on {x.device}"
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (M, N), f"linear: out is {tuple(out.shape)}, expected {(M, N)}"
        assert out.dtype == x.dtype, f"linear: out dtype {out.dtype} differs from x dtype {x.dtype}"
        assert out.device == x.device, f"linear: out on {out.device}, x on {x.device}"
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()

    cfg = _resolve(M, N, K, config)
    assert x.is_cuda or _INTERPRETED, (
        "linear: CPU tensors run only in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
        "first imported (or use linear_ref)")
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], EVEN_K=(K % bk == 0),
                  UPCAST=_INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # every weight byte is read once when one M tile covers all rows: stream it past L2
    w_evict = "evict_first" if _cdiv(M, bm) == 1 else ""

    if split == 1:
        _gemm_kernel[(cfg["grid"],)](
            x, w, out, M, N, K,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), 0,
            cfg["K_BLOCKS_PER_SPLIT"], W_EVICT=w_evict, **consts, **pdl.triton_opts(x.device))
        return out

    def launch(xs, ws, rows):
        _gemm_kernel[(_cdiv(rows, bm) * _cdiv(N, bn) * split,)](
            xs, w, ws, rows, N, K,
            xs.stride(0), xs.stride(1), w.stride(0), w.stride(1), N, 1, rows * N,
            cfg["K_BLOCKS_PER_SPLIT"], W_EVICT=w_evict, **consts, **pdl.triton_opts(xs.device))
    return run_splits(x, out, split, cfg["m_chunk"], _workspace, launch, defer)
