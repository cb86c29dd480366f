"""Probe: does a B = 1 int4 GEMV's time follow its grid's waves (tail quantization)?"""
import math, sys, torch
from harness.int4_bench import random_packed, graph_time, ROTATE_BYTES, _clone
from kernels import int4_mma, int4_cuda, pdl, int4_dispatch as disp

dev = torch.device("cuda")
pdl.configure(True, 1, "qwen35")
K = 5120
def run(N, fmt, fold, config, label):
    pw = random_packed(fmt, N, K, 0, dev)
    pws = [pw] + [_clone(pw) for _ in range(max(0, math.ceil(ROTATE_BYTES / pw.nbytes) - 1))]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16) * 0.01
    disp.reserve(dev, torch.bfloat16, [pw], 32)
    cfg = int4_mma.mma_config(1, N, K, fmt, config, fold)
    fns = [lambda p=p: int4_mma.w4a16_mma(x, p, fold=fold, config=config, defer=True) for p in pws]
    t = graph_time(fns)
    print(f"{label} N={N} fold={fold} cfg={config} grid={cfg['grid']} S={cfg['SPLIT_K']} -> {t*1e6:.2f} us, "
          f"{pw.nbytes/t/1e12:.2f} TB/s", flush=True)
    del pws

for N in (30720, 31744, 32768, 33792, 34816, 35840, 36864):
    run(N, "q4_0", True, None, "A")
    run(N, "q4_0", False, None, "A")
for S in (5, 8, 10, 20):
    for minb in (1, 2, 3, 4):
        run(34816, "q4_0", True, {"SPLIT_K": S, "MINB": minb}, "B")
