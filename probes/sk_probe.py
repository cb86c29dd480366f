"""Probe: the stream-K GEMV (kernels/int4_mma_sk.py) against the folded / exact mma kernels and ws, int4_gemm's method."""
import math, sys, time, itertools, torch
from harness.int4_bench import random_packed, graph_time, ROTATE_BYTES, _clone
from kernels import int4_mma, int4_mma_sk, int4_wgmma_ws, pdl, int4_dispatch as disp
from engine.quant_pack import unpack_folded

dev = torch.device("cuda")
what = sys.argv[1] if len(sys.argv) > 1 else "all"

def copies(pw):
    return [pw] + [_clone(pw) for _ in range(max(0, math.ceil(ROTATE_BYTES / pw.nbytes) - 1))]

def t_us(fn, pws, x, **kw):
    return graph_time([lambda p=p: fn(x, p, **kw) for p in pws]) * 1e6

def check(fmt, N, K):
    pw = random_packed(fmt, N, K, 3, dev)
    w = unpack_folded(pw, torch.bfloat16)
    x = torch.randn(17, K, device=dev, dtype=torch.bfloat16) / math.sqrt(K) / w.pow(2).mean().sqrt()
    disp.reserve(dev, torch.bfloat16, [pw], 32)
    y_all = int4_mma_sk.w4a16_mma_sk(x, pw, torch.empty(17, N, device=dev))
    ref = x.float() @ w.T
    err = ((y_all - ref).abs() / (1 + ref.abs())).max().item()
    inv = all(torch.equal(int4_mma_sk.w4a16_mma_sk(x[lo:lo + m], pw, torch.empty(m, N, device=dev)), y_all[lo:lo + m])
              for m in (1, 2, 3, 8, 9) for lo in (0, 17 - m))
    y16 = int4_mma_sk.w4a16_mma_sk(x, pw)
    print(f"[check] {fmt} {N}x{K}: rel err {err:.2e}, rows independent of M {inv}, bf16 = fp32 rounded "
          f"{torch.equal(y16, y_all.bfloat16())}, cfg {int4_mma_sk.sk_config(1, N, K, fmt)}", flush=True)

def compare(fmt, N, K, B, configs=(None,)):
    pdl.configure(True, B, "qwen35")
    pw = random_packed(fmt, N, K, 0, dev)
    pws = copies(pw)
    x = torch.randn(B, K, device=dev, dtype=torch.bfloat16) * 0.01
    disp.reserve(dev, torch.bfloat16, [pw], 32)
    for c in configs:
        int4_mma_sk.reserve_workspace(dev, [(N, K, fmt)], 32, c)
    row = {}
    row["fold"] = t_us(int4_mma.w4a16_mma, pws, x, fold=True, defer=True)
    if fmt != "q8_0":
        row["mma"] = t_us(int4_mma.w4a16_mma, pws, x, defer=True)
    row["ws"] = t_us(int4_wgmma_ws.w4a16_wgmma_ws, pws, x, defer=True)
    for c in configs:
        row[f"sk{c or ''}"] = t_us(int4_mma_sk.w4a16_mma_sk, pws, x, config=c, defer=True)
    row["sk+reduce"] = t_us(int4_mma_sk.w4a16_mma_sk, pws, x, config=configs[0])
    row["fold+reduce"] = t_us(int4_mma.w4a16_mma, pws, x, fold=True)
    mb = pw.nbytes / 1e6
    cfg = int4_mma_sk.sk_config(B, N, K, fmt, configs[0])
    print(f"[cmp] {fmt} {N}x{K} B={B} ({mb:.1f} MB, slots {cfg['SPLIT_K']}): " +
          ", ".join(f"{k} {v:.2f}" for k, v in row.items()) +
          f" | sk {pw.nbytes / row['sk' + str(configs[0] or '')] / 1e6:.2f} TB/s", flush=True)
    del pws

if what in ("all", "check"):
    for fmt in ("q4_0", "q4_1", "q4_k", "q8_0"):
        check(fmt, 5120, 17408)
    check("q4_0", 1000, 1088)
    check("q4_k", 72, 768)
if what in ("all", "b1"):
    for N, K in [(34816, 5120), (16384, 5120), (14336, 5120), (5120, 6144), (5120, 17408), (17408, 5120),
                 (5120, 12288), (4096, 4096), (2048, 8192), (248320, 5120)]:
        compare("q4_0", N, K, 1)
    for N, K in [(34816, 5120), (16384, 5120), (5120, 6144), (5120, 17408)]:
        compare("q4_k", N, K, 1)
if what in ("all", "sweep"):
    cfgs = [{"KW": kw, "BPS": bps, "U": u} for kw, bps, u in itertools.product((4, 8, 16), (2, 4, 8), (2, 3, 4))
            if kw * bps <= 64]
    for N, K in [(34816, 5120), (5120, 17408), (5120, 6144)]:
        compare("q4_0", N, K, 1, configs=[None] + cfgs)
if what in ("all", "bn"):
    for B in (2, 4, 8):
        for N, K in [(34816, 5120), (5120, 17408), (16384, 5120)]:
            compare("q4_0", N, K, B)
