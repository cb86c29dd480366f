"""`w4a16(x, pw, out)`: the engine's projection for a weight kept quantized (a PackedWeight), choosing per
shape among six variants:

  "triton"          kernels/int4_gemm.py: tensor-core W4A16 kernel, any B, batch-invariant
  "cuda"            kernels/int4_cuda.py: CUDA-core W4A16 kernel for small B (CuPy / NVRTC), batch-invariant
  "cuda_mma"        kernels/int4_mma.py: mma.sync kernel for small B (tiles of up to 32 sequences; Q4_0 /
                    Q4_1 / Q4_K; NVRTC like "cuda"), batch-invariant
  "cuda_mma_fold"   the same kernel's folded form: group scales folded into bf16 / fp16 weights
                    (engine.quant_pack.unpack_folded), one fp32 accumulation across K; Q8_0 too; batch-invariant
  "cuda_mma_fold_lat"  the folded form's latency launch (int4_mma.latency_config): the fewest splits, a ring of
                    4 quads in flight per warp, batch tiles of up to 16, for small weights at many sequences; its own
                    split, so its own bits; batch-invariant
  "cuda_wgmma"      kernels/int4_wgmma.py: the folded weights on sm_90's wgmma, batch tiles of up to 128
                    (NVRTC through torch, sm_90a only); batch-invariant
  "cuda_wgmma_x2"   the same kernel with two blocks per SM below 128 sequences and splits sized for them
                    (int4_wgmma.X2); other splits, other bits than "cuda_wgmma"; batch-invariant
  "cuda_wgmma_ws"   kernels/int4_wgmma_ws.py: the same arithmetic fed by a producer warpgroup's bulk copies (Q8_0 too)
                    through a ring of shared memory (x staged first); "cuda_wgmma"'s bits except where its
                    tiles are halved for stream-K (int4_wgmma_ws.DEFAULTS); batch-invariant
  "cuda_wgmma_ws_t128"  the same kernel in tiles of 128 rows (int4_wgmma_ws.T128): half the split, fewer
                    partials at many sequences; its own bits; batch-invariant
  "dequant_cublas"  dequantize the packed weight into a reusable per-device workspace (one bf16/fp16 [N, K]
                    buffer shared by every projection: memory = the largest single matrix, never a second
                    copy of the model), then torch.matmul. Not batch-invariant (cuBLAS picks its algorithm
                    by M). The workspace is rewritten at every call, so it is only worth it where the GEMM is
                    compute-bound (large B, batched prefill); a cached dense copy per weight is deliberately
                    not offered: it would undo the memory the packed weights save.

Policies (``set_policy`` / ``engine.int4``):
  "invariant" (default): one variant per (N, K, fmt) for every M, so B greedy streams stay bit-exact with
              the single stream (the seed's verify); every variant but "dequant_cublas" qualifies. Given the
              engine's batch (``set_policy(..., max_batch=B)``, as harness/run.py does with batch.size), the
              pick is the fastest batch-invariant variant at B ("invariant_at"; the next measured B up):
              still one kernel per shape for every M the engine runs (its prefill rows included), so its
              streams equal its single stream; engines built for different B may differ in the last bits,
              as engine.gemm=cublas engines do.
  "fastest":  per (N, K, fmt, B bucket), any variant; like engine.gemm=cublas, B streams may then differ
              from the single stream in the last bits.
  "triton" | "cuda" | "cuda_mma" | "cuda_mma_fold" | "cuda_mma_fold_lat" | "cuda_wgmma" | "cuda_wgmma_x2" |
  "cuda_wgmma_ws" | "cuda_wgmma_ws_t128" | "dequant_cublas": force one variant
              (benchmarks, tests).
              ``ONEPASS_INT4_VARIANT``
              does the same from the environment.

The choice comes from ``MEASURED``, filled from the H200 runs of experiment int4_gemm
(``python -m kernels.int4_dispatch --uri sqlite:///mlflow.db [--all-sweeps]`` or ``--csv
experiments/int4_gemm/runs.csv`` prints the entries to paste). A format not measured on a shape takes the picks of
the same shape in a sibling 4-bit format (SIBLINGS: Q4_0, Q4_1 and Q4_K run the same kernels, and which one wins
follows the shape and B far more than the format: H200, the 27B hybrid's five projections and LM head in Q4_0 against
their Q4_K picks, the borrowed pick at most 13% slower than the fastest invariant kernel at B = 1 and 8 and the fastest
itself from 16 sequences on, where the earlier rule, the folded kernel to 32 sequences and Triton above, was 1.1-2.5x
slower). With neither, the rule decides (BIG: weights of at least 8 M values):
  invariant: for an engine of at most 8 sequences "cuda_mma_fold" where it runs (Q4_0 / Q4_1 / Q4_K / Q8_0); else a BIG
             weight on sm_90 "cuda_wgmma_ws"; else "cuda_mma_fold" to 32 sequences; else "triton", but for Q8_0
             "cuda_wgmma_ws_t128" on sm_90;
  fastest:   by M the same, with "cuda" for M <= 4 where the mma kernels cannot run and "dequant_cublas" for
             M > 256 (compute-bound GEMMs, batched prefill).
  Why (H200, the 146 rows of experiments/int4_gemm/runs.csv at 88473b9, each variant's time over the fastest
  batch-invariant one, median / worst): at B = 1 cuda_mma_fold 1.00 / 1.23 against cuda_mma's 1.14 / 1.50, at B = 2..8
  1.02 / 1.64 against 1.27 / 2.68; at 16..128 on BIG weights cuda_wgmma_ws 1.00 / 1.46 against Triton's 1.92 / 2.58
  (cuda_mma_fold 1.42 / 1.90 at 16..32); on the small ones (SmolLM2's, Llama's 2048x2048 and 3072x2048) ws 1.81 /
  3.11, where cuda_mma_fold at 16..32 (1.15 / 1.24) and Triton at 64..128 (1.30 / 1.80) are the safer choices.
  Not for Q8_0, whose Triton path has no 16-bit fold: on Llama's two small Q8_0 shapes at 617d82c ws t128 took
  10.1 / 11.6 us (2048x2048, B = 64 / 128) and 10.8 / 13.1 (3072x2048) against Triton's 10.8 / 13.2 and 12.6 / 22.0.
A variant that cannot run here (no CuPy / NVRTC, a format the kernel does not take -- Q8_0 in cuda_mma's exact
form --, or the CPU) falls back to
"triton" on the GPU and to the reference (w4a16_linear_ref) on the CPU without Triton's interpreter.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from onepass.engine.quant_pack import GROUP, PackedWeight
from onepass.kernels import int4_cuda, int4_mma, int4_wgmma, int4_wgmma_ws
from onepass.kernels.int4_gemm import _INTERPRETED, FMT_CODE, _decode, w4a16_linear, w4a16_linear_ref
from onepass.kernels import pdl
from onepass.kernels.triton_compat import tl, triton

VARIANTS = ("triton", "cuda", "cuda_mma", "cuda_mma_fold", "cuda_mma_fold_lat", "cuda_wgmma", "cuda_wgmma_x2",
            "cuda_wgmma_ws", "cuda_wgmma_ws_t128", "dequant_cublas")
INVARIANT_VARIANTS = VARIANTS[:-1]
WGMMA_CONFIGS = {"cuda_wgmma": None, "cuda_wgmma_x2": int4_wgmma.X2}
WS_CONFIGS = {"cuda_wgmma_ws": None, "cuda_wgmma_ws_t128": int4_wgmma_ws.T128}
WS_MEASURED = {"cuda_wgmma_ws_t128": int4_wgmma_ws.MEASURED_T128}   # per-shape entries on top of a variant's config
MMA_VARIANTS = ("cuda_mma", "cuda_mma_fold", "cuda_mma_fold_lat")
POLICIES = ("invariant", "fastest") + VARIANTS
B_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)     # M above the last bucket uses the last bucket's entry
SIBLINGS = {"q4_0": ("q4_1", "q4_k"), "q4_1": ("q4_k", "q4_0"), "q4_k": ("q4_1", "q4_0")}   # borrowed picks, in order
BIG = 1 << 23                      # weights the rule gives cuda_wgmma_ws (module docstring)

# (N, K, fmt) -> {"invariant": variant, B bucket: variant, ...}, from the int4_gemm experiment on the H200
# (python -m kernels.int4_dispatch prints these lines from a recorded run). Empty until measured.
# Measured on the H200 (torch 2.11, triton 3.6, cupy 14.2; experiment int4_gemm: the five Q4_0 shapes at
# B = 1..128, commit 2a7e149 (5120x17408 and 17408x5120 at 0675de4), and the 27B hybrid's five Q4_K projections at
# B = 1, 8, 16, 32, 64, 128, and its LM head 248320x5120, all six again at 10a25e8 (Triton's W16); every shape at
# B = 64 and 128 again at e516e01 and 64c4aa5, with cuda_wgmma; Llama-3.2-1B's other Q4_0 shapes 3072x2048,
# 16384x2048, 2048x2048 and its LM head 128256x2048 at B = 1, 8, 32, 64, 128 at c6b561b; the six Q4_K shapes at
# B = 8..128 and 128256x2048 at 9cece18, with cuda_wgmma's stream-K on the shapes of more than 132 row tiles; with
# cuda_wgmma_x2, at d5049fa: the six Q4_K shapes at B = 8..128, the five Q4_0 at B = 16..128, Llama's four
# others at B = 8, 32, 64, 128; the five Q4_0 shapes at B = 1..128 again at 9256b41, with PDL; with
# cuda_wgmma_ws, at 3fc6e59: the six Q4_K shapes and the five Q4_0 at B = 16..128; with its four consumer
# warpgroups, at 5bd83ff: the five Q4_0 shapes at B = 1, 8, 16, 32, 64, 128, the six Q4_K shapes at the same
# B, Llama's four others at B = 1, 8, 32, 64, 128; 16384x5120 Q4_K again at 9e9977e, its folded launch in 4-warp
# blocks: the same picks; with cuda_wgmma_ws_t128, at 06a2758: the five Q4_0 and the six Q4_K shapes at
# B = 16..128, Llama's four others at B = 32, 64, 128; with the ws staging launch triggering its GEMM early, at
# 701315b: the six Q4_K shapes at B = 8..128, the five Q4_0 at B = 16..128, Llama's four others at B = 32, 64,
# 128; with the CUDA GEMMs' late release at up to 8 sequences (kernels/pdl.py), at 060faf8: the issue's five Q4_0 at
# B = 1, 2, 4, 8, the six Q4_K shapes and Llama's four others at B = 1, 8; SmolLM2's four Q4_1 projections (960x576,
# 576x576, 3072x576, 576x1536) at B = 1, 8, 32, 64, 128; the five Q4_0 at B = 128 at 05d290d (the ws
# kernel's accumulators written by each segment's first quad in tiles of 128); with the ws kernel staging x itself
# in batch tiles of up to 8 (X_IN_GEMM_MAX_BT), at e0b4557, and again with its consumers on mma.sync in those tiles
# (MMA_MAX_BT), at d3b9c93: the five Q4_0 at B = 1, 2, 4, 8, the six Q4_K shapes, Llama's four others and
# SmolLM2's four at B = 1, 8; SmolLM2's four at every B again at 3b81d32 (576x576 in the folded kernel's 64-row
# blocks: its fastest pick from 32 sequences on is now that kernel, not dequantize + cuBLAS); with the folded form's
# latency launch (cuda_mma_fold_lat) and the 128-row ws tiles' split of 6 on 2048x2048, at 6974d28: SmolLM2's four and
# Llama's 2048x2048 and 3072x2048 at B = 1, 8, 32, 64, 128 (17408x5120 Q4_0's picks now follow its rows recorded at
# 05d290d and after: its ws and ws t128 times are within 0.1 us of each other); with the folded kernel in 8- and
# 16-warp blocks on 5120x17408 / 5120x12288 / 4096x4096 Q4_0, at 42117a0: those three at every B; the 27B hybrid's
# other four projections and its LM head in Q4_0 (34816x5120, 16384x5120, 14336x5120, 5120x6144, 248320x5120) at
# B = 1, 8, 16, 32, 64, 128, at 88473b9; with the ws kernel's weights as L2 evict-first (int4_wgmma_ws.WEIGHT_EVICT_FIRST),
# at 16633a2: the issue's five Q4_0 shapes and Llama's four others in Q4_0 and Q8_0 at B = 16, 32, 64, 128, SmolLM2's
# four at 32, 64, 128, the 27B's five Q4_K projections and LM head at 16, 32, 64, 128, and at 33a571a 2048x2048 Q8_0
# (its 128-row tiles in six splits) at B = 1, 8, 16, 32, 64, 128; with the exact mma kernel's launches of their own on
# 16384x5120 and 5120x6144 Q4_0 (kernels/int4_mma.py MEASURED), at 474ab0c: those two at B = 1, 8, 16, 32, 64, 128
# (5120x6144 at B = 32 now ws against x2, a 0.02 us difference: 10.77 / 10.79 ms a 27B Q4_0 step at B = 32 in
# switch_ab, the same); picked with CHAIN_US, and for their engine batch overruled by STEP_PICKS below):
# the fastest variant per B bucket; the one kernel per shape whose worst ratio to the fastest over B is
# smallest (the "invariant" policy's pick, which keeps every row's arithmetic independent of B); and per B
# the fastest batch-invariant kernel (the invariant pick of an engine built for B sequences).
MEASURED: dict[tuple[int, int, str], dict] = {
    (576, 576, 'q4_1'): {'invariant': 'cuda_mma_fold_lat', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'},
    (576, 1536, 'q4_1'): {'invariant': 'cuda_mma_fold', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'},
    (960, 576, 'q4_1'): {'invariant': 'cuda_mma_fold_lat', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'},
    (2048, 2048, 'q4_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'},
    (2048, 2048, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_mma_fold', 32: 'cuda_mma_fold', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_mma_fold', 32: 'cuda_mma_fold', 64: 'cuda_wgmma_ws_t128', 128: 'dequant_cublas'},
    (2048, 8192, 'q4_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma', 2: 'cuda_mma', 4: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma', 2: 'cuda_mma', 4: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (2048, 8192, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'},
    (3072, 576, 'q4_1'): {'invariant': 'cuda_mma_fold_lat', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'cuda_mma_fold_lat'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 32: 'cuda_mma_fold_lat', 64: 'cuda_mma_fold_lat', 128: 'dequant_cublas'},
    (3072, 2048, 'q4_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma', 32: 'cuda_mma', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma', 32: 'cuda_mma', 64: 'cuda_wgmma_ws_t128', 128: 'dequant_cublas'},
    (3072, 2048, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_wgmma_ws_t128', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_wgmma_ws_t128', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'dequant_cublas'},
    (4096, 4096, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (4096, 4096, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_mma_fold', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'},
    (5120, 6144, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (5120, 6144, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_wgmma_ws', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_wgmma_ws', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_x2', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (5120, 12288, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (5120, 12288, 'q8_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (5120, 17408, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (5120, 17408, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (5120, 17408, 'q8_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma_fold', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (14336, 5120, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma', 8: 'cuda_mma', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (14336, 5120, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (16384, 2048, 'q4_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'},
    (16384, 2048, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_wgmma_ws_t128', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_wgmma_ws_t128', 8: 'cuda_wgmma_ws_t128', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws_t128'},
    (16384, 5120, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (16384, 5120, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (17408, 5120, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_mma', 16: 'cuda_wgmma_x2', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws_t128', 128: 'cuda_wgmma_ws'},
    (17408, 5120, 'q8_0'): {'invariant': 'cuda_wgmma_ws_t128', 'invariant_at': {1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma_fold', 2: 'cuda_mma_fold', 4: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws_t128', 32: 'cuda_wgmma_ws_t128', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (34816, 5120, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (34816, 5120, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (128256, 2048, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (128256, 2048, 'q8_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws_t128'},
    (248320, 5120, 'q4_0'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
    (248320, 5120, 'q4_k'): {'invariant': 'cuda_wgmma_ws', 'invariant_at': {1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'}, 1: 'cuda_mma_fold', 8: 'cuda_wgmma_ws', 16: 'cuda_wgmma_ws', 32: 'cuda_wgmma_ws', 64: 'cuda_wgmma_ws', 128: 'cuda_wgmma_ws'},
}

_policy = os.environ.get("ONEPASS_INT4_VARIANT", "").strip() or "invariant"
if _policy not in POLICIES:
    raise ValueError(f"ONEPASS_INT4_VARIANT={_policy!r}: choose one of {POLICIES}")


_max_batch: int | None = None      # the engine's batch, for the invariant pick (None: every B measured)


def set_policy(policy: str, max_batch: int | None = None) -> None:
    global _policy, _max_batch
    if policy not in POLICIES:
        raise ValueError(f"int4 policy {policy!r}: choose one of {POLICIES}")
    if max_batch is not None and int(max_batch) < 1:
        raise ValueError(f"int4 policy: max_batch={max_batch}; need at least one sequence")
    _policy, _max_batch = policy, (None if max_batch is None else int(max_batch))


def get_policy() -> str:
    return _policy


def bucket(M: int) -> int:
    return next((b for b in B_BUCKETS if M <= b), B_BUCKETS[-1])


def rule(M: int, N: int, K: int, fmt: str, policy: str) -> str:
    """The documented rule for shapes MEASURED has no entry for (in the format or a sibling)."""
    mma = int4_mma.supports(fmt, fold=True) and int4_mma.available()     # the rule only picks the folded form
    ws = N * K >= BIG and int4_wgmma_ws.supports(fmt) and int4_wgmma.available()
    if policy == "invariant":
        m = _max_batch
    else:
        m = M
        if M <= 4 and not mma and int4_cuda.available():
            return "cuda"
        if M > 256:
            return "dequant_cublas"
    if mma and m is not None and m <= 8:
        return "cuda_mma_fold"
    if ws:
        return "cuda_wgmma_ws"
    if mma and m is not None and m <= 32:
        return "cuda_mma_fold"
    if fmt == "q8_0" and int4_wgmma.available():
        return "cuda_wgmma_ws_t128"
    return "triton"


# Where the graphed decode step overrules int4_gemm: (N, K, fmt) -> {engine batch (an invariant_at key): variant}. The
# int4_gemm rows time one GEMM's calls back to back; in a step each call sits between other kernels (and beside the
# side stream's dense beta|alpha GEMM on the GDN input projection), which these picks are measured in. H200, 27B Q4_0,
# switch_ab (one process, the same tokens), ms per step with the int4_gemm-fastest pick (the exact mma kernel in its
# launches of 3087cb1) / these: B = 1 6.05 / 5.89 (16384x5120 and 5120x6144 together), where int4_gemm puts the exact
# kernel 0.1 / 1.2 us ahead of the ws and folded kernels kept here. Runners-up within a few percent in int4_gemm, tried
# in the step and not taken (the same method at 289e08c, ms a step, baseline first): B = 32, 5120x6144 on ws 10.761 /
# the exact kernel 10.878 / cuda_wgmma_x2 10.775, 16384x5120 on the 128-row ws tiles 10.960; B = 1, the folded kernel
# instead of the exact one on 34816x5120 / 14336x5120 / the LM head 5.926 / 5.902 / 5.875 against 5.821; B = 128,
# 5120x17408 on ws instead of its 128-row tiles 23.109 against 22.979. The same two tried on the 27B Q4_K, whose rows
# are older (16633a2, before the x images), at f39e45f (switch_ab, the table's picks first, three rounds): B = 32,
# 5120x6144 on ws instead of cuda_wgmma_x2 10.634 / 10.620; B = 128, 5120x17408 on the 128-row tiles instead of ws
# 21.696 / 21.762. Within noise and slower: not taken.
STEP_PICKS: dict[tuple[int, int, str], dict[int, str]] = {
    (16384, 5120, "q4_0"): {1: "cuda_wgmma_ws"},
    (5120, 6144, "q4_0"): {1: "cuda_mma_fold"},
}


def measured_entry(N: int, K: int, fmt: str) -> dict:
    """MEASURED's entry for the weight, else the same shape's in a sibling format, else {} (the rule)."""
    for f in (fmt, *SIBLINGS.get(fmt, ())):
        if (N, K, f) in MEASURED:
            return MEASURED[(N, K, f)]
    return {}


def choose(M: int, N: int, K: int, fmt: str, policy: str | None = None) -> str:
    """The variant w4a16 runs for x [M, K] and a [N, K] weight of format fmt (before availability fallback)."""
    policy = policy or _policy
    if policy in VARIANTS:
        return policy
    entry = measured_entry(N, K, fmt)
    if policy == "invariant":
        v = entry.get("invariant")
        at = entry.get("invariant_at") or {}
        if _max_batch is not None and at:                      # the pick for an engine of _max_batch sequences
            keys = sorted(at)
            key = next((b for b in keys if b >= _max_batch), keys[-1])
            v = STEP_PICKS.get((N, K, fmt), {}).get(key, at[key])
        return v if v in INVARIANT_VARIANTS else rule(M, N, K, fmt, policy)
    v = entry.get(bucket(M))
    return v if v in VARIANTS else rule(M, N, K, fmt, policy)


def runnable(variant: str, x: torch.Tensor, fmt: str | None = None) -> str:
    """variant, or what runs instead where it cannot: cuda / cuda_mma -> triton without CuPy/NVRTC (and
    cuda_mma -> triton for a format it does not take); on the CPU everything -> "ref" unless Triton's
    interpreter is on (then triton; dequant_cublas runs anywhere)."""
    if not x.is_cuda:
        if variant == "dequant_cublas":
            return variant
        return "triton" if _INTERPRETED else "ref"
    if variant == "cuda" and not int4_cuda.available():
        return "triton"
    if variant in MMA_VARIANTS and not (int4_mma.available()
                                        and (fmt is None or int4_mma.supports(fmt, fold=variant != "cuda_mma"))):
        return "triton"
    kernel = int4_wgmma if variant in WGMMA_CONFIGS else int4_wgmma_ws
    if (variant in WGMMA_CONFIGS or variant in WS_CONFIGS) \
            and not (int4_wgmma.available() and (fmt is None or kernel.supports(fmt))):
        return "triton"
    return variant


# --------------------------------------------------------------------------------------------------
# dequantize into a workspace (the dequant_cublas variant)

@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, c_ptr, sub_ptr, w_ptr, N, G, stride_wn,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """w[n, 32g + k] = the packed weight's value (unpack_ref's fp32 arithmetic), rounded to w's dtype."""
    pdl.enter(PDL)  # kernels/pdl.py
    WPG: tl.constexpr = 8 if FMT == 3 else 4
    g = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    r64 = tl.where(ok, rows, 0).to(tl.int64)
    N64 = tl.cast(N, tl.int64)
    off = g * N64 + r64
    w = tl.load(qw_ptr + off[:, None] * WPG + tl.arange(0, WPG)[None, :])
    val = _decode(w, off, (g // 8) * N64 + r64, s_ptr, c_ptr, sub_ptr, FMT, BLOCK_N)
    ptrs = w_ptr + r64[:, None] * stride_wn + g * 32 + tl.arange(0, 32)[None, :]
    if UPCAST:   # interpreter: keep fp32 (the caller casts), its own bf16 cast truncates
        tl.store(ptrs, val, mask=ok[:, None])
    else:
        tl.store(ptrs, val.to(w_ptr.dtype.element_ty), mask=ok[:, None])


class _DenseWorkspace:
    """One grow-only buffer per (device, dtype); replaced buffers are kept for captured graphs."""

    def __init__(self) -> None:
        self._buf: dict[tuple, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        key = (device, dtype)
        b = self._buf.get(key)
        if b is None or b.numel() < numel:
            if b is not None:
                self._retired.append(b)
            b = self._buf[key] = torch.empty(numel, dtype=dtype, device=device)
        return b


_DENSE = _DenseWorkspace()


def dequantize_into(pw: PackedWeight, dst: torch.Tensor) -> torch.Tensor:
    """dst [N, K] (row stride K) = the packed weight's values in dst's dtype. Triton on the GPU (or in the
    interpreter); plain torch (unpack_ref) otherwise."""
    N, K = pw.N, pw.K
    if not (dst.is_cuda or _INTERPRETED):
        return dst.copy_(w4a16_unpack(pw))
    c = pw.mins if pw.mins is not None else pw.scales
    sub = pw.sub if pw.sub is not None else pw.scales
    block_n = 64
    tgt = dst if not _INTERPRETED else torch.empty((N, K), dtype=torch.float32, device=dst.device)
    _dequant_kernel[(K // GROUP, -(-N // block_n))](pw.qweight, pw.scales, c, sub, tgt, N, K // GROUP, tgt.stride(0),
                                                   FMT=FMT_CODE[pw.fmt], BLOCK_N=block_n, UPCAST=_INTERPRETED,
                                                   **pdl.triton_opts(pw.qweight.device))
    if tgt is not dst:
        dst.copy_(tgt)
    return dst


def w4a16_unpack(pw: PackedWeight) -> torch.Tensor:
    from onepass.engine.quant_pack import unpack_ref

    return unpack_ref(pw)


def dequant_matmul(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dequant_cublas variant: the weight decoded into the shared workspace, then torch.matmul."""
    ws = _DENSE.get(x.device, x.dtype, pw.N * pw.K)[: pw.N * pw.K].view(pw.N, pw.K)
    dequantize_into(pw, ws)
    if out is not None and out.dtype != x.dtype:
        return out.copy_(torch.matmul(x, ws.t()))
    return torch.matmul(x, ws.t(), out=out)


def reserve(device: torch.device | str, dtype: torch.dtype, weights, max_rows: int) -> None:
    """Size every workspace the variants may need for these packed weights and up to max_rows rows, so a
    CUDA graph captured later allocates nothing."""
    from onepass.kernels.int4_gemm import reserve_workspace as triton_reserve

    device = torch.device(device)
    shapes = sorted({(w.N, w.K, w.fmt) for w in weights})
    if not shapes or device.type != "cuda":
        return
    triton_reserve(device, shapes, max_rows)
    if int4_cuda.available():
        int4_cuda.reserve_workspace(device, shapes, max_rows)
    if int4_mma.available():
        int4_mma.reserve_workspace(device, shapes, max_rows)
        int4_mma.reserve_workspace(device, shapes, max_rows, latency=True)
    if int4_wgmma.available():
        for config in WGMMA_CONFIGS.values():
            int4_wgmma.reserve_workspace(device, shapes, max_rows, config)
        for v in WS_CONFIGS:
            for shape in shapes:
                int4_wgmma_ws.reserve_workspace(device, [shape], max_rows, ws_variant_config(v, *shape))
    if _policy in ("fastest", "dequant_cublas"):
        _DENSE.get(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()),
                   dtype, max(n * k for n, k, _ in shapes))


# --------------------------------------------------------------------------------------------------
# the entry point

def run_variant(variant: str, x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None,
                defer: bool = False, x_image=None):
    """defer: a variant that splits K may return its partials unreduced (kernels/splitk.py); the others, and
    the reference, always return the finished output. x_image: image_for's, holding x's image (the ws variants then
    skip their staging launch; the others read x)."""
    v = runnable(variant, x, pw.fmt)
    if v == "ref":
        y = w4a16_linear_ref(x, pw)
        return y if out is None else out.copy_(y)
    if v == "cuda":
        return int4_cuda.w4a16_cuda(x, pw, out, defer=defer)
    if v in MMA_VARIANTS:
        return int4_mma.w4a16_mma(x, pw, out, fold=v != "cuda_mma", latency=v == "cuda_mma_fold_lat", defer=defer)
    if v in WGMMA_CONFIGS:
        return int4_wgmma.w4a16_wgmma(x, pw, out, config=WGMMA_CONFIGS[v], defer=defer)
    if v in WS_CONFIGS:
        return int4_wgmma_ws.w4a16_wgmma_ws(x, pw, out, config=ws_variant_config(v, pw.N, pw.K, pw.fmt), defer=defer,
                                            x_image=x_image)
    if v == "dequant_cublas":
        return dequant_matmul(x, pw, out)
    return w4a16_linear(x, pw, out, defer=defer)


def ws_variant_config(variant: str, N: int, K: int, fmt: str) -> dict | None:
    """The ws kernel's config for one of WS_CONFIGS' variants on (N, K, fmt): the variant's, then its WS_MEASURED
    entry for the shape (e.g. a split of its own)."""
    entry = WS_MEASURED.get(variant, {}).get((N, K, fmt))
    return {**(WS_CONFIGS[variant] or {}), **entry} if entry else WS_CONFIGS[variant]


def w4a16(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None, defer: bool = False, x_image=None):
    """y = x @ w^T for a packed weight, through the variant ``choose`` names for this shape and M (defer, x_image:
    see run_variant)."""
    M, K = x.shape
    return run_variant(choose(M, pw.N, K, pw.fmt), x, pw, out, defer, x_image)


# The kernels that make a ws GEMM's input write its staged image as well (kernels/x_image.py), so the GEMM skips its
# staging launch. Module switch (probes compare it off).
PRODUCER_IMAGES = True


def image_for(x: torch.Tensor, pw: PackedWeight):
    """Where the kernel making x [M, K] should also write x for w4a16(x, pw) to skip a staging launch
    (kernels/x_image.XImage), or None: the variant picked for this M is not a ws kernel that stages x, or
    PRODUCER_IMAGES is off. Ask just before making x: the image lives in the ws kernels' shared workspace."""
    if not PRODUCER_IMAGES or not x.is_cuda:
        return None
    M, K = x.shape
    v = choose(M, pw.N, K, pw.fmt)
    if v not in WS_CONFIGS or runnable(v, x, pw.fmt) != v:
        return None
    return int4_wgmma_ws.image_for(x, pw, ws_variant_config(v, pw.N, pw.K, pw.fmt))


# --------------------------------------------------------------------------------------------------
# filling MEASURED from a recorded int4_gemm run

# What a call costs in a decode step's chain beyond its int4_gemm time, in us, added before comparing: the ws kernels'
# x-staging launch, which int4_gemm's back-to-back calls of one GEMM overlap better than a step's chain of different
# kernels does. H200, 27B hybrid Q4_K at B = 32: a table that gave 5120x6144 the 128-row ws tiles (16.9 us in int4_gemm
# against the two-blocks-per-SM wgmma's 17.2) ran 11.67 ms per step against 11.55 with the wgmma (2a1defd against
# 656c769, harness runs; the one pick that differed), ~1.9 us over 64 calls.
# Since 1e647ff most ws calls of a step take their x from the kernel before (PRODUCER_IMAGES) and skip that launch
# (and up to 8 sequences the ws kernel stages x itself). Yet without the charge the table is no better: H200 at
# 10be1b0, switch_ab in one process, MEASURED regenerated from the same int4_gemm rows with CHAIN_US 0 (ws and ws
# t128 then taken on eight shapes at some B) against this table, ms a step: Llama-3.2-1B Q4_0 B = 1 / 8 / 32 0.548 /
# 0.662 / 0.881 against 0.548 / 0.674 / 0.885, Q8_0 0.680 / 0.823 / 0.987 against 0.662 / 0.827 / 0.965, the 27B
# hybrid Q4_K at B = 32 11.102 against 11.158: -1.8% to +2.7%. Kept at 1 us.
CHAIN_US = dict.fromkeys(WS_CONFIGS, 1.0)


def table_entries(df) -> dict[tuple[int, int, str], dict]:
    """Recorded int4_gemm runs (one per N, K, fmt, B; metrics *_us per variant) -> MEASURED entries:
    per B bucket the fastest variant that verified, and "invariant": the batch-invariant variant (measured at
    every B) whose worst ratio to the fastest variant over the measured B is smallest, ties to the smaller
    total time. Not the smallest total: microseconds at B = 1 then weigh as much as at B = 128, where a
    small-batch kernel is several times slower (on the H200 a total-time pick of cuda_mma for Llama-1B's
    down projection cost 13% of end-to-end tok/s at B = 128). "invariant_at": {B: the fastest batch-invariant
    variant at B}, the pick for an engine built for B sequences (its full-batch steps are what it runs most).
    Every comparison adds CHAIN_US to the variant's time.
    """
    import pandas as pd

    def col(c):
        return pd.to_numeric(df[c], errors="coerce") if c in df else pd.Series([float("nan")] * len(df), index=df.index)

    d = pd.DataFrame({"N": col("params.micro.n"), "K": col("params.micro.k"), "fmt": df.get("params.micro.fmt"),
                      "B": col("params.batch.size")})
    for v in VARIANTS:
        ok = col(f"metrics.{v}_ok")
        d[v] = col(f"metrics.{v}_us").where(ok.fillna(1) == 1) + CHAIN_US.get(v, 0.0)
    out: dict[tuple[int, int, str], dict] = {}
    for (n, k, fmt), grp in d.dropna(subset=["N", "K", "B"]).groupby(["N", "K", "fmt"]):
        entry: dict = {}
        best = grp[list(VARIANTS)].min(axis=1)

        def pick(rows):
            score = {v: ((rows[v] / best[rows.index]).max(), rows[v].sum()) for v in INVARIANT_VARIANTS
                     if rows[v].notna().all()}
            return min(score, key=score.get) if score else None

        if pick(grp):
            entry["invariant"] = pick(grp)
        at = {}
        for _, r in grp.sort_values("B").iterrows():
            times = {v: r[v] for v in INVARIANT_VARIANTS if r[v] == r[v]}
            if times:
                at[int(r["B"])] = min(times, key=times.get)
        if at:
            entry["invariant_at"] = at
        for _, r in grp.sort_values("B").iterrows():
            times = {v: r[v] for v in VARIANTS if r[v] == r[v]}
            if times:
                entry[bucket(int(r["B"]))] = min(times, key=times.get)
        out[(int(n), int(k), str(fmt))] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print MEASURED entries for kernels/int4_dispatch.py from recorded "
                                             "int4_gemm runs (the newest sweep in the store, or a runs.csv).")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--csv", default=None, help="experiments/int4_gemm/runs.csv instead of the store")
    ap.add_argument("--all-sweeps", action="store_true",
                    help="every finished int4_gemm run in the store, not only the newest sweep (e.g. a Q4_0 job "
                         "and a Q4_K job of one commit)")
    args = ap.parse_args(argv)
    if args.csv:
        import pandas as pd

        if not os.path.isfile(args.csv):
            ap.error(f"--csv {args.csv}: no such file (experiments/int4_gemm/runs.csv holds the recorded rows)")
        df = pd.read_csv(args.csv, dtype=str)
    else:
        from onepass.harness.report import runs_from_store

        df = runs_from_store("int4_gemm", args.uri, newest=not args.all_sweeps)
    if df.empty:
        print("no int4_gemm runs found", file=sys.stderr)
        return 1
    print("MEASURED = {")
    for key, entry in sorted(table_entries(df).items()):
        print(f"    {key!r}: {entry!r},")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
